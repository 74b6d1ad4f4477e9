"""LoRA supervised fine-tuning on the generated data, resumable.

A run lives in one output directory:

- ``checkpoint/``: the LoRA weights, the optimizer, and ``state.json`` (the step, the examples
  and tokens done, seconds spent, the run's settings); written atomically every
  ``save_every`` steps, at the time limit and on Ctrl-C/SIGTERM. Running the same command
  again picks it up: the data is regenerated from the seed and the run continues at the
  next example, with the same learning-rate schedule.
- ``loss.jsonl``: one line per optimizer step (loss, tokens/s, learning rate); ``loss.png``.
- ``adapter/``: the finished adapter (peft's files and ``manifest.json``), written when every
  example is done.

One step is ``accumulate`` examples, one sequence each (no padding). Loss is on the assistant's
text only. Examples with stuffed chunks read apart train under a block-attention mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import SnapKVRagError
from ..model.adapters import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, linear_module_names
from .compressed_reads import compressed_example_loss
from .dataset import RECIPES, build_examples, encode, summarize, token_counter

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"

log = logging.getLogger(__name__)


class TuneError(SnapKVRagError, ValueError):
    """Settings that cannot train, or a checkpoint made with other settings."""


@dataclass
class TuneConfig:
    model: str = "default"
    # the data and encoding version: 2 reads chunks apart after per-chunk anchor copies (1, the first
    # run's, after the prompt's first token at its own distance); 3 asks fewer unanswerable questions
    # and describes a third of the entities instead of naming them; 4 reads half the QA through the default
    # compression (2K-16K tokens) and adds near misses (dataset.build_examples); a checkpoint of another recipe is not resumed
    recipe: int = 3
    # start from this adapter's weights (same rank) instead of zero: recipe 4 continues recipe 3's adapter
    init_adapter: str | None = None
    seed: int = 0
    examples: int = 560
    rank: int = 16
    alpha: int = 32
    learning_rate: float = 2e-4
    warmup_steps: int = 10
    accumulate: int = 4
    max_tokens: int = 5120  # longer examples are skipped (none at the default budgets)
    qa_share: float = 0.6
    eval_examples: int = 24  # held-out examples whose loss is measured before and after
    dtype: str | None = None
    device: str | None = None
    # not part of what makes a run: may change between resumed invocations
    minutes: float | None = field(default=None, metadata={"resumable": True})
    attn_implementation: str = field(default="sdpa", metadata={"resumable": True})
    # recompute activations in the backward pass instead of holding them: an 8B model at ~4.5K-token
    # examples needs an estimated 60-70 GB without; None: on for CUDA, off on a CPU (time there is the limit)
    gradient_checkpointing: bool | None = field(default=None, metadata={"resumable": True})
    save_every: int = field(default=20, metadata={"resumable": True})

    def check(self) -> None:
        for name in ("examples", "rank", "alpha", "accumulate", "max_tokens", "save_every"):
            if getattr(self, name) < 1:
                raise TuneError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.learning_rate < 1:
            raise TuneError(f"learning_rate must be in (0, 1), got {self.learning_rate}")
        if not 0 <= self.qa_share <= 1:
            raise TuneError(f"qa_share must be in [0, 1], got {self.qa_share}")
        if self.eval_examples < 0 or self.warmup_steps < 0:
            raise TuneError("eval_examples and warmup_steps must be >= 0")
        if self.minutes is not None and self.minutes <= 0:
            raise TuneError(f"minutes must be > 0, got {self.minutes}")
        if self.recipe not in RECIPES:
            raise TuneError(f"recipe must be one of {RECIPES}, got {self.recipe}")
        if self.init_adapter is not None and not (Path(self.init_adapter) / WEIGHTS_FILE).is_file():
            raise TuneError(f"init_adapter {self.init_adapter} holds no {WEIGHTS_FILE}")

    def identity(self) -> dict[str, Any]:
        """The settings a checkpoint must share to be resumed."""
        return {k: v for k, v in asdict(self).items() if not TuneConfig.__dataclass_fields__[k].metadata.get("resumable")}

    @property
    def steps(self) -> int:
        return math.ceil(self.examples / self.accumulate)


def learning_rate(config: TuneConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def example_loss(model, encoded) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the target tokens of one encoded example, and their count.
    Only the target's logits are computed (the target ends the sequence): the output layer over
    a 49K vocabulary is a fifth of a small model's work."""
    mask = encoded.attention_mask()
    positions = encoded.position_ids
    keep = encoded.tokens - encoded.prompt_tokens + 1
    out = model(
        input_ids=encoded.input_ids.to(model.device),
        attention_mask=None if mask is None else mask.to(model.device),
        position_ids=None if positions is None else positions.to(model.device),
        logits_to_keep=keep,
    )
    targets = encoded.input_ids[0, encoded.prompt_tokens :].to(model.device)
    logits = out.logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, targets), targets.numel()


