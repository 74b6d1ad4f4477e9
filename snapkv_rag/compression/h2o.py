"""H2O: heavy hitters by accumulated attention plus recent tokens (prompt-side).

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023, arXiv:2306.14048.

Here it selects once after the prefill, with the same budget as the other policies; with
``decode_budget`` it also evicts during decoding, every ``decode_interval`` tokens, by the
attention accumulated over the queries since the last cut (the original accumulates
over every query and evicts at every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidCompressionError
from .base import SparsePolicy, check_choice, check_positive_int, keep_all, keep_recent_and_top, reduce_groups, window_attention


@dataclass(frozen=True)
class H2O(SparsePolicy):
    """Keep the ``recent`` last entries plus the prefix entries with the largest attention
    accumulated over *all* prompt queries. Queries are processed in chunks of
    ``query_chunk`` so no ``n x n`` matrix exists at once. ``recent`` defaults to half the budget.
    """

    name = "h2o"
    max_capacity_prompt: int = 1024
    recent: int | None = None
    gqa_reduce: str = "mean"
    query_chunk: int = 256

    def __post_init__(self) -> None:
        check_positive_int("H2O", "max_capacity_prompt", self.max_capacity_prompt)
        check_positive_int("H2O", "query_chunk", self.query_chunk)
        if self.recent is not None:
            check_positive_int("H2O", "recent", self.recent)
            if self.recent >= self.max_capacity_prompt:
                raise InvalidCompressionError(f"H2O: recent ({self.recent}) must be smaller than max_capacity_prompt ({self.max_capacity_prompt})")
        elif self.max_capacity_prompt < 2:
            raise InvalidCompressionError("H2O: max_capacity_prompt must be at least 2")
        check_choice("H2O", "gqa_reduce", self.gqa_reduce, ("mean", "max"))
        self.check_shared_options()

    @property
    def recent_tokens(self) -> int:
        return self.recent if self.recent is not None else self.max_capacity_prompt // 2

    @property
    def query_window(self) -> None:
        return None

    @property
    def question_aware(self) -> bool:
        return True

    def accumulated_attention(self, queries, keys, attention_mask, scaling) -> torch.Tensor:
        """Attention each key receives, summed over every query: ``[b, kv_heads, n]``."""
        b, kv_heads, n, _ = keys.shape
        start = n - queries.shape[2]
        total = torch.zeros(b, kv_heads, n, device=keys.device, dtype=torch.float32)
        for lo in range(0, queries.shape[2], self.query_chunk):
            chunk = queries[:, :, lo : lo + self.query_chunk]
            weights = window_attention(chunk, keys, attention_mask, scaling, query_start=start + lo)
            total += reduce_groups(weights.sum(dim=3), self.gqa_reduce)
        return total

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        prefix = n - self.recent_tokens
        scores = self.accumulated_attention(queries, keys, attention_mask, scaling)[..., :prefix]
        return keep_recent_and_top(scores, n, self.max_capacity_prompt, attention_mask, protected)
