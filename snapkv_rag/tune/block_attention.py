"""Block-attention masks: stuffed chunks read apart, as chunk K/V reuse computes them.

Chunk reuse (:mod:`snapkv_rag.reuse.blending`) computes each stored segment once after one
anchor token (the prompt's first), then moves its K/V to wherever the chunk lands. Training a
chunk's tokens to attend only to that anchor and to earlier tokens of their own chunk teaches
the model the K/V it will be given; every other token (labels, question, answer) attends to
everything before it, as in a normal prefill. Positions stay the prompt's own, as reuse
rotates stored keys to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ANCHOR_TOKENS = 1  # what blending.py computes a segment after: the prompt's first token


def block_ids(length: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Per token, the index of the span holding it, or -1."""
    ids = torch.full((length,), -1, dtype=torch.long)
    for i, (start, end) in enumerate(spans):
        if start < ANCHOR_TOKENS or end > length or start >= end:
            raise ValueError(f"span {(start, end)} is not inside tokens {ANCHOR_TOKENS}..{length}")
        if (ids[start:end] >= 0).any():
            raise ValueError(f"span {(start, end)} overlaps another")
        ids[start:end] = i
    return ids


def block_attention_mask(length: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A ``[1, 1, length, length]`` boolean mask (True: may attend) for one sequence: causal,
    except that a token inside a span sees only the anchor and its own span."""
    ids = block_ids(length, spans)
    positions = torch.arange(length)
    causal = positions[None, :] <= positions[:, None]
    same_block = ids[:, None] == ids[None, :]
    free = (ids < 0)[:, None] | (positions < ANCHOR_TOKENS)[None, :]
    return (causal & (same_block | free))[None, None]