def data_fingerprint(examples) -> str:
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps(e.to_dict(), sort_keys=True).encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def base_model_hash(source: str) -> str:
    """sha256 of the base model's weight files (the converted safetensors for GGUF and the embedded model)."""
    from ..model.loading import resolve_model_source

    path, is_local = resolve_model_source(source)
    if not is_local:
        return f"hub:{path}"
    digest = hashlib.sha256()
    for weight in sorted(Path(path).glob("*.safetensors")):
        digest.update(_file_digest(weight).encode())
    return digest.hexdigest()


class _Stop:
    """Turns SIGTERM and Ctrl-C into a request to finish the current step, checkpoint and stop
    (a step cut in half would save half-applied optimizer moments)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if _main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _save_checkpoint(peft_model, optimizer, state: dict[str, Any], out: Path) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    staging = out / "checkpoint.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(peft_model).items()}
    save_file(weights, str(staging / WEIGHTS_FILE))
    torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
    (staging / STATE_FILE).write_text(json.dumps(state, indent=1))
    _sync(staging)
    final = out / "checkpoint"
    old = out / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)  # a crash from here until the next rename leaves only checkpoint.old, which loading falls back to
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _sync(directory: Path) -> None:
    for path in directory.iterdir():
        with path.open("rb") as fh:
            os.fsync(fh.fileno())


def _load_checkpoint(peft_model, optimizer, out: Path, config: TuneConfig) -> dict[str, Any] | None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    final = out / "checkpoint"
    if not (final / STATE_FILE).is_file():
        final = out / "checkpoint.old"  # a save interrupted between its two renames
    if not (final / STATE_FILE).is_file():
        return None
    state = json.loads((final / STATE_FILE).read_text())
    if state.get("config") != config.identity():
        changed = sorted(k for k in config.identity() if state.get("config", {}).get(k) != config.identity()[k])
        raise TuneError(f"{out} holds a run with other settings ({', '.join(changed)}); use another --out or the same settings to resume")
    set_peft_model_state_dict(peft_model, load_file(str(final / WEIGHTS_FILE)))
    optimizer.load_state_dict(torch.load(final / OPTIMIZER_FILE, weights_only=True))
    return state


def _load_adapter_weights(peft_model, adapter: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(adapter / WEIGHTS_FILE))
    result = set_peft_model_state_dict(peft_model, weights)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
    if missing:
        raise TuneError(f"{adapter}'s weights do not fit this run's LoRA layers (rank or targets differ): {missing[:3]}")


def finished_state(out: Path, config: TuneConfig) -> dict[str, Any] | None:
    """The state of a run in ``out`` that finished with these settings (its adapter written), else None."""
    path = out / "checkpoint" / STATE_FILE
    if not (out / "adapter" / MANIFEST_FILE).is_file() or not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state.get("config") != config.identity() or state.get("examples_done", 0) < config.examples:
        return None
    return {**state, "stopped": None, "already_finished": True}


class ExampleLoss:
    """An example's loss, however it is read: its full prompt at once (block attention for
    segments), or through the compression its ``read`` names (:func:`compressed_example_loss`).
    Returns (loss, target tokens, prompt tokens), or None for a full read longer than ``max_tokens``."""

    def __init__(self, model, tokenizer, max_tokens: int):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def __call__(self, example) -> tuple[torch.Tensor, int, int] | None:
        if example.read:
            return compressed_example_loss(self.model, self.tokenizer, example, self.pad_id)
        item = encode(example, self.tokenizer)
        if item.tokens > self.max_tokens:
            return None
        loss, targets = example_loss(self.model, item)
        return loss, targets, item.tokens


@torch.no_grad()
def heldout_loss(loss_of: ExampleLoss, examples: list) -> float | None:
    total, count = 0.0, 0
    for example in examples:
        measured = loss_of(example)
        if measured is not None:
            total += float(measured[0]) * measured[1]
            count += measured[1]
    return total / count if count else None


def plot_loss(out: Path) -> Path | None:
    path = out / "loss.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # a --no-deps install (the GPU check's): the run and its adapter matter, not the picture
        log.warning("loss.png not drawn: matplotlib is not installed (loss.jsonl has the numbers)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (target tokens)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return out / "loss.png"


def _loss_log(out: Path, step: int) -> Any:
    """The loss log opened for appending, with lines past ``step`` (a run stopped between saves) dropped."""
    path = out / "loss.jsonl"
    if path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line torn by a kill
                continue
        path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def tune(
    config: TuneConfig, out: str | Path, *, model=None, tokenizer=None, progress: bool = True, on_step: Callable[[dict], None] | None = None
) -> dict[str, Any]:
    """Train (or resume) the run in ``out``; returns the final state. ``model``/``tokenizer``:
    an already loaded base (tests); else ``config.model`` is loaded for training."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TuneError("LoRA training needs peft: pip install 'snapkv-rag[tune]' (or peft)") from None
    from tqdm.auto import tqdm

    config.check()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    finished = finished_state(out, config)
    if finished is not None:  # done already: training again would overwrite the adapter and its measured gates
        return finished
    if model is None:
        from ..model.loading import load_model_and_tokenizer

        model, tokenizer, _ = load_model_and_tokenizer(
            config.model, device=config.device, dtype=config.dtype, pack_weights=False, attn_implementation=config.attn_implementation
        )
    count = token_counter(tokenizer)
    examples = build_examples(config.seed, config.examples, "train", count_tokens=count, qa_share=config.qa_share, recipe=config.recipe)
    probe = build_examples(config.seed, config.eval_examples, "heldout", count_tokens=count, qa_share=config.qa_share, recipe=config.recipe)
    if any(e.read for e in examples + probe):
        # compressed reads prefill through the engine's attention functions (plain attention when no policy is active)
        from ..compression.runtime import WRAPPED_IMPLEMENTATIONS, register_attention_functions, wrapped_name

        register_attention_functions()
        if model.config._attn_implementation in WRAPPED_IMPLEMENTATIONS:
            model.set_attn_implementation(wrapped_name(model.config._attn_implementation))

    lora_targets = linear_module_names(model)
    if not lora_targets:
        raise TuneError("this model's decoder has no torch.nn.Linear layers for LoRA to adapt (e.g. GPT-2's Conv1D); it cannot be tuned here")
    model.train()
    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=lora_targets, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    checkpointing = config.gradient_checkpointing
    if checkpointing is None:
        checkpointing = next(model.parameters()).device.type == "cuda"
    if checkpointing:
        # non-reentrant: the frozen embeddings' outputs need no requires_grad for LoRA's gradients to flow
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x; gradient_... before
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0)
    fingerprint = data_fingerprint(examples)
    loss_of = ExampleLoss(peft_model.get_base_model(), tokenizer, config.max_tokens)
    state = _load_checkpoint(peft_model, optimizer, out, config)
    if state is not None and state.get("data_sha256") != fingerprint:
        raise TuneError(
            f"{out} was trained on other data than this version's generator writes for seed {config.seed}; "
            "resume with the version that started it, or use another --out"
        )
    if state is None:
        if config.init_adapter is not None:
            _load_adapter_weights(peft_model, Path(config.init_adapter))
        base_loss = heldout_loss(loss_of, probe)
        state = {
            "config": config.identity(),
            "step": 0,
            "examples_done": 0,
            "tokens": 0,
            "target_tokens": 0,
            "skipped": 0,
            "seconds": 0.0,
            "heldout_loss_base": base_loss,
            "data": summarize(examples),
            "data_sha256": fingerprint,
        }
    log = _loss_log(out, state["step"])
    started, seconds_before = time.monotonic(), state["seconds"]
    bar = tqdm(total=config.examples, initial=state["examples_done"], disable=not progress, unit="ex", desc="tune")
    stopped = None
    try:
        with _Stop() as stop:
            while state["examples_done"] < config.examples:
                step_started = time.monotonic()
                lr = learning_rate(config, state["step"])
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = examples[state["examples_done"] : state["examples_done"] + config.accumulate]
                losses, tokens, targets, skipped = [], 0, 0, 0
                for example in batch:
                    measured = loss_of(example)
                    if measured is None:
                        skipped += 1
                        continue
                    loss, n_targets, n_tokens = measured
                    (loss / len(batch)).backward()
                    losses.append(float(loss.detach()))
                    tokens += n_tokens
                    targets += n_targets
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # the state moves only once the step is applied, so a checkpoint never holds half a step
                state["step"] += 1
                state["examples_done"] += len(batch)
                state["tokens"] += tokens
                state["target_tokens"] += targets
                state["skipped"] += skipped
                state["seconds"] = seconds_before + time.monotonic() - started
                rate = tokens / max(1e-9, time.monotonic() - step_started)
                row = {
                    "step": state["step"],
                    "loss": sum(losses) / max(1, len(losses)),
                    "tokens": tokens,
                    "tokens_per_s": round(rate, 1),
                    "lr": lr,
                    "seconds": round(state["seconds"], 1),
                }
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.update(len(batch))
                bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{rate:.0f}")
                if on_step:
                    on_step(row)
                out_of_time = config.minutes is not None and time.monotonic() - started > config.minutes * 60
                if stop.requested or out_of_time or state["step"] % config.save_every == 0 or state["examples_done"] >= config.examples:
                    _save_checkpoint(peft_model, optimizer, state, out)
                if stop.requested or out_of_time:
                    stopped = stop.requested or f"time limit ({config.minutes} min)"
                    break
    finally:
        bar.close()
        log.close()
    plot_loss(out)
    state["stopped"] = stopped
    if stopped is None:
        state["heldout_loss_tuned"] = heldout_loss(loss_of, probe)
        _write_adapter(peft_model, state, config, out)
    return state


