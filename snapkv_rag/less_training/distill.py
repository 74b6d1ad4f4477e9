"""Stage 2 of LESS training: fine-tune all layers' kernels together on the model's own output.

Stage 1 (:mod:`.train`) fits each layer alone to the full attention output, with the full
model's activations as its inputs. At inference every layer sees the compressed model's
activations and the layers' errors compound: stage 1 cuts each layer's error by 10-60% and
still leaves the next-token KL about where the base policy has it. Stage 2 runs the
compressed model the way inference does (kept entries in the cache, the evicted ones
folded into the state, the continuation at its true positions, through the engine's own
decode path) and minimises ``KL(full || LESS)`` of the next-token distributions over the
continuation, the quantity the eval reports. The model stays frozen; gradients reach
only the kernels.

Data: per window, one forward of the frozen model over ``prompt + continuation`` records
every layer's prompt K/V, the base policy's selection per budget (the selection inference
makes) and the full model's next-token log-probabilities on the continuation. Windows of
every prompt length trained on (:func:`collect_lengths`) overlap, spread over the training
split (:func:`~.corpus.overlapping_windows`); the validation windows, in a tail no training
window reaches, choose the epoch that is kept. Training windows are read from disk one at a
time.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..compression import LESS, CompressionPolicy, parse_compression
from ..compression.less.kernels import LayerKernels, LessKernels
from ..compression.runtime import capturing, select_for_prompt
from ..errors import LessTrainingError
from ..model.packed_linear import unpacked_linears
from .corpus import corpus_tokens, overlapping_windows, validation_tail

if TYPE_CHECKING:
    from ..compression.less.state import LowRankState


@dataclass
class DistillConfig:
    epochs: int = 2
    lr: float = 1e-2
    scale_lr: float = 1e-2
    seed: int = 0
    # "all": every kernel tensor; "calibration": only the biases (mlp: the output biases and the
    # key scales), which set how much mass the state claims per head (a few thousand numbers; cannot memorise)
    params: str = "calibration"


CALIBRATION = {"mlp": ("b2",), "exp": ("b", "bm")}  # per feature kind: the output (mlp) or only (exp; and mass-only features') biases


class _PromptCapture:
    """Attention-function callback: each layer's prompt K/V and the base policy's selections."""

    def __init__(self, policies: dict[int, CompressionPolicy], prompt_tokens: int):
        self.policies = policies
        self.n = prompt_tokens
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.kept: dict[int, dict[int, torch.Tensor]] = {b: {} for b in policies}

    def __call__(self, module, query, key, value, output, scaling) -> None:
        n, layer = self.n, module.layer_idx
        self.keys[layer] = key[0, :, :n].half().cpu()
        self.values[layer] = value[0, :, :n].half().cpu()
        for budget, policy in self.policies.items():
            self.kept[budget][layer] = select_for_prompt(policy, query[:, :, :n], key[:, :, :n], None, scaling)[0].to(torch.int16).cpu()


def collect_lengths(
    engine,
    base: str,
    budgets: list[int],
    prompt_tokens: list[int],
    continuation_tokens: int,
    sequences: list[int],
    val_sequences: int,
    work: Path,
    progress: bool = True,
    text: str = "pydoc",
) -> tuple[list[Path], list[Path]]:
    """:func:`collect` for each prompt length (``sequences[i]`` training windows of ``prompt_tokens[i]``),
    every length's validation windows in the tail the longest length needs; returns all (train, val) paths."""
    tail = validation_tail(val_sequences, prompt_tokens, continuation_tokens)
    train, val = [], []
    for n, count in zip(prompt_tokens, sequences):
        t, v = collect(engine, base, budgets, n, continuation_tokens, count, val_sequences, work, progress, tail=tail, text=text)
        train += t
        val += v
    return train, val


def collect(
    engine,
    base: str,
    budgets: list[int],
    prompt_tokens: int,
    continuation_tokens: int,
    sequences: int,
    val_sequences: int,
    work: Path,
    progress: bool = True,
    tail: int | None = None,
    text: str = "pydoc",
) -> tuple[list[Path], list[Path]]:
    """Write one file per window under ``work/distill-<settings hash>`` (skipping those already
    there; the collection time, summed over resumed runs, is in its ``seconds.json``);
    returns (train, val) paths. ``tail``: see :func:`~.corpus.overlapping_windows`."""
    policy = parse_compression(base)
    length = prompt_tokens + continuation_tokens
    train, val = overlapping_windows(corpus_tokens(engine.tokenizer, "train", text), length, sequences, val_sequences, tail)
    settings = json.dumps(
        [policy.spec(), prompt_tokens, continuation_tokens, sequences, val_sequences] + ([] if tail is None else [tail]) + ([] if text == "pydoc" else [text])
    )
    directory = work / f"distill-{hashlib.sha256(settings.encode()).hexdigest()[:12]}"  # one directory per data setting
    paths = collect_windows(engine, policy, budgets, train + val, prompt_tokens, continuation_tokens, directory, progress)
    return paths[: len(train)], paths[len(train) :]


