"""The uncompressed baseline."""

from __future__ import annotations

from dataclasses import dataclass

from .base import CompressionPolicy, keep_all


@dataclass(frozen=True)
class FullCache(CompressionPolicy):
    """Keep every entry; the engine treats it exactly like ``compression=None`` unless
    ``kv_bits`` stores the entries in fewer bits."""

    name = "full"
    kv_bits: int | None = None  # store the entries in 8 or 4 bits (compression/quantized.py)

    def __post_init__(self) -> None:
        self.check_kv_bits()

    @property
    def max_capacity_prompt(self) -> None:  # type: ignore[override]
        return None

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        b, kv_heads, n, _ = keys.shape
        return keep_all(b, kv_heads, n, keys.device)
