"""What a policy does after the prefill: the decode-time state it owns for one run.

A policy's :meth:`~snapkv_rag.compression.base.CompressionPolicy.decode_state` creates one
:class:`PolicyState` per decode run (or returns None when it has nothing to do after the
prefill). The run and the registered attention function talk to it through four hooks,
and name no policy:

- ``evicted(layer, keys, values, kept, mask)``: told what a selection (the prefill's or a
  decode-time one) leaves out of a layer, before the cache shrinks (LESS folds it);
- ``attend(layer, query, key, mask, output, scaling)``: consulted inside the registered
  attention function on every forward after the prefill; returns the layer's output;
- ``after_step(cache, mask)``: once after each decode forward; may shrink the cache and
  returns the 2-D padding mask over the entries that remain;
- ``stats()``: its own measurements, one flat dict per run.

Decode-time compression (:class:`DecodeCompaction`), the part every sparse policy shares:
with ``decode_budget=N,decode_interval=K`` the cache's full-attention layers are cut back
to ``N`` entries every ``K`` generated tokens by the policy's own ``select``, run over
the latest decode queries (SnapKV's observation window, H2O's accumulated attention) at
budget ``N``. So a long generation's cache stays within ``max(kept prompt, N) + K`` entries
per layer, and the cut reaches LESS's fold like the prefill's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

import torch

from .ragged import is_ragged


class DecodeCutPolicy(Protocol):
    """What decode-time cuts read of a policy; :class:`~.base.CompressionPolicy` has all of it
    (named here so this module needs nothing of ``base``, which builds the state)."""

    @property
    def decode_budget(self) -> int | None: ...

    @property
    def decode_every(self) -> int: ...

    @property
    def query_window(self) -> int | None: ...

    def for_decode(self) -> DecodeCutPolicy: ...

    def with_query_window(self, window: int) -> DecodeCutPolicy: ...

    def select(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        scaling: float | None = None,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def keep_entries(layer, indices: torch.Tensor) -> None:
    """Shrink a cache layer to the entries at ``indices [batch, kv_heads, k]`` (per head, ascending)."""
    gather = indices.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
    layer.keys = layer.keys.gather(2, gather)
    layer.values = layer.values.gather(2, gather)


def layer_entries(layer) -> int:
    """Entries a cache layer holds now (a sliding-window layer may hold fewer than it has seen;
    a layer with per-head budgets: the mean over its heads)."""
    if is_ragged(layer):
        return layer.entries_per_head()
    keys = getattr(layer, "keys", None)
    return int(keys.shape[-2]) if keys is not None and keys.numel() else 0


class DecodeCompaction:
    """Cut a run's full-attention layers back to ``policy.decode_budget`` every ``decode_interval`` steps."""

    def __init__(self, policy: DecodeCutPolicy, sliding: list[bool]):
        assert policy.decode_budget is not None
        self.policy = policy.for_decode()
        self.budget: int = policy.decode_budget
        self.interval = policy.decode_every
        self.sliding = sliding
        window = self.policy.query_window
        # SnapKV votes with its last `window` queries; H2O accumulates over every query since the last cut.
        self.queries_kept = self.interval if window is None else window
        self.queries: dict[int, deque[torch.Tensor]] = {}  # layer -> its latest decode queries [b, heads, 1, d]
        self.scaling: dict[int, float | None] = {}
        self.steps_since = 0
        self.compactions = 0
        self.evicted_entries = 0  # (row, layer, KV head, position) entries cut at decode time
        self.largest_layer = 0  # most entries one full-attention layer held after any decode step
        self.seconds = 0.0

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        if self.sliding[layer_idx] or self.queries_kept == 0:
            return
        recent = self.queries.setdefault(layer_idx, deque(maxlen=self.queries_kept))
        for i in range(max(0, query.shape[2] - self.queries_kept), query.shape[2]):
            recent.append(query[:, :, i : i + 1])
        self.scaling[layer_idx] = scaling

    def after_step(self, cache, mask: torch.Tensor | None, evicted) -> torch.Tensor | None:
        self.steps_since += 1
        full = [layer_entries(layer) for layer, sliding in zip(cache.layers, self.sliding) if not sliding]
        self.largest_layer = max(self.largest_layer, *full, 0)
        if self.steps_since < self.interval or max(full, default=0) <= self.budget:
            return mask
        start = time.perf_counter()
        kept_mask = mask
        for layer_idx, layer in enumerate(cache.layers):
            if self.sliding[layer_idx] or layer_entries(layer) <= self.budget:
                continue
            indices = self._select(layer_idx, layer.keys, mask)
            dropped = layer.keys.shape[0] * layer.keys.shape[1] * (layer.keys.shape[2] - indices.shape[-1])
            evicted(layer_idx, layer.keys, layer.values, indices, mask)
            keep_entries(layer, indices)
            self.evicted_entries += dropped
            if mask is not None and kept_mask is mask:
                kept_mask = mask.gather(1, indices[:, 0])
        self.compactions += 1
        self.steps_since = 0
        for recent in self.queries.values():
            if self.policy.query_window is None:
                recent.clear()  # H2O: the next cut accumulates over the queries after this one
        self.seconds += time.perf_counter() - start
        return kept_mask

    def _select(self, layer_idx: int, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        recent = self.queries.get(layer_idx)
        if recent:
            queries = torch.cat(list(recent), dim=2)
        else:
            queries = keys.new_zeros(keys.shape[0], keys.shape[1], 0, keys.shape[3])
        policy = self.policy.with_query_window(queries.shape[2]) if self.policy.query_window else self.policy
        return policy.select(queries, keys, mask, scaling=self.scaling.get(layer_idx))

    def stats(self) -> dict[str, Any]:
        return {
            "decode_budget": self.budget,
            "decode_interval": self.interval,
            "decode_compactions": self.compactions,
            "decode_evicted_entries": self.evicted_entries,
            "decode_cache_entries_max": self.largest_layer,
            "decode_compaction_ms": self.seconds * 1000,
        }


class PolicyState:
    """Decode-time state of one run for a policy; this base does decode-time compression
    when the policy asks for it (``decode_budget``) and nothing else."""

    def __init__(self, policy: DecodeCutPolicy, sliding: list[bool]):
        self.compaction = DecodeCompaction(policy, sliding) if getattr(policy, "decode_budget", None) else None

    @property
    def compacts(self) -> bool:
        """Whether the cache may shrink between decode steps (teacher forcing then goes one token at a time)."""
        return self.compaction is not None

    def evicted(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept: torch.Tensor,
        attention_mask: torch.Tensor | None,
        query: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> None:
        """A selection keeps ``kept [b, kv_heads, k]`` of ``keys``/``values [b, kv_heads, n, d]``;
        at prefill ``query [b, q_heads, n, d]`` are the prompt's queries of that layer."""

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, attention_mask, output: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """The layer's attention ``output [b, t, q_heads, d]``, possibly amended."""
        if self.compaction is not None:
            self.compaction.record(layer_idx, query, scaling)
        return output

    def after_step(self, cache, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """After one decode forward; returns the 2-D padding mask over the entries kept."""
        if self.compaction is None:
            return attention_mask
        return self.compaction.after_step(cache, attention_mask, self.evicted)

    def stats(self) -> dict[str, Any]:
        return self.compaction.stats() if self.compaction is not None else {}
