"""The LESS state of one decode run and attention with it (less.md), model-agnostic.

Per compressed layer and KV head the state is ``H [R, d]`` and ``z [R]`` (fp32, per batch
row): the folded ``psi(k)^T v`` and ``psi(k)`` of every evicted entry. A query head reads
its GQA group's state. Attention over the kept entries ``S`` plus the state:

    lse_S = logsumexp_{i in S}(q.k_i * scaling)      mass = phi(q).z
    lse   = logaddexp(lse_S, log(mass))
    out   = exp(lse_S - lse) * softmax_S(s) V_S + exp(log(mass) - lse) * phi(q)H / mass

which is less.md's ``exp(lse_S - lse) * softmax(s) V_S + exp(-lse) * phi(q)H`` written so
that no factor overflows. The sparse part is the registered base attention's own output
(SDPA, flash), so with zero features (``mass = 0``) the result *is* the base output.
Exponential-feature kernels keep the same numbers in the log domain (``mu = H / z`` per
feature and ``log z``; :mod:`.kernels`), and give ``log(mass)`` and ``phi(q)H / mass`` directly.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..base import CompressionPolicy
from ..decoding import PolicyState
from .kernels import LessKernels


def merge(sparse_out: torch.Tensor, lse_sparse: torch.Tensor, log_mass: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Kept entries' attention (``sparse_out``, ``lse_sparse``) and the evicted entries' (``log_mass``,
    ``value``, exact or estimated) under one softmax normaliser."""
    lse = torch.logaddexp(lse_sparse, log_mass)
    w_sparse = torch.exp(lse_sparse - lse).nan_to_num(0.0)
    w_low = torch.exp(log_mass - lse).nan_to_num(0.0)
    return w_sparse.unsqueeze(-1) * sparse_out + w_low.unsqueeze(-1) * value


