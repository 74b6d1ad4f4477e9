"""``snapkv-rag less calibrate``: fit LESS's cheap stage on a collection's own documents, and keep it only if it helps.

The shipped kernels were trained on Python documentation; on other text the mass they claim
for the evicted entries can be off (issue 30: on document-QA prompts shipped LESS was slightly
worse than SnapKV alone). Calibration runs stage 2 of training (:mod:`.distill`) with only the
calibration parameters (the feature biases that set how much mass the state claims per head,
a few thousand numbers) on windows of the collection's text, starting from the shipped (or
given) kernels, and compares the result with the base policy alone on held-out windows of the
same text:

- the calibrated kernels are stored beside the collection, with a JSON report;
- when they do not beat the base policy's next-token KL on the held-out windows, the report
  says so and :func:`policy_for_collection` gives the base policy instead, so LESS is never
  used where it measured worse than its base.

:class:`~snapkv_rag.rag.qa.DocumentQA` (and so ``snapkv-rag ask``) applies this to every LESS
policy without explicit kernels.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..compression import LESS, CompressionPolicy
from ..compression.less.collection_kernels import REPORT, calibration_dir, calibration_key
from ..compression.less.kernels import LessKernels, model_signature
from ..errors import LessTrainingError
from .corpus import overlapping_windows
from .distill import DistillConfig, collect_windows, distill


@dataclass
class CalibrationConfig:
    budget: int = 256
    base: str = "snapkv"  # the base policy's spec (its budget is set by ``budget``)
    prompt_tokens: int = 2048
    continuation_tokens: int = 64
    windows: int = 24  # training windows, spread over the text before the held-out tail
    val_windows: int = 4
    epochs: int = 2
    lr: float = 1e-2
    seed: int = 0


def collection_text(store) -> str:
    """The collection's chunks, file by file, each file's in order (chunk overlaps appear twice)."""
    chunks = sorted(store.all_chunks(), key=lambda c: (c.file, c.position))
    return "\n\n".join(c.text for c in chunks)


def calibrate(
    engine, store, config: CalibrationConfig | None = None, *, kernels: str | Path | LessKernels | None = None, work: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Calibrate LESS for ``store``'s collection; writes the kernels and the report, returns the report.

    ``kernels``: where to start (default: the shipped kernels for the model, base and budget);
    ``work``: the folder for the run's temporary window recordings (default: the system's)."""
    config = config or CalibrationConfig()
    start = time.perf_counter()
    tokenizer = engine.tokenizer
    tokens = list(tokenizer(collection_text(store), add_special_tokens=False)["input_ids"])
    length = config.prompt_tokens + config.continuation_tokens
    needed = (config.val_windows + 1) * length
    if len(tokens) < needed:
        raise LessTrainingError(
            f"collection {store.name!r} has {len(tokens)} tokens; calibrating at {config.prompt_tokens}-token prompts needs at least {needed} "
            f"(one training and {config.val_windows} held-out windows of {length}); use --prompt-tokens or --val-windows lower"
        )
    train_windows, val_windows = overlapping_windows(tokens, length, config.windows, config.val_windows)
    policy = LESS(base=_base_policy(config), kernels=str(kernels) if isinstance(kernels, Path) else kernels)
    start_kernels = policy.load_kernels(engine.model)
    signature = model_signature(engine.model)
    out = calibration_dir(store)
    base_spec = policy.base.spec()
    # the recorded windows (about 50 MB each on the embedded model) live only as long as the run
    with tempfile.TemporaryDirectory(prefix="less-calibrate-", dir=_existing(work)) as tmp:
        record = partial(
            collect_windows,
            engine,
            policy.base,
            [config.budget],
            prompt_tokens=config.prompt_tokens,
            continuation_tokens=config.continuation_tokens,
            progress=progress,
        )
        train_paths = record(train_windows, directory=Path(tmp) / "train")
        val_paths = record(val_windows, directory=Path(tmp) / "val")
        header = {**start_kernels.header, "base_spec": base_spec, "budget": config.budget}
        settings = DistillConfig(epochs=config.epochs, lr=config.lr, scale_lr=config.lr, seed=config.seed, params="calibration")
        trained, report = distill(engine, LessKernels(start_kernels.layers, header), train_paths, val_paths, config.budget, settings, progress)
    use_less = report["val_kl"] < report["val_kl_base"]
    stem = calibration_key(signature, policy.base)
    path = LessKernels(trained.layers, {**header, "calibration": {"collection": store.name, "distill": report}}).save(out / f"{stem}.safetensors")
    summary = {
        "collection": store.name,
        "model": signature,
        "base": policy.base.name,
        "base_spec": base_spec,
        "budget": config.budget,
        "kernels": str(path),
        "start_kernels": policy.kernels_label(),
        "use": "less" if use_less else "base",
        "val_kl_base": report["val_kl_base"],
        "val_kl_start": report["val_kl_stage1"],
        "val_kl_calibrated": report["val_kl"],
        "gap_closed": 1 - report["val_kl"] / report["val_kl_base"] if report["val_kl_base"] > 0 else None,
        "best_epoch": report["best_epoch"],
        "windows": {"train": len(train_paths), "val": len(val_paths), "tokens": len(tokens)},
        "settings": asdict(config),
        "seconds": round(time.perf_counter() - start, 1),
    }
    _write_report(out, stem, summary)
    return summary


def _existing(work: Path | None) -> str | None:
    if work is None:
        return None
    work.mkdir(parents=True, exist_ok=True)
    return str(work)


def _base_policy(config: CalibrationConfig) -> CompressionPolicy:
    from ..compression import FullCache, parse_compression

    base = parse_compression(config.base)
    if isinstance(base, (FullCache, LESS)) or base.ragged_heads:
        raise LessTrainingError(f"the base must be a sparse policy with the same entries in every head (snapkv, h2o, ...), not {config.base!r}")
    return base.with_budget(config.budget)


def _write_report(out: Path, stem: str, summary: dict[str, Any]) -> None:
    path = out / REPORT
    reports = json.loads(path.read_text()) if path.exists() else {}
    reports[stem] = summary
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reports, indent=2, sort_keys=True))


def describe_calibration(summary: dict[str, Any]) -> str:
    verdict = "LESS is used for this collection" if summary["use"] == "less" else "LESS measured worse than its base here, so the base policy is used"
    return (
        f"calibrated {summary['base']} budget {summary['budget']} on {summary['windows']['train']} windows of {summary['collection']!r}: "
        f"held-out KL base {summary['val_kl_base']:.4f}, shipped LESS {summary['val_kl_start']:.4f}, calibrated {summary['val_kl_calibrated']:.4f}; "
        f"{verdict} ({summary['kernels']})"
    )
