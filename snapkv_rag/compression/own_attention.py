"""Cache layers that attend for themselves (ragged heads, quantized entries): how the registered
attention function finds them.

The K/V arguments transformers passes to an attention function are what a layer's ``update``
returned; a layer whose storage is not a dense ``[batch, heads, n, dim]`` pair (per-head
lengths, codes and scales) attends itself instead. The decode loop wraps each forward in
:func:`layers_of` so the attention function can ask :func:`active_layer` for the layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

_CACHE: ContextVar[object | None] = ContextVar("snapkv_rag_own_attention_cache", default=None)

Layer = TypeVar("Layer")


@contextmanager
def layers_of(cache) -> Iterator[None]:
    """Let the attention of the model calls inside the block find ``cache``'s layers that attend for themselves."""
    own = cache is not None and any(getattr(layer, "attends_itself", False) for layer in cache.layers)
    token = _CACHE.set(cache if own else None)
    try:
        yield
    finally:
        _CACHE.reset(token)


def active_layer(layer_idx: int, kind: type[Layer]) -> Layer | None:
    """The running forward's cache layer ``layer_idx`` when it is a ``kind`` (else None)."""
    cache = _CACHE.get()
    if cache is None:
        return None
    layer = cache.layers[layer_idx]  # type: ignore[attr-defined]
    return layer if isinstance(layer, kind) else None


def mask_decode_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``scores [b, kv_heads, groups, n]`` of one decode query per row with ``attention_mask``
    applied: None, bool (True = attend) or additive, broadcastable to ``[b, heads or 1, q, >= n]``
    (its last row and last ``n`` columns are used; a layer that kept fewer entries than the widest
    reads the widest one's last columns)."""
    if attention_mask is None:
        return scores
    _, kv_heads, groups, n = scores.shape
    mask = attention_mask[..., -1:, -n:]
    mask = mask.reshape(mask.shape[0], kv_heads, groups, -1) if mask.shape[1] == kv_heads * groups else mask
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
