"""Prompt-lookup drafts: decode several tokens per forward when the answer copies its prompt.

At each step the longest recent n-gram (up to :data:`MAX_NGRAM` tokens) of the text so far is
looked up in the prompt and in what was generated; the tokens that followed its latest earlier
occurrence are the draft. One forward over the chosen token and the draft checks them all:
each draft token is kept while it is the token greedy decoding would have chosen there, and
the forward's logits after the last kept one give the next token, so the output is the one
plain greedy decoding gives (token for token in fp32; see docs/speculative.md for bf16).

The rejected tokens' K/V are dropped from the end of every layer by count, not by absolute
length: a compressed cache holds fewer entries than the positions it covers.

Under a grammar (tools, JSON) each draft token is checked against the grammar's mask at its
position as well, and drafting pauses where unfinished JSON is steered to close. Drafting is
only exact for one greedy row whose cache changes only by appending; :func:`draft_blocker`
names what stops it, and the stats say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .sampling import GenerationParams

MAX_NGRAM = 3  # the longest suffix looked up
MIN_NGRAM = 1


class DraftIndex:
    """Where each n-gram (1 to :data:`MAX_NGRAM` tokens) of a growing token sequence last
    occurred with a token after it; built once over the prompt, extended per generated token."""

    def __init__(self, prompt: Sequence[int]):
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        for token in prompt:
            self.append(token)

    def append(self, token: int) -> None:
        tokens = self.tokens
        end = len(tokens)  # the index ``token`` gets: it follows every n-gram ending just before it
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if end >= n:
                self._next[n][tuple(tokens[end - n : end])] = end
        tokens.append(token)

    def draft(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest
        matching suffix, and that suffix's length (0 and no draft: nothing matched)."""
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            start = self._next[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + limit], n
        return [], 0


def draft_blocker(run: Any, params: GenerationParams) -> str | None:
    """Why ``run`` (a prefilled :class:`~snapkv_rag.engine.generation.DecodeRun`) cannot decode
    with exact drafts (None: it can)."""
    if getattr(run, "invariant", False):
        return "the invariant mode computes one token per forward (a draft's multi-token forward rounds otherwise)"
    if run.batch_size != 1:
        return "several prompts decode in one batch"
    if params.temperature > 0:
        return "sampling (temperature > 0) decodes without drafts"
    if run.policy_state is not None and run.policy_state.compacts:
        return "decode-time cuts (decode_budget) change the cache between steps"
    if run.ragged_heads:
        return "per-head budgets (heads=adaptive) keep ragged layers"
    if any(run.sliding):
        return "sliding-window layers keep only their window"
    if run.span_attention is not None:
        return "attention over spans is recorded one token at a time"
    return None


def drop_last(cache, count: int) -> None:
    """Drop the last ``count`` entries of every layer of ``cache`` (the rejected draft tokens)."""
    if count <= 0:
        return
    for layer in cache.layers:
        layer.crop(-count)


@dataclass
class DraftStats:
    """What drafting did for one request: forwards with a draft, tokens drafted and accepted."""

    num_tokens: int  # prompt_lookup_num_tokens asked for
    off: str | None = None  # why no draft was tried (None: drafting ran)
    forwards: int = 0  # decode forwards (with or without a draft)
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    shared_steps: int = 0  # forwards without a draft because other requests shared the batch

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_lookup_num_tokens": self.num_tokens}
        if self.off is not None:
            out["draft_off"] = self.off
            return out
        return {
            **out,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
            "draft_acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "tokens_per_forward": round((self.forwards + self.accepted) / self.forwards, 4) if self.forwards else None,
            "draft_shared_steps": self.shared_steps,
        }


class Drafter:
    """One request's drafts: the index over its prompt and output, and what they achieved."""

    def __init__(self, prompt: Sequence[int], num_tokens: int):
        self.index = DraftIndex(prompt)
        self.stats = DraftStats(num_tokens)

    def generated(self, token: int) -> None:
        self.index.append(token)

    def draft(self, remaining: int) -> list[int]:
        """The draft after the tokens so far, at most ``remaining`` tokens (what max_new_tokens leaves)."""
        limit = min(self.stats.num_tokens, remaining)
        if limit <= 0:
            return []
        draft, _ = self.index.draft(limit)
        return draft

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.forwards += 1
        if drafted:
            self.stats.draft_forwards += 1
            self.stats.drafted += drafted
            self.stats.accepted += accepted


def draft_input(token: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """``[1, 1 + len(draft)]``: the chosen token ``[1]`` followed by the draft."""
    return torch.cat([token.view(1, 1), torch.tensor([draft], dtype=token.dtype, device=token.device)], dim=1)
