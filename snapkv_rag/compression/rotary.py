"""The model's rotary angles, for a policy that reasons about positions no token holds yet.

Expected Attention (:mod:`.expected_attention`) moves the prompt's last queries to the positions that
future queries will take, with the model's own rotary embedding. The engine names that embedding for
the run (:func:`rotary_angles`, an ``(offsets, layer_idx) -> (cos, sin)`` function); the runtime
names the layer being compressed (:func:`angles_for_layer`); a policy asks :func:`angles`, which is None
where neither is known (a policy called on its own, a model without rotary positions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

AnglesFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

_PROVIDER: ContextVar[AnglesFn | None] = ContextVar("snapkv_rotary_angles", default=None)
_LAYER: ContextVar[int | None] = ContextVar("snapkv_rotary_layer", default=None)


def rotate(vectors: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``vectors [..., dim]`` turned by rotate-half RoPE angles ``cos``/``sin`` (``[..., rotary_dim]``,
    broadcast); dimensions past ``rotary_dim`` (partial rotary) are left as they are."""
    rotary_dim = cos.shape[-1]
    rotated, rest = vectors[..., :rotary_dim].float(), vectors[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    moved = (rotated * cos + turned * sin).to(vectors.dtype)
    return torch.cat((moved, rest.to(moved.dtype)), dim=-1) if rest.shape[-1] else moved


@contextmanager
def rotary_angles(provider: AnglesFn | None) -> Iterator[None]:
    """Policies selecting inside this block may ask for the model's angles (None: they cannot)."""
    token = _PROVIDER.set(provider)
    try:
        yield
    finally:
        _PROVIDER.reset(token)


@contextmanager
def angles_for_layer(layer_idx: int) -> Iterator[None]:
    token = _LAYER.set(layer_idx)
    try:
        yield
    finally:
        _LAYER.reset(token)


def angles(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin ``[len(offsets), rotary_dim]`` of the layer being compressed at position ``offsets``, or None."""
    provider, layer = _PROVIDER.get(), _LAYER.get()
    if provider is None or layer is None:
        return None
    return provider(offsets, layer)
