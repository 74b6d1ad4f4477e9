"""Validated generation parameters and next-token selection (greedy, temperature, top-p)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..errors import InvalidGenerationParameterError

MAX_DRAFT_TOKENS = 64  # the most prompt_lookup_num_tokens accepts


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens tokens
    min_new_tokens: int = 0  # end-of-sequence tokens are not chosen before this many tokens (vLLM's min_tokens)
    prompt_lookup_num_tokens: int = 0  # draft tokens looked up in the prompt per forward (0: none; see engine.lookup)

    def __post_init__(self) -> None:
        bad = InvalidGenerationParameterError
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}", param="max_new_tokens")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}", param="temperature")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise bad(f"seed must be a non-negative integer or None, got {self.seed!r}", param="seed")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be True or False, got {self.ignore_eos!r}", param="ignore_eos")
        m = self.min_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_new_tokens:
            raise bad(f"min_new_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), got {m!r}", param="min_new_tokens")
        k = self.prompt_lookup_num_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise bad(f"prompt_lookup_num_tokens must be an integer from 0 (no drafts) to {MAX_DRAFT_TOKENS}, got {k!r}", param="prompt_lookup_num_tokens")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad(f"stop sequences must be non-empty strings, got {s!r}", param="stop")

    @classmethod
    def build(cls, **options: Any) -> GenerationParams:
        """From keyword options: max_new_tokens, temperature, top_p, stop (str or list), seed, ignore_eos, min_new_tokens,
        prompt_lookup_num_tokens."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidGenerationParameterError(f"unknown generation parameter(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        stop = options.pop("stop", None)
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, Sequence):
            stops = tuple(stop)
        else:
            raise InvalidGenerationParameterError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
        return cls(stop=stops, **options)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: GenerationParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def select_next_tokens(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> torch.Tensor:
    """``logits [batch, vocab]`` -> token ids ``[batch]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    # Shift so the best logit is 0 before dividing (in float64, where even the smallest
    # positive temperature is not 0): a tiny temperature then sends the others to -inf
    # (greedy) instead of inf - inf = NaN inside the softmax.
    scores = logits.double()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