# the settings `snapkv-rag tune train` takes as flags (the rest keep their defaults there)
CLI_FLAGS = ("model", "device", "dtype", "seed", "recipe", "init_adapter", "examples", "rank", "alpha", "learning_rate", "accumulate", "qa_share")


def train_command(config: TuneConfig) -> str:
    """The command line that trains ``config``'s run."""
    flags = (f"--{k.replace('_', '-')} {getattr(config, k)}" for k in CLI_FLAGS if getattr(config, k) is not None)
    return "snapkv-rag tune train " + " ".join(flags)


def _write_adapter(peft_model, state: dict[str, Any], config: TuneConfig, out: Path) -> Path:
    target = out / "adapter"
    staging = out / "adapter.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    peft_model.save_pretrained(str(staging), safe_serialization=True)
    if not (staging / WEIGHTS_FILE).is_file() or not (staging / CONFIG_FILE).is_file():
        raise TuneError(f"peft did not write {WEIGHTS_FILE} and {CONFIG_FILE} in {staging}")
    manifest = {
        "base_model": config.model,
        "base_model_sha256": base_model_hash(config.model) if config.model else None,
        "command": train_command(config),
        "settings": config.identity(),
        "data": {
            "generator": "snapkv_rag.adapter_training.dataset.build_examples",
            "recipe": config.recipe,
            "seed": config.seed,
            "examples": config.examples,
            "kinds": state["data"],
            "qa_share": config.qa_share,
        },
        "training": {k: state[k] for k in ("step", "examples_done", "tokens", "target_tokens", "skipped")}
        | {"minutes": round(state["seconds"] / 60, 1), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()},
        "heldout_loss": {"base": state.get("heldout_loss_base"), "tuned": state.get("heldout_loss_tuned"), "examples": config.eval_examples},
        "gates": None,  # filled by eval/tune/tune_gates.py; the engine loads the adapter by default only when every gate passed
    }
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
