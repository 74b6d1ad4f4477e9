"""Where LESS's remaining gap comes from (``snapkv-rag less gap``).

The state stands in for the evicted entries' attention with two estimates (:meth:`~.kernels.LayerKernels.estimate`):
their mass (``phi(q).z`` for ``sum exp(q.k)``) and their value (``phi(q)H / phi(q).z`` for
the softmax-weighted mean of their values). This analysis swaps either estimate, per layer,
for the exact quantity computed from the evicted K/V (:class:`OracleState`) and measures the
continuation's KL to the full cache on held-out prompts:

- ``base``: the base policy alone; ``less``: both estimates learned;
- ``mean value``: the learned mass with the plain mean of the evicted values (what a state
  that tells no evicted entry from another would give);
- ``exact value`` / ``exact mass``: one estimate exact, the other learned;
- ``exact``: both exact, which is the full cache (a check of the analysis itself);
- ``exact value @ layer l``: exact value in layer ``l`` only, learned elsewhere (which layers
  the remaining gap sits in).

Each prompt is recorded once (:func:`~.distill.record_window`); every variant reruns only the
continuation through the engine's decode path (:func:`~.distill.less_log_probs`). The KL is
over continuation tokens 2..c (the first is predicted by the prefill, before the state exists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..compression import LESS
from ..compression.less.kernels import LessKernels
from ..compression.less.state import LowRankState
from .distill import _kl, less_log_probs, record_window

LEARNED, EXACT, MEAN, NONE = "learned", "exact", "mean", "none"
VARIANTS: dict[str, tuple[str, str]] = {  # name: (mass, value) in every layer
    "base": (NONE, NONE),
    "less": (LEARNED, LEARNED),
    "mean value": (LEARNED, MEAN),
    "exact value": (LEARNED, EXACT),
    "exact mass": (EXACT, LEARNED),
    "exact": (EXACT, EXACT),
}


class OracleState(LowRankState):
    """A LESS state whose mass and value estimates are, per layer, learned, exact or (value) the
    plain mean over the evicted entries. ``modes``: layer -> (mass, value); layers not named
    use ``default``; ``(NONE, NONE)`` leaves a layer to the base policy alone."""

    def __init__(self, kernels: LessKernels, device: torch.device, modes: dict[int, tuple[str, str]], default: tuple[str, str]):
        super().__init__(kernels, device)
        self.modes, self.default = modes, default
        self.evicted: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # layer -> (keys, values, evicted mask)

    def _mode(self, layer_idx: int) -> tuple[str, str]:
        return self.modes.get(layer_idx, self.default)

    def fold(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> None:
        mode = self._mode(layer_idx)
        if mode == (NONE, NONE):
            return
        if LEARNED in mode:
            super().fold(layer_idx, keys, values, evicted)
        if mode != (LEARNED, LEARNED):
            if layer_idx in self.evicted:
                raise ValueError("the gap analysis handles one prefill compression per run (no decode-time eviction)")
            self.evicted[layer_idx] = (keys.float(), values.float(), evicted)

    def has_state(self, layer_idx: int) -> bool:
        return layer_idx in self.layers or layer_idx in self.evicted

    def estimate(self, layer_idx: int, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        mass_mode, value_mode = self._mode(layer_idx)
        learned = self._learned(layer_idx, query, scaling) if LEARNED in (mass_mode, value_mode) else None
        exact = self._exact(layer_idx, query, scaling, value_mode) if EXACT in (mass_mode, value_mode) or value_mode == MEAN else None
        mass_source, value_source = (learned if mass_mode == LEARNED else exact), (learned if value_mode == LEARNED else exact)
        assert mass_source is not None and value_source is not None  # computed above for the modes asked
        return mass_source[0], value_source[1]

    def _learned(self, layer_idx: int, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.layers:
            return super().estimate(layer_idx, query, scaling)
        b, hq, t, d = query.shape  # nothing was folded: no mass
        hkv = self.evicted[layer_idx][0].shape[1]
        return torch.full((b, hkv, hq // hkv, t), float("-inf"), device=query.device), torch.zeros(b, hkv, hq // hkv, t, d, device=query.device)

    def _exact(self, layer_idx: int, query: torch.Tensor, scaling: float, value_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, evicted = self.evicted[layer_idx]
        b, hq, t, d = query.shape
        hkv = keys.shape[1]
        scores = torch.einsum("bhgtd,bhnd->bhgtn", query.float().reshape(b, hkv, hq // hkv, t, d), keys) * scaling
        scores = scores.masked_fill(~evicted[:, :, None, None, :], float("-inf"))
        log_mass = scores.logsumexp(-1)
        if value_mode == MEAN:
            weights = evicted.float() / evicted.sum(-1, keepdim=True).clamp_min(1)
            value = torch.einsum("bhn,bhnd->bhd", weights, values)[:, :, None, None].expand(b, hkv, hq // hkv, t, d)
        else:
            value = torch.einsum("bhgtn,bhnd->bhgtd", scores.softmax(-1).nan_to_num(0.0), values)
        return log_mass, value


def variant_kl(
    engine, policy: LESS, kernels: LessKernels, sample: dict[str, torch.Tensor], budget: int, modes: dict[int, tuple[str, str]], default: tuple[str, str]
) -> float:
    """Mean KL(full || variant) over the recorded continuation."""
    with torch.no_grad():
        state = OracleState(kernels, engine.device, modes, default)
        return float(_kl(sample["log_probs"], less_log_probs(engine, policy, kernels, sample, budget, state=state)))


def gap_analysis(
    engine,
    policy: LESS,
    lengths: Sequence[int],
    *,
    per_length: int = 3,
    continuation_tokens: int = 64,
    per_layer: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per held-out prompt: its length, the KL of every variant and, with ``per_layer``,
    of ``exact value`` in each layer alone (``exact_value_at_layer``, indexed by layer)."""
    from ..errors import EvalInputError
    from .corpus import heldout_prompts

    budget = policy.max_capacity_prompt
    kernels = policy.load_kernels(engine.model)
    layers = sorted(kernels.layers)
    try:
        prompts = heldout_prompts(engine.tokenizer, lengths, continuation_tokens, per_length)
    except ValueError as exc:
        raise EvalInputError(str(exc)) from exc
    rows = []
    bar = tqdm(total=len(prompts) * (len(VARIANTS) + (len(layers) if per_layer else 0)), desc="LESS gap", disable=not progress, leave=False)
    for index, (length, prompt, continuation) in enumerate(prompts):
        sample = record_window(engine, {budget: policy.base}, prompt + continuation, len(prompt), len(continuation))
        row: dict[str, Any] = {"prompt": index, "length": length, "budget": budget, "kl": {}}
        for name, mode in VARIANTS.items():
            row["kl"][name] = variant_kl(engine, policy, kernels, sample, budget, {}, mode)
            bar.update()
        if per_layer:
            row["exact_value_at_layer"] = []
            for layer in layers:
                row["exact_value_at_layer"].append(variant_kl(engine, policy, kernels, sample, budget, {layer: (LEARNED, EXACT)}, (LEARNED, LEARNED)))
                bar.update()
        rows.append(row)
    bar.close()
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt length (and all prompts): mean KL of each variant and the share of the base
    policy's KL gap it closes, ``(kl_base - kl) / kl_base`` on the mean KLs (as the fidelity
    report's gap closed)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row["length"]), []).append(row)
    if len(groups) > 1:
        groups["all"] = rows
    out = []
    for label, group in groups.items():
        mean = {name: sum(r["kl"][name] for r in group) / len(group) for name in VARIANTS}
        entry = {"length": label, "prompts": len(group), "kl": mean, "gap_closed": {name: _closed(mean["base"], kl) for name, kl in mean.items()}}
        if "exact_value_at_layer" in group[0]:
            per_layer = [sum(r["exact_value_at_layer"][i] for r in group) / len(group) for i in range(len(group[0]["exact_value_at_layer"]))]
            # what exact values in layer l alone add over LESS, as a share of the base gap
            entry["layer_gain"] = [_closed(mean["base"], kl) - _closed(mean["base"], mean["less"]) for kl in per_layer]
        out.append(entry)
    return out


