"""Train LESS kernels for a frozen model, one layer at a time (``snapkv-rag less train``).

1. Capture. Each training sequence is ``n + continuation_tokens`` tokens of the training split
   (:mod:`.corpus`), for each prompt length ``n`` in ``prompt_tokens`` (several lengths, so the
   kernels see the evicted-set sizes and key positions of every prompt length they serve). One forward of the frozen model runs through the
   engine's registered attention function, which hands every layer's post-RoPE Q, K, V and
   its full-attention output (before ``o_proj``) to :class:`Capture`. The base policy selects
   over the *prompt* exactly as at inference (SnapKV: its observation window is the end of the
   prompt; H2O: all prompt queries), once per budget. Per layer, the continuation's queries and
   outputs, all keys and values and the kept indices are written to shards on disk.
2. Train. Per layer (independent, so only one layer's data is in memory) and budget: the
   continuation queries attend exactly to the kept prompt entries plus the continuation
   (causal), and through the state to the evicted prompt entries (:meth:`~.kernels.LayerKernels.fold`,
   :meth:`~.kernels.LayerKernels.estimate` and :func:`~.state.merge`, the same code as inference;
   ``features`` picks the feature maps, exponential by default). Loss: MSE of ``o_proj(LESS output)`` against
   ``o_proj(full output)`` on the continuation positions (all past the budget). Adam, step
   decay, a fixed seed; each finished layer is saved, so an interrupted run resumes.

The continuation queries are what the kernels serve at inference: decode steps (and
teacher-forced tokens) after a compressed prompt.

3. Distil (stage 2, :mod:`.distill`, unless ``distill_epochs`` is 0): all layers together on
   the end-to-end KL of the next-token distributions.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..compression import CompressionPolicy, parse_compression
from ..compression.less.kernels import FEATURE_KINDS, FORMAT, LayerKernels, LessKernels, load_kernels, model_signature
from ..compression.less.state import merge
from ..compression.runtime import select_for_prompt
from ..errors import LessTrainingError
from .corpus import TEXTS, corpus_tokens, manifest, overlapping_windows, validation_tail
from .distill import DistillConfig, collect_lengths, collection_seconds, distill, load_work_file


@dataclass
class TrainConfig:
    base: str = "snapkv"  # base policy spec; its budget is replaced by each of ``budgets``
    budgets: list[int] = field(default_factory=lambda: [256])
    # prompt lengths trained on, and windows of each (``val_sequences`` of each validate); a
    # single number applies to every length; None: about 80K prompt tokens per length
    prompt_tokens: list[int] = field(default_factory=lambda: [2048, 4096])
    continuation_tokens: int = 128
    sequences: int | list[int] | None = None  # a list per prompt length after __post_init__
    val_sequences: int = 4
    rank: int = 8
    mass_rank: int | None = None  # exp features only: extra features that estimate only the evicted mass; None: 32 for exp, 0 for mlp
    features: str = "exp"  # feature maps (:mod:`.kernels`): "exp" (exponential, the default) or "mlp" (less.md's)
    hidden: int = 32  # mlp features only
    epochs: int = 20
    batch: int = 4
    lr: float | None = None  # None: 1e-2 for exp features, 3e-3 for mlp
    scale_lr: float = 5e-2
    init_scale: float = 1e-4
    seed: int = 0
    shard: int = 8  # sequences per capture shard
    # stage 2 (:mod:`.distill`): all layers together on the end-to-end KL; 0 epochs skips it
    distill_epochs: int = 2
    distill_sequences: int | list[int] | None = (
        None  # (a list after __post_init__) training windows per prompt length; None: about 240K prompt tokens per length
    )
    distill_lr: float = 1e-2
    distill_params: str = "calibration"  # or "all" (every kernel tensor; overfits 120 windows, see distill.py)
    text: str = "mixed"  # training text (:mod:`.corpus`): "pydoc", "packages" or "mixed"

    def __post_init__(self) -> None:
        self.prompt_tokens = _as_list(self.prompt_tokens)
        self.sequences = _per_length(self.sequences, self.prompt_tokens, 40 * 2048)
        self.distill_sequences = _per_length(self.distill_sequences, self.prompt_tokens, 120 * 2048)
        if self.lr is None:
            self.lr = 1e-2 if self.features == "exp" else 3e-3
        if self.mass_rank is None:
            self.mass_rank = 32 if self.features == "exp" else 0

    @property
    def sequence_counts(self) -> list[int]:
        assert isinstance(self.sequences, list)  # normalised by __post_init__
        return self.sequences

    @property
    def distill_counts(self) -> list[int]:
        assert isinstance(self.distill_sequences, list)  # normalised by __post_init__
        return self.distill_sequences

    @property
    def mass_features(self) -> int:
        assert self.mass_rank is not None  # resolved by __post_init__
        return self.mass_rank

    def check(self) -> None:
        if not self.prompt_tokens or min(self.prompt_tokens) < 1 or len(set(self.prompt_tokens)) != len(self.prompt_tokens):
            raise LessTrainingError(f"prompt_tokens must be distinct positive lengths, got {self.prompt_tokens}")
        for name in ("sequences", "distill_sequences"):
            if len(getattr(self, name)) != len(self.prompt_tokens):
                raise LessTrainingError(f"{name} {getattr(self, name)} needs one count per prompt length {self.prompt_tokens} (or a single count)")
        if min(self.sequence_counts) <= self.val_sequences or self.val_sequences < 1:
            raise LessTrainingError(f"need more sequences ({self.sequences}) than validation sequences ({self.val_sequences}), and at least one of those")
        for name in ("continuation_tokens", "rank", "hidden", "epochs", "batch", "shard"):
            if getattr(self, name) < 1:
                raise LessTrainingError(f"{name} must be positive")
        if self.distill_epochs < 0 or (self.distill_epochs and min(self.distill_counts) < 1):
            raise LessTrainingError("distill_epochs must be >= 0, and distill_sequences positive when distilling")
        if self.features not in FEATURE_KINDS:
            raise LessTrainingError(f"features must be one of {', '.join(FEATURE_KINDS)}, got {self.features!r}")
        if self.mass_features < 0 or (self.mass_rank and self.features != "exp"):
            raise LessTrainingError(f"mass_rank must be >= 0, and needs features='exp' (got {self.mass_rank} with {self.features!r})")
        if self.text not in TEXTS:
            raise LessTrainingError(f"text must be one of {', '.join(TEXTS)}, got {self.text!r}")
        if self.distill_params not in ("calibration", "all"):
            raise LessTrainingError(f"distill_params must be 'calibration' or 'all', got {self.distill_params!r}")
        for budget in self.budgets:
            if budget >= min(self.prompt_tokens):
                raise LessTrainingError(f"budget {budget} must be below prompt_tokens {min(self.prompt_tokens)}")

    @property
    def validation_tail(self) -> int:
        """Tokens at the end of the training split kept for validation windows (of every length)."""
        return validation_tail(self.val_sequences, self.prompt_tokens, self.continuation_tokens)


def _as_list(value: int | list[int]) -> list[int]:
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _per_length(value: int | list[int] | None, lengths: list[int], default_tokens: int) -> list[int]:
    """One window count per prompt length: a single count is used for every length; None gives
    each length about ``default_tokens`` prompt tokens."""
    if value is None:
        return [max(8, round(default_tokens / max(n, 1))) for n in lengths]
    counts = _as_list(value)
    return counts * len(lengths) if len(counts) == 1 else counts


class Capture:
    """Attention-function callback that collects one layer-sharded batch of training data."""

    def __init__(self, policies: dict[int, CompressionPolicy], prompt_tokens: int):
        self.policies = policies
        self.n = prompt_tokens
        self.layers: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.meta: dict[int, dict[str, Any]] = {}

    def __call__(self, module, query, key, value, output, scaling) -> None:
        n = self.n
        layer = self.layers.setdefault(module.layer_idx, {"q": [], "k": [], "v": [], "out": [], **{f"kept{b}": [] for b in self.policies}})
        layer["q"].append(query[0, :, n:].half().cpu())  # training runs on the CPU
        layer["k"].append(key[0].half().cpu())
        layer["v"].append(value[0].half().cpu())
        layer["out"].append(output[0, n:].half().cpu())  # [c, q_heads, d]
        for budget, policy in self.policies.items():
            layer[f"kept{budget}"].append(select_for_prompt(policy, query[:, :, :n], key[:, :, :n], None, scaling)[0].to(torch.int16).cpu())
        if module.layer_idx not in self.meta:
            o_proj = getattr(module, "o_proj", None)
            if o_proj is None:
                raise LessTrainingError("LESS training needs the attention module's output projection (o_proj)")
            # plain numbers and tensors only: the work folder is read back with torch.load(weights_only=True)
            scale = None if scaling is None else float(scaling)
            self.meta[module.layer_idx] = {"scaling": scale, "o_proj": o_proj.weight.detach().float().cpu().clone()}

    def save(self, directory: Path, shard: int) -> None:
        for layer_idx, data in self.layers.items():
            path = directory / f"layer{layer_idx:03d}" / f"shard{shard:04d}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: torch.stack(v) for k, v in data.items()}, path)
        self.layers = {}


def capture(engine, config: TrainConfig, work: Path, progress: bool = True) -> dict[str, Any]:
    """Write the capture shards under ``work/capture/p<prompt length>`` (skipping shards already there).

    Per prompt length, ``sequences - val_sequences`` overlapping training windows spread over the
    split before the validation tail, then ``val_sequences`` validation windows in the tail."""
    from ..compression.runtime import capturing

    base = parse_compression(config.base)
    policies = {b: base.with_budget(b) for b in config.budgets}
    tokens = corpus_tokens(engine.tokenizer, "train", config.text)
    root = work / "capture"
    root.mkdir(parents=True, exist_ok=True)
    timing_path = root / "seconds.json"  # capture time so far, across resumed runs
    spent = json.loads(timing_path.read_text())["seconds"] if timing_path.exists() else 0.0
    layers = engine.info().num_layers
    counts = {}
    meta = None
    meta_saved = (root / "meta.pt").exists()
    for n, count in zip(config.prompt_tokens, config.sequence_counts):
        length = n + config.continuation_tokens
        train_seqs, val_seqs = overlapping_windows(tokens, length, count - config.val_sequences, config.val_sequences, config.validation_tail)
        seqs = train_seqs + val_seqs
        if len(seqs) < count:
            raise LessTrainingError(f"the training split has {len(tokens)} tokens: only {len(seqs)} windows of {length}, {count} asked for")
        directory = root / f"p{n}"
        grab = Capture(policies, n)
        bar = tqdm(total=len(seqs), desc=f"capture {n}", disable=not progress)
        for s, lo in enumerate(range(0, len(seqs), config.shard)):
            chunk = seqs[lo : lo + config.shard]
            have_meta = meta_saved or meta or grab.meta  # a missing meta.pt is written again from one captured shard
            if have_meta and all((directory / f"layer{i:03d}" / f"shard{s:04d}.pt").exists() for i in range(layers)):
                bar.update(len(chunk))
                continue
            start = time.perf_counter()
            for seq in chunk:
                with torch.inference_mode(), capturing(grab):
                    engine.model(input_ids=torch.tensor([seq], device=engine.device), use_cache=False, logits_to_keep=1)
                bar.update()
            grab.save(directory, s)
            spent += time.perf_counter() - start
            timing_path.write_text(json.dumps({"seconds": spent}))
        bar.close()
        meta = grab.meta or meta
        counts[str(n)] = len(seqs)
    if meta:
        torch.save(meta, root / "meta.pt")
    return {
        "train_tokens": len(tokens),
        "sequences": sum(counts.values()),
        "sequences_per_prompt_length": counts,
        "continuation_tokens": config.continuation_tokens,
        "validation_tail_tokens": config.validation_tail,
        "capture_seconds": round(spent, 3),
    }


def _load_layer(work: Path, layer_idx: int, prompt_tokens: int) -> dict[str, torch.Tensor]:
    shards = sorted((work / "capture" / f"p{prompt_tokens}" / f"layer{layer_idx:03d}").glob("shard*.pt"))
    parts = [load_work_file(p) for p in shards]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def sparse_attention(q, k, v, kept, n: int, scaling: float, chunk: int = 4):
    """Exact attention of continuation queries over kept prompt entries plus the continuation.

    ``q [N, hq, c, d]``, ``k, v [N, hkv, n + c, d]``, ``kept [N, hkv, B]`` (prompt indices).
    Returns ``out [N, hkv, g, c, d]``, ``lse [N, hkv, g, c]`` and ``evicted [N, hkv, n]`` (fp32).
    """
    N, hq, c, d = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = hq // hkv
    visible = torch.zeros(N, hkv, L, dtype=torch.bool).scatter_(2, kept.long(), True)
    evicted = ~visible[:, :, :n]
    visible[:, :, n:] = True  # the continuation itself is always in the cache (causal below)
    causal = torch.arange(L)[None, :] <= (n + torch.arange(c))[:, None]  # [c, L]
    causal[:, :n] = True
    outs, lses = [], []
    for lo in range(0, N, chunk):
        qs = q[lo : lo + chunk].float().reshape(-1, hkv, g, c, d)
        scores = torch.einsum("bhgcd,bhld->bhgcl", qs, k[lo : lo + chunk].float()) * scaling
        mask = visible[lo : lo + chunk, :, None, None, :] & causal[None, None, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append(torch.einsum("bhgcl,bhld->bhgcd", scores.softmax(-1), v[lo : lo + chunk].float()))
    return torch.cat(outs), torch.cat(lses), evicted


def _parameters(kernels: LayerKernels) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The tensors to train, and (mlp features) the key scales as logs, trained apart."""
    params = [t.requires_grad_() for part in (kernels.phi, kernels.psi) for name, t in part.items() if name != "scale"]
    log_scale = kernels.psi["scale"].abs().log().requires_grad_() if "scale" in kernels.psi else None
    return params, log_scale


