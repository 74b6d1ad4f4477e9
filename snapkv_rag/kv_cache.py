"""A KV cache whose layers append in place, into storage with room to spare.

transformers' ``DynamicLayer`` appends each decode step with ``torch.cat``: a fresh allocation and
a copy of the layer's whole K/V, every step, every layer. At 7,800 cached tokens on the embedded
model that is 180 MB copied per token. :class:`AppendLayer` writes the new entries into spare room
at the end of its storage and hands out a view of the filled part, so a step copies only the new
token; the storage grows by :data:`SPARE_ENTRIES` at a time (one whole copy per that many steps).

Everything else keeps working on ``layer.keys``/``layer.values`` as before: a compression that
gathers kept entries, a batch that joins or drops rows, a crop, all assign new tensors, and the
next append notices that the layer no longer holds its own view and re-seats the entries into
new storage (never writing into tensors someone else may hold).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, DynamicLayer

# False: transformers' own DynamicCache (eval/llamacpp_compare.py measures against it).
APPEND_IN_PLACE = True
# Room added at the end of a layer's storage when it is (re)allocated: at most this many unused
# entries per layer, and one whole copy every this many decode steps.
SPARE_ENTRIES = 128


class AppendLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare room (see the module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._key_storage: torch.Tensor | None = None
        self._value_storage: torch.Tensor | None = None
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None  # the views this layer last set

    def _holds_own_view(self) -> bool:
        return self._handed is not None and self.keys is self._handed[0] and self.values is self._handed[1]

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int) -> bool:
        ks, vs = self._key_storage, self._value_storage
        assert ks is not None and vs is not None
        return (
            length + key_states.shape[-2] <= ks.shape[-2]
            and ks.shape[:-2] == key_states.shape[:-2]
            and vs.shape[:-2] == value_states.shape[:-2]
            and ks.shape[-1] == key_states.shape[-1]
            and vs.shape[-1] == value_states.shape[-1]
            and ks.dtype == key_states.dtype
            and ks.device == key_states.device
        )

    def _reseat(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int) -> None:
        capacity = length + key_states.shape[-2] + SPARE_ENTRIES
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if length:
            assert self.keys is not None and self.values is not None
            keys[..., :length, :].copy_(self.keys)
            values[..., :length, :].copy_(self.values)
        self._key_storage, self._value_storage = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        length = self.keys.shape[-2] if self.keys.numel() else 0
        if not (self._holds_own_view() and self._fits(key_states, value_states, length)):
            self._reseat(key_states, value_states, length)
        assert self._key_storage is not None and self._value_storage is not None
        end = length + key_states.shape[-2]
        self._key_storage[..., length:end, :].copy_(key_states)
        self._value_storage[..., length:end, :].copy_(value_states)
        self.keys, self.values = self._key_storage[..., :end, :], self._value_storage[..., :end, :]
        self._handed = (self.keys, self.values)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_storage = self._value_storage = self._handed = None
        super().reset()


class AppendCache(DynamicCache):
    """``DynamicCache`` whose full-attention layers are :class:`AppendLayer` (sliding ones unchanged)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [AppendLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = AppendLayer


def new_cache(config) -> DynamicCache:
    """An empty cache for a model with ``config``: the one every generation path starts from."""
    return AppendCache(config=config) if APPEND_IN_PLACE else DynamicCache(config=config)
