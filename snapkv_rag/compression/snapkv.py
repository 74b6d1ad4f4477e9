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
    SparsePolicy,
    check_choice,
    check_positive_int,
    keep_adaptive,
    keep_all,
    keep_recent_and_top,
    reduce_groups,
    window_attention,
)

QUESTION_WINDOW = "question"
FALLBACK_WINDOW = 32
LAYER_BUDGETS = ("uniform", "pyramid")
HEAD_BUDGETS = ("uniform", "adaptive")
KEEP_EVERYTHING = 2**62  # the budget of a layer left whole


@dataclass(frozen=True)
class SnapKV(SparsePolicy):
    """Keep the ``window_size`` last prompt entries plus the ``max_capacity_prompt - window_size``
    prefix entries that the window's queries attend to most (votes summed over the window,
    reduced over each GQA group, then pooled over neighbouring positions).

    Defaults are the paper's LongBench settings (w=32, k=7, max pooling).

    ``window_size="question"`` aligns the observation window with the question: the engine
    resolves it per prompt (per row in a batch) to the question's tokens plus the chat
    template's tail, clipped to ``[min_window, max_window]``, before prefill. The question
    is the text the caller names (``question=``), else the last paragraph of the last user
    message. A fixed window of 32 takes in filler in front of a short question, whose
    queries then outvote what the question asks for (eval/compression/RESULTS.md, "SnapKV sensitivity").

    Two selection options from later work, off by default:

    - ``chunk_size=c`` (ChunkKV, Liu et al. 2025, arXiv:2502.00299): the prefix is cut into
      spans of ``c`` tokens, counted back from the window, and whole spans are kept in the
      order of their summed (pooled) votes, so a kept fact keeps the words around it. The
      last span that fits only in part keeps its earliest tokens. With ``chunk_min_ratio=r``
      spans are used only when the prompt is at least ``r`` times the budget (a shallower cut
      selects token by token).
    - ``layer_budgets="pyramid"`` (PyramidKV, Cai et al. 2024, arXiv:2406.02069): the bottom
      compressed layer keeps the most entries and the top one the fewest, in a straight line
      whose mean is ``max_capacity_prompt`` (so the cache holds as many entries in all as the
      uniform one); the top layer keeps ``(budget - window) / pyramid_beta`` voted entries
      plus the window. Layers then hold different numbers of entries: memory is really saved
      per layer, and such runs decode on their own rather than in a shared batch.
    - ``head_budgets="adaptive"`` (AdaKV, Feng et al. 2024, arXiv:2407.11550): a layer keeps
      ``kv_heads * max_capacity_prompt`` entries in all, given to the best-voted (head,
      position) pairs over all its heads, after each head gets its own best ``head_floor``
      share of a uniform head's voted entries (AdaKV's safeguard, 0.2). Heads then hold
      different numbers of entries, which the cache stores ragged
      (:mod:`snapkv_rag.compression.ragged`): the memory is the kept entries', as for the
      uniform policy. One prompt at a time (batches run row by row), not with LESS or
      decode-time cuts.
    - ``whole_layers=N``: the first ``N`` compressed layers keep the whole prompt (the others
      keep their budget), for models whose lowest layers spread attention too widely for a
      window to vote well. The cache then holds more than the budget in those layers.
    """

    name = "snapkv"
    window_size: int | str = 32
    max_capacity_prompt: int = 1024
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "mean"
    min_window: int = 8
    max_window: int = 64
    chunk_size: int = 1
    chunk_min_ratio: int = 1  # spans only when the prompt is at least this many times the budget
    layer_budgets: str = "uniform"
    pyramid_beta: int = 20
    head_budgets: str = "uniform"
    head_floor: float = 0.2  # adaptive heads: the share of a uniform head's voted entries each head is sure of
    whole_layers: int = 0

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
        check_positive_int("SnapKV", "chunk_size", self.chunk_size)
        check_positive_int("SnapKV", "chunk_min_ratio", self.chunk_min_ratio)
        check_choice("SnapKV", "layer_budgets", self.layer_budgets, LAYER_BUDGETS)
        check_positive_int("SnapKV", "pyramid_beta", self.pyramid_beta)
        check_choice("SnapKV", "head_budgets", self.head_budgets, HEAD_BUDGETS)
        check_positive_int("SnapKV", "whole_layers", self.whole_layers, minimum=0)
        if isinstance(self.head_floor, bool) or not isinstance(self.head_floor, (int, float)) or not 0 <= self.head_floor <= 1:
            raise InvalidCompressionError(f"SnapKV: head_floor must be a number from 0 to 1, got {self.head_floor!r}")
        if self.ragged_heads and self.decode_budget is not None:
            raise InvalidCompressionError("SnapKV: decode_budget (decode-time cuts) does not combine with head_budgets='adaptive'")
        self.check_shared_options()
        if self.rolling is not None:
            if self.ragged_heads:
                raise InvalidCompressionError("SnapKV: rolling= does not combine with head_budgets='adaptive' (per-head budgets)")
            if self.layer_budgets != "uniform":
                raise InvalidCompressionError("SnapKV: rolling= needs the same budget in every layer (layer_budgets='uniform')")
            if self.whole_layers:
                raise InvalidCompressionError("SnapKV: rolling= does not combine with whole_layers (those layers would hold the whole prompt)")

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

    @property
    def window_bound(self) -> int:
        return self.max_window if self.window_size == QUESTION_WINDOW else int(self.window_size)

    def with_query_window(self, window: int) -> SnapKV:
        return self if window == self.window_size else dataclasses.replace(self, window_size=window)

    def for_layer(self, position: int, layers: int) -> SnapKV:
        if position < self.whole_layers:
            return dataclasses.replace(self, max_capacity_prompt=KEEP_EVERYTHING, layer_budgets="uniform", whole_layers=0)
        if self.layer_budgets == "uniform":
            return self
        if self.window_size == QUESTION_WINDOW:
            raise InvalidCompressionError("SnapKV(window_size='question') must be resolved per prompt before per-layer budgets")
        return dataclasses.replace(
            self,
            max_capacity_prompt=pyramid_budget(self.max_capacity_prompt, int(self.window_size), self.pyramid_beta, position, layers),
            layer_budgets="uniform",
        )

    def spec_fields(self) -> dict:
        """As the base's, leaving out the selection options at their defaults (specs and the
        keys derived from them stay what they were before the options existed)."""
        fields = super().spec_fields()
        if fields.get("chunk_size") == 1:
            del fields["chunk_size"]
        if fields.get("chunk_min_ratio") == 1:
            del fields["chunk_min_ratio"]
        if fields.get("layer_budgets") == "uniform":
            del fields["layer_budgets"], fields["pyramid_beta"]
        if fields.get("head_budgets") == "uniform":
            del fields["head_budgets"], fields["head_floor"]
        if fields.get("whole_layers") == 0:
            del fields["whole_layers"]
        return fields

    @property
    def ragged_heads(self) -> bool:
        return self.head_budgets == "adaptive"

    def for_decode(self) -> SnapKV:
        # decode_budget is a per-layer cap; decode-time cuts bring every layer back to it
        return dataclasses.replace(super().for_decode(), layer_budgets="uniform")  # type: ignore[return-value]

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
        pooled = pooled.reshape(b, h, p)
        if self.chunk_size == 1:
            return pooled
        real = attention_mask.sum(dim=-1) if attention_mask is not None else torch.full((b,), n, device=votes.device)
        deep_cut = (real >= self.chunk_min_ratio * self.max_capacity_prompt)[:, None, None]  # per row: its real length
        return torch.where(deep_cut, span_scores(pooled, self.chunk_size), pooled)

    def _check_window(self, queries: torch.Tensor) -> None:
        if queries.shape[2] != self.window_size:
            raise InvalidCompressionError(f"SnapKV expects {self.window_size} window queries, got {queries.shape[2]}")

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        if self.ragged_heads:
            raise InvalidCompressionError("SnapKV(head_budgets='adaptive') keeps different numbers of entries per head: use select_heads")
        self._check_window(queries)
        votes = self.votes(queries, keys, attention_mask, scaling)
        return keep_recent_and_top(votes, n, self.max_capacity_prompt, attention_mask, protected)

    def select_heads(self, queries, keys, *, scaling=None, protected=None):
        if keys.shape[0] != 1:
            raise InvalidCompressionError("SnapKV(head_budgets='adaptive') selects for one prompt at a time")
        n = keys.shape[2]
        if n > self.max_capacity_prompt:
            self._check_window(queries)
        votes = self.votes(queries, keys, None, scaling) if n > self.max_capacity_prompt else keys.new_zeros(1, keys.shape[1], 0)
        return keep_adaptive(votes, n, self.max_capacity_prompt, float(self.head_floor), protected)


def span_scores(votes: torch.Tensor, span: int) -> torch.Tensor:
    """Every position scored by the sum of ``votes [b, h, p]`` over its span of ``span`` positions.

    Spans are counted back from position ``p`` (the window's start), so they cover the same
    tokens whatever a row's left padding. Positions of a span share one score: a stable
    descending sort then takes spans whole, earliest position first.
    """
    b, h, p = votes.shape
    lead = (-p) % span
    padded = F.pad(votes, (lead, 0))
    sums = padded.reshape(b, h, -1, span).sum(dim=-1)
    return sums.repeat_interleave(span, dim=-1)[..., lead:]


def pyramid_budget(budget: int, window: int, beta: int, position: int, layers: int) -> int:
    """The ``position``-th of ``layers`` layers' budget in PyramidKV's linear schedule (mean ``budget``)."""
    voted = budget - window
    if layers <= 1 or voted <= 1:
        return budget
    fewest = max(1, voted // beta)
    most = 2 * voted - fewest
    return window + round(most - position * (most - fewest) / (layers - 1))
