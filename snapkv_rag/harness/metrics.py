"""Metric definitions of ``docs/design/evaluation-method.md``: citations, agreement, KL, needle match.

Citation markers are parsed by :func:`snapkv_rag.rag.citations.parse_citations` (document QA
reads them too), exported here with the metrics."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import torch

from ..rag.citations import parse_citations

__all__ = [
    "citation_prf",
    "greedy_agreement",
    "macro_f1",
    "micro_prf",
    "needle_exact_match",
    "next_token_kl",
    "parse_citations",
    "relative_difference",
]


def citation_prf(cited: Iterable[int], reference: Iterable[int]) -> tuple[float, float, float]:
    """Precision, recall, F1 of ``cited`` (P) against ``reference`` (R).

    Both empty: (1, 1, 1). Exactly one empty: (0, 0, 0).
    """
    p, r = set(cited), set(reference)
    if not p and not r:
        return 1.0, 1.0, 1.0
    if not p or not r:
        return 0.0, 0.0, 0.0
    overlap = len(p & r)
    precision, recall = overlap / len(p), overlap / len(r)
    f1 = 2 * precision * recall / (precision + recall) if overlap else 0.0
    return precision, recall, f1


def macro_f1(pairs: Sequence[tuple[Iterable[int], Iterable[int]]]) -> float:
    """Mean of the per-question F1 over ``(cited, reference)`` pairs."""
    if not pairs:
        return math.nan
    return sum(citation_prf(c, r)[2] for c, r in pairs) / len(pairs)


def micro_prf(pairs: Sequence[tuple[Iterable[int], Iterable[int]]]) -> tuple[float, float, float]:
    """Precision, recall, F1 pooled over all pairs (counts summed before dividing)."""
    tp = n_cited = n_ref = 0
    for c, r in pairs:
        c, r = set(c), set(r)
        tp += len(c & r)
        n_cited += len(c)
        n_ref += len(r)
    if n_cited == 0 and n_ref == 0:
        return 1.0, 1.0, 1.0
    precision = tp / n_cited if n_cited else 0.0
    recall = tp / n_ref if n_ref else 0.0
    f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
    return precision, recall, f1


def relative_difference(compressed: float, full: float) -> float:
    """``(compressed - full) / full``; NaN when ``full`` is 0."""
    return (compressed - full) / full if full else math.nan


def greedy_agreement(reference: Sequence[int], candidate: Sequence[int]) -> tuple[float, float]:
    """Share of the reference's tokens matched ``(until the first divergence, overall by position)``."""
    if not reference:
        return 1.0, 1.0
    prefix = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        prefix += 1
    overall = sum(a == b for a, b in zip(reference, candidate))
    return prefix / len(reference), overall / len(reference)


def next_token_kl(full_logits: torch.Tensor, compressed_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step ``KL(full || compressed)`` (nats) and top-1 agreement, for ``[steps, vocab]`` logits."""
    log_p = full_logits.float().log_softmax(dim=-1)
    log_q = compressed_logits.float().log_softmax(dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    top1 = full_logits.argmax(dim=-1) == compressed_logits.argmax(dim=-1)
    return kl, top1


def needle_exact_match(output: str, answer: str) -> bool:
    """The fact appears as one unbroken number (or exact substring for non-numeric facts)."""
    if answer.isdigit():
        return answer in re.findall(r"\d+", output)
    return answer in output
