"""Kept entries stored in 8 or 4 bits (``kv_bits=``), as KIVI (Liu et al., ICML 2024) stores them.

Keys are quantized per channel over groups of ``KEY_GROUP`` consecutive entries (a few key
channels carry outliers, so each channel needs its own range); values per entry, over the
head dimension (their error then stays within the entry that an attention weight scales).
Both are asymmetric: ``x ~ code * scale + zero``, ``scale`` and ``zero`` in float16. Codes are
stored centred, as int8; 4-bit ones two to a byte (the first half of the head dimension in the
low nibbles). Values are stored transposed, entries along the last axis.

The most recent entries stay at full width (the residual: at least ``residual`` of them,
fewer than ``residual + KEY_GROUP``); once the residual reaches ``residual + KEY_GROUP``
entries its oldest whole groups are quantized. The policy selects over full-precision K/V
during the prefill; the engine quantizes what it kept when the prefill ends
(:func:`quantize_cache`), so the prefix cache and the chunk store keep full-width copies.

A decode token attends straight over the codes (:meth:`QuantizedLayer.attend`): for the keys
the query is scaled per key group and multiplied by the codes cast to the model's dtype; the
values' codes go as they are into PyTorch's int8 weight kernel (bf16 on the CPU); the zero
points add one small float32 product each. Anything else (several tokens in one forward, span
attention, LESS, decode-time cuts, the scheduler's joins) reads and writes ``keys``/``values``,
which dequantize and quantize again: exact for entries whose groups do not change, and within
one more quantization step where they do.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicLayer

from ..errors import InvalidCompressionError
from ..model.portable import portable_enabled
from ..model.quantization import int8_kernel_available
from .own_attention import active_layer, mask_decode_scores

if TYPE_CHECKING:  # typing.Self is 3.11+; the package supports 3.10
    from typing import Self

KV_BITS = (8, 4)
KEY_GROUP = 64  # entries per key-quantization group (each channel has its own scale per group)
MIN_RESIDUAL = 32  # entries kept at full width at least (more when the policy's window is longer)
_SCALE_DTYPE = torch.float16


def check_kv_bits(owner: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or value not in KV_BITS):
        raise InvalidCompressionError(f"{owner}: kv_bits must be {' or '.join(map(str, KV_BITS))} (unset: full width), got {value!r}")


def _levels(bits: int) -> int:
    return (1 << bits) - 1


def _centre(bits: int) -> int:
    return 1 << (bits - 1)


def _pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Centred codes (``code - centre``, int8 range) as stored: int8, 4-bit ones two to a byte
    (the first half of ``dim`` in the low nibbles, the second in the high ones)."""
    if bits == 8:
        return codes.to(torch.int8)
    low, high = (part.to(torch.int16) for part in codes.chunk(2, dim=dim))
    return (high * 16 + (low & 15)).to(torch.int8)


def _unpack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """The centred codes, int8; 4-bit nibbles sign-extended by arithmetic shifts."""
    return codes if bits == 8 else torch.cat([(codes << 4) >> 4, codes >> 4], dim=dim)


_SCRATCH = threading.local()


def _as_float(codes: torch.Tensor, bits: int, dtype: torch.dtype, slot: str) -> torch.Tensor:
    """The unpacked centred codes in ``dtype``, written into a buffer this thread reuses for
    ``slot``: a fresh multi-MiB tensor per layer and step cost 4x the cast itself here (fresh
    pages from the allocator). The buffer is one layer's codes at ``dtype``, shared by all layers."""
    shape = (*codes.shape[:-1], codes.shape[-1] * (2 if bits == 4 else 1))
    size = math.prod(shape)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get((slot, dtype))
    if buffer is None or buffer.numel() < size or buffer.device != codes.device:
        buffer = buffers[(slot, dtype)] = torch.empty(size, dtype=dtype, device=codes.device)
    out = buffer[:size].view(shape)
    if bits == 8:
        out.copy_(codes)
    else:
        half = codes.shape[-1]
        out[..., :half].copy_((codes << 4) >> 4)
        out[..., half:].copy_(codes >> 4)
    return out