def _closed(base: float, kl: float) -> float:
    return (base - kl) / base if base > 0 else 0.0


def write_gap_report(rows: list[dict[str, Any]], out_dir, *, spec: str, command: str | None = None) -> dict[str, Any]:
    """``gap.json`` (rows and summary), ``gap.md`` (tables) and ``gap_layers.png`` (per-layer gain)."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    (out / "gap.json").write_text(json.dumps({"policy": spec, "command": command, "rows": rows, "summary": summary}, indent=1))
    names = list(VARIANTS)
    lines = (
        [f"# LESS gap analysis: {spec}", ""]
        + ([f"Produced by `{command}`", ""] if command else [])
        + [
            "Mean KL(full || variant) over the continuation; in brackets the share of the base policy's KL gap closed. "
            "`exact` is the full cache up to the fp16 recording of the prompt's K/V (hence KLs of about 1e-5, either sign).",
            "",
        ]
    )
    lines += ["| prompts | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in summary:
        cells = [f"{s['kl'][n]:.4f} ({100 * s['gap_closed'][n]:.0f}%)" for n in names]
        lines.append(f"| {s['length']} x{s['prompts']} | " + " | ".join(cells) + " |")
    if "layer_gain" in summary[-1]:
        gains = summary[-1]["layer_gain"]
        top = sorted(range(len(gains)), key=lambda i: -gains[i])[:8]
        lines += ["", f"Exact value in one layer only ({summary[-1]['length']} prompts), the layers that add most over LESS:", ""]
        lines += ["| layer | " + " | ".join(str(i) for i in top) + " |", "|---|" + "---|" * len(top)]
        lines.append("| gap closed over LESS | " + " | ".join(f"{100 * gains[i]:+.0f}%" for i in top) + " |")
        _plot_layers(summary, out / "gap_layers.png", f"{spec.split(',')[0]}, budget {rows[0]['budget']}")
    (out / "gap.md").write_text("\n".join(lines) + "\n")
    return {"summary": summary, "files": sorted(p.name for p in out.iterdir())}


def _plot_layers(summary: list[dict[str, Any]], path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    groups = [s for s in summary if "layer_gain" in s]
    width = 0.8 / len(groups)
    for k, s in enumerate(groups):
        xs = [i + k * width for i in range(len(s["layer_gain"]))]
        ax.bar(xs, [100 * g for g in s["layer_gain"]], width=width, label=f"{s['length']} ({s['prompts']} prompts)")
    ax.set_xlabel("layer given exact evicted values")
    ax.set_ylabel("extra KL gap closed (%)")
    ax.set_title(f"Where the remaining gap sits: {label}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