def visible_keys(attention_mask: torch.Tensor | None, batch: int, t: int, m: int, device: torch.device) -> torch.Tensor:
    """Bool ``[b or 1, t, m]``: which of the ``m`` cached keys each of the ``t`` new queries sees.

    ``attention_mask`` is what the model hands its attention function: None (causal, no
    padding), a 4-D bool or additive float mask ``[b, 1, t, >=m]``, or a 2-D padding mask
    ``[b, >=m]`` (flash attention), which is combined with causality here.
    """
    causal = torch.arange(m, device=device)[None, :] <= (m - t + torch.arange(t, device=device))[:, None]
    if attention_mask is None:
        return causal[None]
    if attention_mask.dim() == 2:
        return causal[None] & attention_mask[:, None, :m].bool()
    mask = attention_mask[:, 0, :, :m]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def evicted_mask(keys: torch.Tensor, kept: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[b, kv_heads, n]``: what a selection ``kept [b, kv_heads, k]`` leaves out of
    ``keys [b, kv_heads, n, d]``; left padding (``attention_mask [b, n] == 0``) is never evicted."""
    b, h, n, _ = keys.shape
    evicted = torch.ones(b, h, n, dtype=torch.bool, device=keys.device).scatter_(2, kept, False)
    if attention_mask is not None:
        evicted &= attention_mask[:, None, :n].bool()
    return evicted


def grouped_scores(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 scores ``[b, kv_heads, group, t, m]`` of ``query [b, q_heads, t, d]`` over ``key [b, kv_heads, m, d]``."""
    b, hq, t, d = query.shape
    hkv, m = key.shape[1], key.shape[2]
    g = hq // hkv
    return (query.float().reshape(b, hkv, g * t, d) @ key.float().transpose(-1, -2)).view(b, hkv, g, t, m) * scale


class LowRankState:
    """The folded state of every compressed layer of one decode run, and its cost."""

    def __init__(self, kernels: LessKernels, device: torch.device, probe: int = 0):
        self.kernels = kernels.to(device)
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> (H, z), or (mu, log z[, mass-only log z]) for exp kernels
        self.probe = probe  # prompt queries that check each head's state (:meth:`check_heads`); 0: none
        self.heads_on: dict[int, torch.Tensor] = {}  # layer -> bool [b, kv_heads]: heads whose state passed the check
        self.heads_checked = 0
        self.folded_entries = 0  # evicted (row, layer, KV head, position) entries folded so far
        self.attend_seconds = 0.0  # time spent in the low-rank part of attention, all layers

    def fold(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> None:
        """Add the evicted entries of one layer (prefill compression or a decode-time eviction)."""
        kernels = self.kernels.layers.get(layer_idx)
        if kernels is None or not bool(evicted.any()):
            return
        state = kernels.fold(keys, values, evicted)
        if layer_idx in self.layers:
            state = kernels.merge_states(self.layers[layer_idx], state)
        self.layers[layer_idx] = state
        self.folded_entries += int(evicted.sum())

    def fold_selection(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Fold what a selection ``kept [b, kv_heads, k]`` leaves out of ``keys [b, kv_heads, n, d]``
        (left padding, ``attention_mask [b, n] == 0``, is never folded); returns that
        :func:`evicted_mask`."""
        evicted = evicted_mask(keys, kept, attention_mask)
        self.fold(layer_idx, keys, values, evicted)
        return evicted

    def check_heads(
        self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor, attention_mask, scaling
    ) -> None:
        """Switch off the heads whose state makes the prompt's own last queries attend worse.

        The last ``probe`` prompt queries (``query [b, q_heads, n, d]``) saw every prompt key, so
        their exact attention output is known at prefill. Per KV head (its GQA group, all probe
        queries), the squared error against it of the kept entries alone and of the kept entries
        merged with the state decide: a head keeps its state only where the state lowers the
        error. Only queries after the last evicted position probe (the state holds no entry a
        probe query could not see). ``evicted``: :func:`evicted_mask` of the selection."""
        if not self.probe or not self.has_state(layer_idx):
            return
        b, _, n, d = keys.shape
        positions = torch.arange(n, device=keys.device)
        qn = query.shape[2]  # the prompt's last qn positions (all n, or a suffix after reused entries)
        t = min(self.probe, qn, n - 1 - int((evicted * positions).amax()))
        if t < 1:
            return
        scale = d**-0.5 if scaling is None else scaling
        q = query[:, :, qn - t :].float()
        scores = grouped_scores(q, keys, scale).masked_fill(~visible_keys(attention_mask, b, t, n, keys.device)[:, None, None], float("-inf"))
        v = values.float()[:, :, None]
        exact = scores.softmax(-1) @ v
        sparse_scores = scores.masked_fill(evicted[:, :, None, None, :], float("-inf"))
        sparse = (sparse_scores.softmax(-1) @ v).nan_to_num(0.0)
        merged = merge(sparse, sparse_scores.logsumexp(-1), *self.kernels.layers[layer_idx].estimate(q, self.layers[layer_idx]))
        on = ((merged - exact) ** 2).sum((2, 3, 4)) <= ((sparse - exact) ** 2).sum((2, 3, 4))
        self.heads_checked += on.numel()
        if bool(on.all()):
            return
        if not bool(on.any()):  # no head keeps it: drop the layer's state
            del self.layers[layer_idx]
        self.heads_on[layer_idx] = on

    @property
    def heads_off(self) -> int:
        return sum(int((~on).sum()) for on in self.heads_on.values())

    def has_state(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, attention_mask, output: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """The base attention's ``output [b, t, q_heads, d]`` merged with this layer's state."""
        if not self.has_state(layer_idx):
            return output
        start = time.perf_counter()
        b, hq, t, d = query.shape
        hkv, m = key.shape[1], key.shape[2]
        g = hq // hkv
        scale = d**-0.5 if scaling is None else scaling
        scores = grouped_scores(query, key, scale)
        if attention_mask is not None or t > 1:  # one unpadded decode query sees every cached key
            visible = visible_keys(attention_mask, b, t, m, query.device)
            scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        lse_sparse = scores.logsumexp(dim=-1)
        sparse = output.float().permute(0, 2, 1, 3).reshape(b, hkv, g, t, d)
        merged = merge(sparse, lse_sparse, *self.estimate(layer_idx, query, scale))
        result = merged.reshape(b, hq, t, d).permute(0, 2, 1, 3).to(output.dtype).contiguous()
        self.attend_seconds += time.perf_counter() - start
        return result

    def estimate(self, layer_idx: int, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log mass, value)`` of this layer's evicted entries for ``query [b, q_heads, t, d]``,
        each shaped ``[b, kv_heads, group, t(, d)]`` (:meth:`LayerKernels.estimate`); heads switched
        off by :meth:`check_heads` estimate no mass."""
        log_mass, value = self.kernels.layers[layer_idx].estimate(query, self.layers[layer_idx])
        on = self.heads_on.get(layer_idx)
        if on is not None:
            log_mass = log_mass.masked_fill(~on[:, :, None, None], float("-inf"))
        return log_mass, value

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's state tensors (``H`` and ``z``, and any mass-only ``z``; the whole batch)."""
        return sum(t.numel() * t.element_size() for state in self.layers.values() for t in state)


class LessPolicyState(PolicyState):
    """LESS behind the policy interface: every eviction (the prefill's selection, a decode-time
    cut of the base policy) is folded into ``low_rank``, and every later attention call
    merges it in."""

    def __init__(self, low_rank: LowRankState, base: CompressionPolicy, sliding: list[bool]):
        super().__init__(base, sliding)
        self.low_rank = low_rank
        self.step_seconds: list[float] = []  # per decode step: time in the low-rank part
        self._attend_before = 0.0

    def evicted(self, layer_idx, keys, values, kept, attention_mask, query=None, scaling=None) -> None:
        evicted = self.low_rank.fold_selection(layer_idx, keys, values, kept, attention_mask)
        if query is not None:
            self.low_rank.check_heads(layer_idx, query, keys, values, evicted, attention_mask, scaling)

    def attend(self, layer_idx, query, key, attention_mask, output, scaling):
        output = super().attend(layer_idx, query, key, attention_mask, output, scaling)
        return self.low_rank.attend(layer_idx, query, key, attention_mask, output, scaling)

    def after_step(self, cache, attention_mask):
        self.step_seconds.append(self.low_rank.attend_seconds - self._attend_before)
        mask = super().after_step(cache, attention_mask)
        self._attend_before = self.low_rank.attend_seconds
        return mask

    def stats(self) -> dict[str, Any]:
        steps = self.step_seconds[1:] or self.step_seconds
        return {
            **super().stats(),
            "low_rank_state_bytes": self.low_rank.nbytes,  # the whole batch's; the engine reports a row's
            "low_rank_folded_entries": self.low_rank.folded_entries,
            **({"low_rank_heads_checked": self.low_rank.heads_checked, "low_rank_heads_off": self.low_rank.heads_off} if self.low_rank.probe else {}),
            "low_rank_ms_per_step": statistics.median(steps) * 1000 if steps else None,
        }
