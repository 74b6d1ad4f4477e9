"""Block-attention masks: stuffed chunks read apart, exactly as chunk K/V reuse computes them.

Chunk reuse (:func:`snapkv_rag.reuse.blending.compute_segment`) computes each stored segment
after one anchor token (the prompt's first) at positions ``0, 1..m``, then rotates its keys to
wherever the chunk lands. Attention under RoPE depends only on the distance between a query
and a key, so a training sequence reproduces that computation when each chunk is preceded by
its own copy of the anchor, one position before the chunk's first token (:func:`with_anchor_copies`),
and the chunk's tokens attend only to that copy and to their own chunk: every distance inside
the chunk and to its anchor is then what ``compute_segment`` sees. The copies are invisible to
every other token; labels, the question and the answer attend to the prompt as in a normal
prefill, the original first token included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def with_anchor_copies(ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[int], list[tuple[int, int]], list[int]]:
    """``ids`` with a copy of ``ids[0]`` before each span: (new ids, their position ids, the
    spans' new token ranges, each span's anchor index). Original tokens keep their positions;
    a copy takes the position just before its span."""
    out: list[int] = []
    positions: list[int] = []
    moved: list[tuple[int, int]] = []
    anchors: list[int] = []
    previous_end = 0
    for start, end in sorted(spans):
        if start < 1 or end > len(ids) or start >= end or start < previous_end:
            raise ValueError(f"span {(start, end)} is not a separate range inside tokens 1..{len(ids)}")
        out += ids[len(positions) - len(anchors) : start]
        positions += range(len(positions) - len(anchors), start)
        anchors.append(len(out))
        out.append(ids[0])
        positions.append(start - 1)
        moved.append((len(out), len(out) + end - start))
        out += ids[start:end]
        positions += range(start, end)
        previous_end = end
    consumed = len(positions) - len(anchors)
    out += ids[consumed:]
    positions += range(consumed, len(ids))
    return list(out), positions, moved, anchors


def block_attention_mask(length: int, spans: Sequence[tuple[int, int]], anchors: Sequence[int]) -> torch.Tensor:
    """A ``[1, 1, length, length]`` boolean mask (True: may attend) for one sequence laid out by
    :func:`with_anchor_copies`: a chunk's tokens see their anchor copy and earlier tokens of
    their chunk, a copy sees itself, every other token sees every earlier token but the copies."""
    if len(spans) != len(anchors):
        raise ValueError("one anchor copy per span")
    block = torch.full((length,), -1, dtype=torch.long)
    anchor_of = torch.full((length,), -1, dtype=torch.long)
    for i, ((start, end), anchor) in enumerate(zip(spans, anchors)):
        if not 0 <= anchor < start < end <= length or (block[start:end] >= 0).any() or block[anchor] >= 0:
            raise ValueError(f"span {(start, end)} with anchor {anchor} does not fit tokens 0..{length}")
        block[start:end] = i
        anchor_of[anchor] = i
    positions = torch.arange(length)
    causal = positions[None, :] <= positions[:, None]
    is_copy = anchor_of >= 0
    in_chunk = block >= 0
    own_chunk = (block[:, None] == block[None, :]) | (block[:, None] == anchor_of[None, :])
    free = ~in_chunk[:, None] & ~is_copy[:, None] & ~is_copy[None, :]
    itself = torch.eye(length, dtype=torch.bool)
    allowed = (in_chunk[:, None] & own_chunk) | free | (is_copy[:, None] & itself)
    return (causal & allowed)[None, None]