def _int8_product(weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``weights [b, h, g, n] @ codes [b, h, d, n]^T`` in float32, ``codes`` int8: PyTorch's int8
    weight kernel per head for bf16 on the CPU (it reads the codes as they are, where casting them
    first cost a copy of the layer at the model's width every step), else a cast and a product."""
    b, h, g, _ = weights.shape
    d = codes.shape[2]
    if portable_enabled() or weights.device.type != "cpu" or weights.dtype != torch.bfloat16 or not int8_kernel_available():  # fp32's was 5x slower
        return torch.matmul(weights, codes.transpose(-1, -2).to(weights.dtype)).float()
    ones = torch.ones(d, dtype=weights.dtype)
    kernel = torch.ops.aten._weight_int8pack_mm
    heads = [kernel(weights[i, j].contiguous(), codes[i, j], ones) for i in range(b) for j in range(h)]
    return torch.stack(heads).view(b, h, g, d).float()


def _quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scale and zero of ``x`` with one range per slice along ``dim``: ``x ~ code * scale + zero``.

    Codes are stored centred (``code - 2 ** (bits - 1)``, see :func:`_zero_point`): a product over
    them then stays near the size of the scores it adds up to, which bf16 rounds as finely as the
    model's own attention, and int8 casts to bf16 exactly."""
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((high - low) / _levels(bits)).to(_SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant slice: every code 0
    zero = low.to(_SCALE_DTYPE)
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, _levels(bits)) - _centre(bits)
    return _pack(codes, bits), scale, zero


def _zero_point(part: _Quantized) -> torch.Tensor:
    """The float32 value of a stored (centred) code 0."""
    return part.zero.float() + _centre(part.bits) * part.scale.float()


@dataclass
class _Quantized:
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int

    @classmethod
    def of(cls, x: torch.Tensor, bits: int) -> Self:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, indices: torch.Tensor) -> Self:
        """The batch rows ``indices``, as stored."""
        codes, scale, zero = (t[indices] for t in self.tensors())
        return type(self)(codes, scale, zero, self.bits)

    def append(self, other: Self) -> Self:
        """These entries followed by ``other``'s (both are concatenated along dim 2)."""
        codes, scale, zero = (torch.cat([a, b], dim=2) for a, b in zip(self.tensors(), other.tensors()))
        return type(self)(codes, scale, zero, self.bits)


class QuantizedKeys(_Quantized):
    """``[b, h, n, dim]`` keys as codes ``[b, h, n / G, G, dim (/ 2)]`` and per-channel
    ``scale``/``zero`` ``[b, h, n / G, 1, dim]`` of each group of ``G = KEY_GROUP`` entries."""

    @classmethod
    def of(cls, keys: torch.Tensor, bits: int) -> Self:
        b, h, n, dim = keys.shape
        return cls(*_quantize(keys.reshape(b, h, n // KEY_GROUP, KEY_GROUP, dim), 3, bits), bits)

    @property
    def length(self) -> int:
        return self.codes.shape[2] * KEY_GROUP

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        b, h, groups, size, _ = self.codes.shape
        full = _unpack(self.codes, self.bits).float() * self.scale.float() + _zero_point(self)
        return full.reshape(b, h, groups * size, -1).to(dtype)


class QuantizedValues(_Quantized):
    """``[b, h, n, dim]`` values as codes ``[b, h, dim (/ 2), n]`` (entries along the last axis, as
    the int8 product over them reads a weight) and ``scale``/``zero`` ``[b, h, n, 1]``."""

    @classmethod
    def of(cls, values: torch.Tensor, bits: int) -> Self:
        codes, scale, zero = _quantize(values, 3, bits)  # codes [b, h, n, dim (/ 2)]
        return cls(_pack(_unpack(codes, bits).transpose(-1, -2), bits, dim=-2).contiguous(), scale, zero, bits)

    @property
    def length(self) -> int:
        return self.codes.shape[3]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        codes = _unpack(self.codes, self.bits, dim=-2).transpose(-1, -2)
        return (codes.float() * self.scale.float() + _zero_point(self)).to(dtype)

    def append(self, other: Self) -> Self:
        return type(self)(
            torch.cat([self.codes, other.codes], dim=3), torch.cat([self.scale, other.scale], dim=2), torch.cat([self.zero, other.zero], dim=2), self.bits
        )


class QuantizedLayer(DynamicLayer):
    """One full-attention layer's K/V: a quantized body of whole key groups and a full-width
    residual of the latest entries (see the module docstring).

    ``keys``/``values`` read as the dequantized ``[b, h, n, dim]`` tensors and, assigned,
    quantize what they are given; :meth:`update` appends to the residual and returns it only
    (attention reads the layer through :func:`active_quantized_layer`)."""

    attends_itself = True

    def __init__(self, bits: int, residual: int = MIN_RESIDUAL):
        check_kv_bits("QuantizedLayer", bits)
        self.bits = bits
        self.residual = max(MIN_RESIDUAL, residual)
        self._key_body: QuantizedKeys | None = None
        self._value_body: QuantizedValues | None = None
        self._key_rest: torch.Tensor | None = None
        self._value_rest: torch.Tensor | None = None
        self.dtype = torch.float32
        super().__init__()

    @classmethod
    def from_layer(cls, layer, bits: int, residual: int) -> QuantizedLayer:
        quantized = cls(bits, residual)
        quantized.lazy_initialization(layer.keys, layer.values)
        quantized.keys, quantized.values = layer.keys, layer.values
        return quantized

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self._key_rest, self._value_rest = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def body_length(self, entries: int) -> int:
        """Entries of a layer holding ``entries`` that are quantized: whole groups, leaving at least ``residual``."""
        return max(0, entries - self.residual) // KEY_GROUP * KEY_GROUP

    # ------------------------------------------------------------ the dense view
    def _dense(self, body: _Quantized | None, rest: torch.Tensor | None) -> torch.Tensor | None:
        if rest is None or body is None:
            return rest
        return torch.cat([body.dequantize(self.dtype), rest], dim=2)

    def _split(self, tensor: torch.Tensor | None, kind: type[_Quantized]) -> tuple[_Quantized | None, torch.Tensor | None]:
        """``(quantized body, full-width rest)`` of ``tensor`` (None or not 4-D: a reset, or not yet initialized)."""
        if tensor is None or tensor.dim() != 4:
            return None, tensor
        body = self.body_length(tensor.shape[2])
        return (kind.of(tensor[:, :, :body], self.bits) if body else None), tensor[:, :, body:].clone()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._dense(self._key_body, self._key_rest)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._key_body, self._key_rest = self._split(tensor, QuantizedKeys)  # type: ignore[assignment]

    @property
    def values(self) -> torch.Tensor | None:
        return self._dense(self._value_body, self._value_rest)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._value_body, self._value_rest = self._split(tensor, QuantizedValues)  # type: ignore[assignment]

    # ------------------------------------------------------------ the cache-layer interface
    @property
    def quantized_entries(self) -> int:
        return self._key_body.length if self._key_body is not None else 0

    def get_seq_length(self) -> int:
        rest = self._key_rest.shape[2] if self._key_rest is not None and self._key_rest.dim() == 4 else 0
        return self.quantized_entries + rest

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._key_rest is not None and self._value_rest is not None
        self._key_rest = torch.cat([self._key_rest, key_states], dim=2)
        self._value_rest = torch.cat([self._value_rest, value_states], dim=2)
        if self._key_rest.shape[2] >= self.residual + KEY_GROUP:
            self._flush()
        return self._key_rest, self._value_rest

    def _flush(self) -> None:
        """Quantize the residual's oldest whole groups, leaving ``residual`` or more at full width."""
        assert self._key_rest is not None and self._value_rest is not None
        moved = self.body_length(self._key_rest.shape[2])
        keys = QuantizedKeys.of(self._key_rest[:, :, :moved], self.bits)
        values = QuantizedValues.of(self._value_rest[:, :, :moved], self.bits)
        self._key_body = keys if self._key_body is None else self._key_body.append(keys)
        self._value_body = values if self._value_body is None else self._value_body.append(values)
        self._key_rest, self._value_rest = self._key_rest[:, :, moved:].clone(), self._value_rest[:, :, moved:].clone()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` entries (rejected drafts): from the residual when it holds them."""
        count = -tokens_to_remove
        if count <= 0 or not self.is_initialized:
            return
        assert self._key_rest is not None and self._value_rest is not None
        if count <= self._key_rest.shape[2]:
            self._key_rest, self._value_rest = self._key_rest[:, :, :-count], self._value_rest[:, :, :-count]
        else:
            keys, values = self.keys, self.values
            assert keys is not None and values is not None
            self.keys, self.values = keys[:, :, :-count], values[:, :, :-count]

    @property
    def batch_size(self) -> int:
        assert self._key_rest is not None
        return self._key_rest.shape[0]

    @property
    def full_token_bytes(self) -> int:
        """K and V bytes of one entry (all KV heads) at the model's width."""
        assert self._key_rest is not None
        _, heads, _, dim = self._key_rest.shape
        return 2 * heads * dim * self._key_rest.element_size()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (a finished request leaves a batch): codes, scales and
        residual are selected as they are, so the rows that stay are not quantized again."""
        if self._key_body is not None and self._value_body is not None:
            self._key_body, self._value_body = self._key_body.rows(indices), self._value_body.rows(indices)
        if self._key_rest is not None and self._value_rest is not None:
            self._key_rest, self._value_rest = self._key_rest[indices], self._value_rest[indices]

    def held_bytes(self) -> int:
        """Bytes held: codes, scales and zero points of the body, and the full-width residual."""
        body = sum(part.nbytes for part in (self._key_body, self._value_body) if part is not None)
        rest = sum(t.numel() * t.element_size() for t in (self._key_rest, self._value_rest) if t is not None)
        return body + rest

    # ------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """One decode token per row, ``query [b, q_heads, 1, dim]``, over the layer (its new
        entry already appended); ``attention_mask`` None, bool (True: attend) or additive,
        broadcastable to ``[b, q_heads, 1, entries]`` (a wider mask's last columns are used).
        Scores in the input dtype, softmax in float32, as ``runtime.decode_attention``.
        Returns ``[b, 1, q_heads, dim]``."""
        keys, values, rest_keys, rest_values = self._key_body, self._value_body, self._key_rest, self._value_rest
        assert keys is not None and values is not None and rest_keys is not None and rest_values is not None
        b, q_heads, _, dim = query.shape
        kv_heads = rest_keys.shape[1]
        group = q_heads // kv_heads
        dtype = query.dtype
        q = query.reshape(b, kv_heads, 1, group, dim)  # [b, h, 1, g, d]: broadcast over key groups
        # keys: q . (code * scale + zero) = (q * scale) . code + q . zero, per group of entries; the
        # zero term in float32 (a zero point far from 0 gives a term far larger than the score)
        codes = _as_float(keys.codes, self.bits, dtype, "keys")  # [b, h, G#, G, d]
        scores = torch.matmul(q * keys.scale.to(dtype), codes.transpose(-1, -2)).float()
        scores += torch.matmul(q.float(), _zero_point(keys).transpose(-1, -2))  # [b, h, G#, g, 1]
        body = keys.length
        scores = scores.permute(0, 1, 3, 2, 4).reshape(b, kv_heads, group, body)
        recent = torch.matmul(query.reshape(b, kv_heads, group, dim), rest_keys.transpose(-1, -2)).float()  # [b, h, g, r]
        scores = mask_decode_scores(torch.cat([scores, recent], dim=-1) * (scaling if scaling is not None else dim**-0.5), attention_mask)
        probs = torch.softmax(scores, dim=-1)
        weights, recent_weights = probs[..., :body], probs[..., body:]
        # values: sum_t p_t (code_t * scale_t + zero_t) = (p * scale) . code + p . zero
        scaled = (weights * values.scale[..., 0].float()[:, :, None]).to(dtype)
        out = _int8_product(scaled, _unpack(values.codes, self.bits, dim=-2))
        out += torch.matmul(weights, _zero_point(values))
        out += torch.matmul(recent_weights.to(dtype), rest_values).float()
        return out.to(dtype).reshape(b, q_heads, 1, dim).transpose(1, 2).contiguous()


def is_quantized(layer) -> bool:
    return isinstance(layer, QuantizedLayer)


def quantize_cache(cache, bits: int, residual: int, sliding: list[bool]) -> None:
    """Replace ``cache``'s full-attention layers by :class:`QuantizedLayer` ones holding the same entries."""
    for i, layer in enumerate(cache.layers):
        if sliding[i] or is_quantized(layer) or getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            continue
        cache.layers[i] = QuantizedLayer.from_layer(layer, bits, residual)


def cache_kv_bits(cache) -> int | None:
    """The width ``cache``'s quantized layers store (None: full width)."""
    return next((layer.bits for layer in cache.layers if is_quantized(layer)), None)


def active_quantized_layer(layer_idx: int) -> QuantizedLayer | None:
    """The running forward's cache layer ``layer_idx`` when it is quantized (else None)."""
    return active_layer(layer_idx, QuantizedLayer)