def _layer_loss(kernels: LayerKernels, log_scale, data: dict[str, torch.Tensor], idx, o_proj) -> torch.Tensor:
    layer = kernels if log_scale is None else LayerKernels(kernels.phi, dict(kernels.psi, scale=log_scale.exp()), kernels.kind)
    return _projected_mse(layer_output(layer, data, idx), data["target"][idx], o_proj)


def layer_output(layer: LayerKernels, data: dict[str, torch.Tensor], idx) -> torch.Tensor:
    """LESS attention output ``[N, hkv, g, c, d]`` of the windows ``idx`` of prepared data: the
    evicted prompt entries folded into the state, merged with the exact attention over the rest."""
    n = data["evicted"].shape[-1]
    state = layer.fold(data["k"][idx, :, :n], data["v"][idx, :, :n], data["evicted"][idx])
    return merge(data["sparse"][idx], data["lse"][idx], *layer.estimate(data["q"][idx], state))


def _projected_mse(out: torch.Tensor, target: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """MSE after the output projection; ``out [b, hkv, g, c, d]``, ``target [b, c, hq, d]``."""
    b, hkv, g, c, d = out.shape
    flat = out.permute(0, 3, 1, 2, 4).reshape(b, c, hkv * g * d)
    return ((flat - target.reshape(b, c, -1)) @ o_proj.T).pow(2).mean()


def train_layer(groups: list[dict[str, torch.Tensor]], kernels: LayerKernels, o_proj: torch.Tensor, config: TrainConfig, seed: int) -> dict[str, float]:
    """Fit one layer's kernels in place on ``groups`` (one per prompt length; a batch never mixes
    lengths); returns the validation MSEs (base policy alone vs LESS), averaged over all
    validation windows."""
    splits = [(g["q"].shape[0] - config.val_sequences, g["q"].shape[0]) for g in groups]
    params, log_scale = _parameters(kernels)
    groups_lr = [{"params": params, "lr": config.lr}] + ([{"params": [log_scale], "lr": config.scale_lr}] if log_scale is not None else [])
    optim = torch.optim.Adam(groups_lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [config.epochs // 2, 3 * config.epochs // 4], gamma=0.3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(config.epochs):
        batches = []
        for g, (train_n, _) in enumerate(splits):
            order = torch.randperm(train_n, generator=generator)
            batches += [(g, order[lo : lo + config.batch]) for lo in range(0, train_n, config.batch)]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            g, idx = batches[b]
            loss = _layer_loss(kernels, log_scale, groups[g], idx, o_proj)
            optim.zero_grad()
            loss.backward()
            optim.step()
        sched.step()
    with torch.no_grad():
        if log_scale is not None:
            kernels.psi["scale"] = log_scale.exp().detach()
        for part in (kernels.phi, kernels.psi):
            for name in part:
                part[name] = part[name].detach()
        base = less = 0.0
        for group, (train_n, N) in zip(groups, splits):
            val = torch.arange(train_n, N)
            base += float(_projected_mse(group["sparse"][val], group["target"][val], o_proj)) / len(groups)
            less += float(_layer_loss(kernels, None, group, val, o_proj)) / len(groups)
    return {"val_mse_base": base, "val_mse_less": less}


def _prepare(raw: dict[str, torch.Tensor], budget: int, n: int, scaling: float) -> dict[str, torch.Tensor]:
    sparse, lse, evicted = sparse_attention(raw["q"], raw["k"], raw["v"], raw[f"kept{budget}"], n, scaling)
    return {
        "q": raw["q"].float(),
        "k": raw["k"].float(),
        "v": raw["v"].float(),
        "target": raw["out"].float(),
        "sparse": sparse,
        "lse": lse,
        "evicted": evicted,
    }


def kernel_name(model_tag: str, base: str, budget: int) -> str:
    return f"{model_tag}-{base}-b{budget}.safetensors"


def _collect_distill_windows(engine, config: TrainConfig, work: Path, progress: bool):
    """Stage 2's recorded training and validation windows (:func:`.distill.collect_lengths`)."""
    return collect_lengths(
        engine,
        config.base,
        config.budgets,
        config.prompt_tokens,
        config.continuation_tokens,
        config.distill_counts,
        config.val_sequences,
        work,
        progress,
        text=config.text,
    )


def train(engine, config: TrainConfig, work: Path, out_dir: Path, *, model_tag: str, progress: bool = True) -> list[Path]:
    """Capture (or reuse the capture), train every layer per budget, write one kernel file per budget."""
    config.check()
    work.mkdir(parents=True, exist_ok=True)
    settings_path = work / "config.json"
    settings = asdict(config)
    if settings_path.exists() and json.loads(settings_path.read_text()) != settings:
        raise LessTrainingError(f"{work} holds a run with other settings ({settings_path}); use another --work-dir or delete it")
    settings_path.write_text(json.dumps(settings, indent=2))
    data_info = {**manifest(config.text, "train"), **capture(engine, config, work, progress)}
    capture_seconds = data_info.pop("capture_seconds")
    meta = load_work_file(work / "capture" / "meta.pt")
    signature = model_signature(engine.model)
    base_name = parse_compression(config.base).name
    if config.distill_epochs:
        distill_train, distill_val = _collect_distill_windows(engine, config, work, progress)
    paths = []
    for budget in config.budgets:
        layers_dir = work / f"kernels-b{budget}"
        template = LessKernels.initial(
            signature,
            rank=config.rank,
            hidden=config.hidden,
            seed=config.seed,
            scale=config.init_scale,
            features=config.features,
            mass_rank=config.mass_features,
        )
        trained: dict[int, LayerKernels] = {}
        report: dict[str, dict[str, float]] = {}
        seconds = 0.0
        for layer_idx in tqdm(sorted(template.layers), desc=f"train b={budget}", disable=not progress):
            path = layers_dir / f"layer{layer_idx:03d}.safetensors"
            if path.exists():  # resume: this layer is done
                done = load_kernels(path)
                trained[layer_idx] = done.layers[layer_idx]
                report[str(layer_idx)] = done.header["validation"][str(layer_idx)]
                seconds += done.header["seconds"]
                continue
            t0 = time.perf_counter()
            torch.manual_seed(config.seed + layer_idx)
            groups = [_prepare(_load_layer(work, layer_idx, n), budget, n, meta[layer_idx]["scaling"]) for n in config.prompt_tokens]
            kernels = template.layers[layer_idx]
            stats = train_layer(groups, kernels, meta[layer_idx]["o_proj"], config, config.seed + layer_idx)
            elapsed = time.perf_counter() - t0
            checkpoint = {
                "format": FORMAT,
                "model": signature,
                "features": config.features,
                "validation": {str(layer_idx): stats},
                "seconds": elapsed,
                "partial_layers_ok": True,
            }
            LessKernels({layer_idx: kernels}, checkpoint).save(path)
            trained[layer_idx], report[str(layer_idx)] = kernels, stats
            seconds += elapsed
        header = {
            "format": FORMAT,
            "model": signature,
            "model_tag": model_tag,
            "base": base_name,
            "base_spec": parse_compression(config.base).with_budget(budget).spec(),
            "budget": budget,
            "rank": config.rank,
            **({"mass_rank": config.mass_rank} if config.mass_rank else {}),
            "features": config.features,
            "hidden": config.hidden,
            "data": {**data_info, "validation_sequences": config.val_sequences},
            "training": {**settings, "capture_seconds": round(capture_seconds, 3), "train_seconds": round(seconds, 3), "threads": torch.get_num_threads()},
            "validation": report,
        }
        if config.distill_epochs:
            trained, header["distill"] = _stage2(engine, LessKernels(trained, header), distill_train, distill_val, budget, config, progress)
        paths.append(LessKernels(trained, header).save(out_dir / kernel_name(model_tag, base_name, budget)))
    return paths


def _stage2(engine, stage1: LessKernels, train_paths, val_paths, budget: int, config: TrainConfig, progress: bool):
    """Distil stage 1's kernels on the end-to-end KL, or load the result of an earlier run with
    the same stage-1 kernels, settings and data (checkpointed beside the collected windows)."""
    settings = DistillConfig(epochs=config.distill_epochs, lr=config.distill_lr, scale_lr=config.distill_lr, seed=config.seed, params=config.distill_params)
    key = hashlib.sha256(json.dumps([asdict(settings), stage1.header], sort_keys=True).encode()).hexdigest()[:12]
    path = train_paths[0].parent / f"distilled-b{budget}-{key}.safetensors"
    if path.exists():
        done = load_kernels(path)
        return done.layers, done.header["distill"]
    kernels, report = distill(engine, stage1, train_paths, val_paths, budget, settings, progress)
    report["windows"] = {"train": len(train_paths), "val": len(val_paths)}
    report["collect_seconds"] = round(sum(collection_seconds(d) for d in {p.parent for p in train_paths}), 3)  # shared by every budget
    LessKernels(kernels.layers, {**stage1.header, "distill": report}).save(path)
    return kernels.layers, report


def distill_file(
    engine,
    kernels_path: Path,
    out_path: Path,
    work: Path,
    *,
    epochs: int,
    sequences: int | list[int] | None,
    lr: float,
    params: str = "calibration",
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Run stage 2 alone on a stage-1 kernel file (its header says how it was trained) and save the result."""
    stage1 = load_kernels(kernels_path)
    stage1.check_model(model_signature(engine.model), str(kernels_path))
    header, done = stage1.header, stage1.header["training"]
    if "distill" in header:
        raise LessTrainingError(f"{kernels_path} is already distilled; start from a stage-1 file")
    lengths = _as_list(done["prompt_tokens"])
    config = TrainConfig(
        base=done["base"],
        budgets=[header["budget"]],
        prompt_tokens=lengths,
        continuation_tokens=done["continuation_tokens"],
        sequences=done["sequences"],
        val_sequences=done["val_sequences"],
        seed=seed,
        distill_epochs=epochs,
        distill_sequences=sequences,
        distill_lr=lr,
        distill_params=params,
        text=header["data"].get("text", "pydoc"),  # files from before the text choice trained on pydoc
    )
    config.check()
    work.mkdir(parents=True, exist_ok=True)
    train_paths, val_paths = _collect_distill_windows(engine, config, work, progress)
    layers, report = _stage2(engine, stage1, train_paths, val_paths, header["budget"], config, progress)
    training = {
        **done,
        "distill_epochs": epochs,
        "distill_sequences": config.distill_sequences,
        "distill_lr": lr,
        "distill_params": params,
        "distill_threads": torch.get_num_threads(),
    }
    return LessKernels(layers, {**header, "training": training, "distill": report}).save(out_path)
