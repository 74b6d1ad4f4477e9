"""Random selection: the floor every informed policy must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidCompressionError
from .base import SparsePolicy, check_positive_int, keep_all, keep_recent_and_top


@dataclass(frozen=True)
class RandomKeep(SparsePolicy):
    """Keep the ``recent`` last entries (the question) plus a uniformly random prefix subset.

    The draw depends only on ``seed`` and the shapes, so runs are reproducible.
    """

    name = "random"
    max_capacity_prompt: int = 1024
    seed: int = 0
    recent: int = 32

    def __post_init__(self) -> None:
        check_positive_int("RandomKeep", "max_capacity_prompt", self.max_capacity_prompt)
        check_positive_int("RandomKeep", "seed", self.seed, minimum=0)
        check_positive_int("RandomKeep", "recent", self.recent, minimum=0)
        if self.recent >= self.max_capacity_prompt:
            raise InvalidCompressionError(f"RandomKeep: recent ({self.recent}) must be smaller than max_capacity_prompt ({self.max_capacity_prompt})")
        self.check_shared_options()

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        prefix = n - self.recent
        gen = torch.Generator().manual_seed(self.seed)
        scores = torch.rand(b, kv_heads, prefix, generator=gen).to(keys.device)
        return keep_recent_and_top(scores, n, self.max_capacity_prompt, attention_mask, protected)