def collect_windows(
    engine,
    policy: CompressionPolicy,
    budgets: list[int],
    seqs: list[list[int]],
    prompt_tokens: int,
    continuation_tokens: int,
    directory: Path,
    progress: bool = True,
) -> list[Path]:
    """Record each window of ``seqs`` (:func:`record_window`) into ``directory/seqNNNN.pt``, skipping
    files already there (the collection time, summed over resumed runs, is in ``seconds.json``)."""
    policies = {b: policy.with_budget(b) for b in budgets}
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / "budgets.json"  # the budgets whose selections the files hold
    if manifest.exists() and not set(budgets) <= set(json.loads(manifest.read_text())):
        raise LessTrainingError(f"{directory} was collected for budgets {json.loads(manifest.read_text())}, not {sorted(budgets)}; use another work dir")
    if not manifest.exists():
        manifest.write_text(json.dumps(sorted(budgets)))
    timing_path = directory / "seconds.json"
    paths = []
    for i, seq in enumerate(tqdm(seqs, desc="distill data", disable=not progress)):
        path = directory / f"seq{i:04d}.pt"
        paths.append(path)
        if path.exists():
            continue
        start = time.perf_counter()
        torch.save(record_window(engine, policies, seq, prompt_tokens, continuation_tokens), path)
        spent = collection_seconds(directory) + time.perf_counter() - start
        timing_path.write_text(json.dumps({"seconds": spent}))
    return paths


def record_window(engine, policies: dict[int, CompressionPolicy], tokens: list[int], prompt_tokens: int, continuation_tokens: int) -> dict[str, torch.Tensor]:
    """One forward of the frozen model over ``tokens`` (prompt + continuation): every layer's prompt
    K/V (fp16), each budget's selection and the full model's continuation log-probabilities."""
    grab = _PromptCapture(policies, prompt_tokens)
    with torch.inference_mode(), capturing(grab):
        logits = engine.model(input_ids=torch.tensor([tokens], device=engine.device), use_cache=False, logits_to_keep=continuation_tokens).logits
    layers = sorted(grab.keys)
    return {
        "tokens": torch.tensor(tokens),
        "keys": torch.stack([grab.keys[i] for i in layers]),
        "values": torch.stack([grab.values[i] for i in layers]),
        **{f"kept{b}": torch.stack([grab.kept[b][i] for i in layers]) for b in policies},
        # positions n .. n+c-2 predict continuation tokens 1 .. c-1 (row n-1 is the prefill's)
        "log_probs": logits[0, :-1].float().log_softmax(-1).half().cpu(),
    }


def collection_seconds(directory: Path) -> float:
    """Seconds spent collecting the windows in ``directory`` (a collect directory), over all runs."""
    path = directory / "seconds.json"
    return json.loads(path.read_text())["seconds"] if path.exists() else 0.0


