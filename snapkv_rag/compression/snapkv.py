"""SnapKV: observation-window voting, pooling and per-head top-k.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
NeurIPS 2024, arXiv:2404.14469.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidCompressionError
from .base import (
    CompressionPolicy,
    check_choice,
    check_positive_int,
    keep_all,
    keep_recent_and_top,
    reduce_groups,
    window_attention,
)

QUESTION_WINDOW = "question"
FALLBACK_WINDOW = 32


@dataclass(frozen=True)
class SnapKV(CompressionPolicy):
    """Keep the ``window_size`` last prompt entries plus the ``max_capacity_prompt - window_size``
    prefix entries that the window's queries attend to most (votes summed over the window,
    reduced over each GQA group, then pooled over neighbouring positions).

    Defaults are the paper's LongBench settings (w=32, k=7, max pooling).

    ``window_size="question"`` aligns the observation window with the question: the engine
    resolves it per prompt (per row in a batch) to the question's tokens plus the chat
    template's tail, clipped to ``[min_window, max_window]``, before prefill. The question
    is the text the caller names (``question=``), else the last paragraph of the last user
    message. A fixed window of 32 takes in filler in front of a short question, whose
    queries then outvote what the question asks for (eval/RESULTS.md, needle sensitivity).
    """

    name = "snapkv"
    window_size: int | str = 32
    max_capacity_prompt: int = 1024
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "mean"
    min_window: int = 8
    max_window: int = 64
    decode_budget: int | None = None  # cut the cache back to this many entries per layer during decoding
    decode_interval: int | None = None  # ... every this many generated tokens (None: 64)

    def __post_init__(self) -> None:
        check_positive_int("SnapKV", "max_capacity_prompt", self.max_capacity_prompt)
        check_positive_int("SnapKV", "kernel_size", self.kernel_size)
        check_positive_int("SnapKV", "min_window", self.min_window)
        check_positive_int("SnapKV", "max_window", self.max_window, minimum=self.min_window)
        if self.window_size == QUESTION_WINDOW:
            largest, what = self.max_window, "max_window"
        else:
            check_positive_int("SnapKV", "window_size (or 'question')", self.window_size)
            largest, what = int(self.window_size), "window_size"
        if largest >= self.max_capacity_prompt:
            raise InvalidCompressionError(
                f"SnapKV: {what} ({largest}) must be smaller than "
                f"max_capacity_prompt ({self.max_capacity_prompt}); raise the budget or shrink the window"
                + (" (max_window=...)" if what == "max_window" else "")
            )
        if self.kernel_size % 2 == 0:
            raise InvalidCompressionError(f"SnapKV: kernel_size must be odd (got {self.kernel_size}) so pooling stays centred")
        check_choice("SnapKV", "pooling", self.pooling, ("max", "avg"))
        check_choice("SnapKV", "gqa_reduce", self.gqa_reduce, ("mean", "max"))
        self.check_decode_budget()

    @property
    def query_window(self) -> int:
        if self.window_size == QUESTION_WINDOW:
            raise InvalidCompressionError("SnapKV(window_size='question') must be resolved per prompt (the engine does this)")
        return int(self.window_size)

    @property
    def needs_question_span(self) -> bool:
        return self.window_size == QUESTION_WINDOW

    def for_prompt(self, question_tokens: int | None) -> SnapKV:
        """The fixed-window policy for one prompt whose question (plus template tail) spans
        ``question_tokens`` trailing tokens (None: not found, the paper's 32 is used)."""
        if not self.needs_question_span:
            return self
        wanted = FALLBACK_WINDOW if question_tokens is None else question_tokens
        return dataclasses.replace(self, window_size=min(max(wanted, self.min_window), self.max_window))

    @property
    def question_aware(self) -> bool:
        return True

    def with_query_window(self, window: int) -> SnapKV:
        return self if window == self.window_size else dataclasses.replace(self, window_size=window)

    def votes(self, queries: torch.Tensor, keys: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """Pooled per-KV-head votes for the prefix positions, ``[b, kv_heads, n - window]``."""
        n = keys.shape[2]
        window = queries.shape[2]
        weights = window_attention(queries, keys, attention_mask, scaling, query_start=n - window)
        votes = reduce_groups(weights[..., : n - window].sum(dim=3), self.gqa_reduce)
        if attention_mask is not None:
            votes = votes * attention_mask[:, None, : n - window].to(votes.dtype)
        b, h, p = votes.shape
        flat = votes.reshape(b * h, 1, p)
        pad = self.kernel_size // 2
        if self.pooling == "max":
            pooled = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            pooled = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        return pooled.reshape(b, h, p)

    def select(self, queries, keys, attention_mask=None, *, scaling=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        if queries.shape[2] != self.window_size:
            raise InvalidCompressionError(f"SnapKV expects {self.window_size} window queries, got {queries.shape[2]}")
        votes = self.votes(queries, keys, attention_mask, scaling)
        return keep_recent_and_top(votes, n, self.max_capacity_prompt, attention_mask)
