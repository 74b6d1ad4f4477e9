"""A cache layer whose KV heads hold different numbers of entries (per-head budgets, AdaKV).

kvpress's AdaKV press masks the entries a head drops and keeps the dense ``[batch, heads, n,
dim]`` cache, so it saves no memory. Here a layer compressed with per-head budgets really
holds only what each head kept: one flat ``[entries, dim]`` tensor per K and V, the heads'
entries one after the other (head 0's first), with each head's count beside it. Its bytes
are therefore the kept entries' bytes, the same as a uniform cache of the same mean budget.

The registered attention function finds such a layer through :func:`ragged_layers` (set by
the decode loop around each forward) and attends each KV head over its own slice
(:meth:`RaggedHeadsLayer.attend`); the K/V arguments transformers passes are ignored there.
One prompt at a time: no batch rows and no padding, so no mask is needed beyond causality
among the tokens of one forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers.cache_utils import DynamicLayer

_CACHE: ContextVar[object | None] = ContextVar("snapkv_rag_ragged_cache", default=None)


class RaggedHeadsLayer(DynamicLayer):
    """One layer's K/V for a batch of one, ``lengths[h]`` entries for KV head ``h``.

    ``keys``/``values`` are ``[1, 1, sum(lengths), dim]`` (the flat layout, so code that counts
    bytes from them counts exactly what is held); new tokens are appended to every head.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        super().__init__()
        first = keys[0]
        self.lazy_initialization(first, first)
        self.heads = len(keys)
        self.lengths = [int(k.shape[0]) for k in keys]
        self.keys = torch.cat(list(keys))[None, None]
        self.values = torch.cat(list(values))[None, None]

    @classmethod
    def from_selection(cls, keys: torch.Tensor, values: torch.Tensor, kept: Sequence[torch.Tensor]) -> RaggedHeadsLayer:
        """Keep ``kept[h]`` (positions, ascending) of head ``h`` from dense ``[1, heads, n, dim]`` K/V."""
        return cls([keys[0, h, idx] for h, idx in enumerate(kept)], [values[0, h, idx] for h, idx in enumerate(kept)])

    def _offsets(self) -> list[int]:
        offsets, total = [], 0
        for length in self.lengths:
            offsets.append(total)
            total += length
        return offsets

    def head_keys(self, head: int) -> torch.Tensor:
        start = self._offsets()[head]
        return self.keys[0, 0, start : start + self.lengths[head]]

    def head_values(self, head: int) -> torch.Tensor:
        start = self._offsets()[head]
        return self.values[0, 0, start : start + self.lengths[head]]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[1, heads, t, dim]`` new entries to every head; returns them (attention reads the layer)."""
        if key_states.shape[0] != 1 or key_states.shape[1] != self.heads:
            raise ValueError(f"a ragged cache layer takes [1, {self.heads}, t, dim] states, got {list(key_states.shape)}")
        key_pieces, value_pieces = [], []
        for h, start in enumerate(self._offsets()):
            end = start + self.lengths[h]
            key_pieces += [self.keys[0, 0, start:end], key_states[0, h]]
            value_pieces += [self.values[0, 0, start:end], value_states[0, h]]
        self.keys = torch.cat(key_pieces)[None, None]
        self.values = torch.cat(value_pieces)[None, None]
        added = key_states.shape[2]
        self.lengths = [length + added for length in self.lengths]
        return key_states, value_states

    def entries_per_head(self) -> int:
        """The mean entries a head holds (rounded), the figure a uniform layer's length compares with."""
        return round(sum(self.lengths) / self.heads)

    def get_seq_length(self) -> int:
        return self.entries_per_head()

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of ``query [1, q_heads, t, dim]`` (the forward's last ``t`` tokens, already
        appended) over each KV head's own entries; returns ``[1, t, q_heads, dim]`` as the
        attention functions do. Scores and softmax in float32."""
        _, q_heads, t, dim = query.shape
        group = q_heads // self.heads
        scale = scaling if scaling is not None else dim**-0.5
        outputs = []
        for h in range(self.heads):
            keys, values = self.head_keys(h), self.head_values(h)
            q = query[0, h * group : (h + 1) * group]  # [group, t, dim]
            scores = torch.matmul(q, keys.transpose(0, 1)).float() * scale  # [group, t, n]
            if t > 1:
                n = keys.shape[0]
                new = torch.arange(n, device=keys.device) - (n - t)  # >= 0 for this forward's tokens
                blocked = new[None, :] > torch.arange(t, device=keys.device)[:, None]
                scores = scores.masked_fill(blocked, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            outputs.append(torch.matmul(probs, values))  # [group, t, dim]
        return torch.cat(outputs).transpose(0, 1)[None].contiguous()


def is_ragged(layer) -> bool:
    return isinstance(layer, RaggedHeadsLayer)


@contextmanager
def ragged_layers(cache) -> Iterator[None]:
    """Let the attention of the model calls inside the block find ``cache``'s ragged layers."""
    token = _CACHE.set(cache if cache is not None and any(is_ragged(layer) for layer in cache.layers) else None)
    try:
        yield
    finally:
        _CACHE.reset(token)


def active_ragged_layer(layer_idx: int) -> RaggedHeadsLayer | None:
    """The running forward's cache layer ``layer_idx`` when it holds ragged heads (else None)."""
    cache = _CACHE.get()
    if cache is None:
        return None
    layer = cache.layers[layer_idx]  # type: ignore[attr-defined]
    return layer if isinstance(layer, RaggedHeadsLayer) else None