def load_work_file(path: Path) -> Any:
    """A file of a training work folder (capture shards, their metadata, recorded windows): tensors,
    numbers and strings in dicts and lists only, loaded with ``weights_only=True`` so that a
    tampered work folder cannot run code (torch before 2.6 unpickled anything by default)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise LessTrainingError(
            f"{path} holds more than tensors and numbers, so it is not loaded (a file from another program, or tampered with): "
            f"delete it, or the work folder, to record it again ({str(exc).splitlines()[0]})"
        ) from None


def less_log_probs(engine, policy: LESS, kernels: LessKernels, sample: dict[str, torch.Tensor], budget: int, state: LowRankState | None = None) -> torch.Tensor:
    """Log-probabilities ``[c-1, vocab]`` of the continuation under LESS, differentiable in the kernels.

    Rebuilds the state the compressed prefill would leave (kept K/V in the cache, evicted
    K/V folded into the low-rank state) from the recorded prompt K/V and selection, then
    runs the continuation through the engine's decode path
    (:func:`~snapkv_rag.engine.token_runs.logits_after_recorded_prefill`). ``state``:
    an empty state to fold into instead of ``LowRankState(kernels)`` (the gap analysis's).
    """
    from ..compression.less.state import LessPolicyState, LowRankState
    from ..engine.token_runs import logits_after_recorded_prefill

    def folding_state(budgeted, device, sliding):
        return LessPolicyState(state if state is not None else LowRankState(kernels, device), policy.base, sliding)

    kept = sample[f"kept{budget}"]
    logits = logits_after_recorded_prefill(
        engine.model, engine.pad_id, sample["tokens"].tolist(), policy.with_budget(budget), folding_state, sample["keys"], sample["values"], kept
    )
    return logits.float().log_softmax(-1)


def _kl(full_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """KL(full || compressed) per position, averaged; the saved full-cache log-probs live on the
    CPU (the work folder), the compressed ones on the model's device: computed on the latter."""
    full = full_log_probs.to(log_probs.device).float()
    return (full.exp() * (full - log_probs)).sum(-1).mean()


def _trainable(kernels: LessKernels, params: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Detached leaf copies of the trained kernel tensors (in place in ``kernels``); mlp key scales as logs."""
    weights, log_scales = [], []
    for layer in kernels.layers.values():
        for part in (layer.phi, layer.psi):
            for name in list(part):
                if name == "scale" or (params == "calibration" and name not in CALIBRATION[layer.kind]):
                    continue
                part[name] = part[name].detach().clone().requires_grad_()
                weights.append(part[name])
        if "scale" in layer.psi:
            log_scales.append(layer.psi["scale"].detach().abs().clamp_min(1e-12).log().requires_grad_())
    return weights, log_scales


def _apply_scales(kernels: LessKernels, log_scales: list[torch.Tensor]) -> None:
    for layer, log_scale in zip([k for k in kernels.layers.values() if "scale" in k.psi], log_scales):
        layer.psi["scale"] = log_scale.exp()


def _frozen(kernels: LessKernels) -> LessKernels:
    """A detached copy (a snapshot of the kernels being trained)."""

    def copy(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in params.items()}

    return LessKernels({i: LayerKernels(copy(k.phi), copy(k.psi), k.kind) for i, k in kernels.layers.items()}, kernels.header)


def evaluate(engine, policy: LESS, kernels: LessKernels, samples: list[dict], budget: int) -> float:
    with torch.no_grad():
        return sum(float(_kl(s["log_probs"], less_log_probs(engine, policy, kernels, s, budget))) for s in samples) / len(samples)


def distill(
    engine, kernels: LessKernels, train_paths: list[Path], val_paths: list[Path], budget: int, config: DistillConfig, progress: bool = True
) -> tuple[LessKernels, dict[str, Any]]:
    """Fine-tune ``kernels`` (stage 1's, a copy is trained) on the end-to-end KL; returns the best epoch's.

    The model's parameters are frozen for the run and given back their ``requires_grad`` after;
    oneDNN-packed layers run plain for it (the packed ones have no gradient)."""
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with unpacked_linears(engine.model):  # gradients flow through the model's layers to the kernels
            return _distill(engine, kernels, train_paths, val_paths, budget, config, progress)
    finally:
        for p in trainable:
            p.requires_grad_(True)


def _distill(engine, kernels: LessKernels, train_paths, val_paths, budget: int, config: DistillConfig, progress: bool) -> tuple[LessKernels, dict[str, Any]]:
    val = [load_work_file(p) for p in val_paths]  # training windows are read one at a time (several GB in all)
    policy = LESS(base=parse_compression(kernels.header["base_spec"]).with_budget(budget), kernels=kernels)
    base_policy = policy.base
    base_kl = evaluate(engine, policy, LessKernels.zeros(kernels.header["model"], rank=kernels.rank, hidden=1), val, budget)
    trained = _frozen(kernels)
    weights, log_scales = _trainable(trained, config.params)
    optim = torch.optim.Adam([{"params": weights, "lr": config.lr}] + ([{"params": log_scales, "lr": config.scale_lr}] if log_scales else []))
    generator = torch.Generator().manual_seed(config.seed)
    history = [{"epoch": 0, "val_kl": evaluate(engine, policy, _frozen(trained), val, budget)}]
    best = (history[0]["val_kl"], _frozen(trained), 0)
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        order = torch.randperm(len(train_paths), generator=generator).tolist()
        total = 0.0
        for i in tqdm(order, desc=f"distill b={budget} epoch {epoch}", disable=not progress, leave=False):
            _apply_scales(trained, log_scales)
            sample = load_work_file(train_paths[i])
            loss = _kl(sample["log_probs"], less_log_probs(engine, policy, trained, sample, budget))
            optim.zero_grad()
            loss.backward()
            optim.step()
            total += float(loss.detach())
        _apply_scales(trained, log_scales)
        val_kl = evaluate(engine, policy, _frozen(trained), val, budget)
        history.append({"epoch": epoch, "train_kl": total / len(train_paths), "val_kl": val_kl})
        if progress:
            tqdm.write(json.dumps({"budget": budget, **history[-1], "base_val_kl": base_kl}))
        if val_kl < best[0]:
            best = (val_kl, _frozen(trained), epoch)
    report = {
        "base_spec": base_policy.spec(),
        "val_kl_base": base_kl,
        "val_kl_stage1": history[0]["val_kl"],
        "val_kl": best[0],
        "best_epoch": best[2],
        "history": history,
        "seconds": round(time.perf_counter() - start, 3),
        "settings": asdict(config),
    }
    return best[1], report
