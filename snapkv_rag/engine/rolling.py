"""A rolling prefill: the prompt read ``rolling=N`` tokens at a time into a cache that the policy
cuts back to its budget after every chunk (FINCH, Corallo & Papotti, TACL 2024; InfiniPot).

A whole prefill holds every layer's K/V of the whole prompt before the policy selects, and a
prompt past the model's window cannot run at all. A rolling one never holds more than
``budget + N + window`` entries per layer, and no token ever sits at a position past that:

1. The prompt is split into its body and its observation window ``w`` (the question when
   ``window=question``, else the last ``window`` tokens; none for policies without one).
2. Each chunk of ``N`` body tokens runs against the cache, the window's tokens appended after
   it, so the window's queries vote on the cache plus the chunk exactly as they vote on a whole
   prompt (FINCH). The policy keeps ``budget`` entries of the cache and the chunk, and the
   window's own K/V are dropped. H2O, whose every query votes, is scored by the chunk's own
   queries; StreamingLLM and random keep what they always keep.
3. The kept keys are moved to contiguous positions ``0..k-1`` with the model's own rotary
   embedding (the rotation chunk reuse uses), so the next chunk starts at position ``k``.
4. The last chunk runs with the real window at its end and is selected as a whole prompt is;
   generation continues right after it. With a prompt that fits in one chunk nothing rolls:
   the prefill is today's whole one.

Sliding-window layers (Gemma 2/3) are not cut by the policy; they keep the last ``W - 1``
entries of the text as they always do, and move with the rest: after a chunk, the window's
appended entries are dropped, the chunk's last ``min(W - 1, k)`` entries are rotated (with the
layer's own rotary frequencies) to the positions ``k - m..k - 1`` right before the next chunk,
and the layer's count of tokens seen becomes ``k``, so the model's sliding mask lines up with the
packed positions. A sliding layer's next chunk thus sees the text just before it at the same
distances as in a whole prefill; with ``budget < W - 1`` it sees only the last ``budget`` tokens.

What a rolled prompt's first tokens see: each token attends to the entries kept from before its
chunk (at most ``budget``, moved to the first positions) and to its chunk up to itself; a token
of the first chunk sees the whole of what came before it, as in a whole prefill.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from ..compression.base import CompressionPolicy
from ..compression.runtime import PrefillCompression, WindowVotes, compressing, record_window_votes
from ..errors import InvalidCompressionError


@dataclass
class RollingStats:
    chunks: int = 0
    peak_entries: int = 0  # the most K/V entries one layer held at once during the prefill

    @property
    def max_position(self) -> int:
        """The highest position any prompt token was computed at (entries are packed at 0..peak-1)."""
        return self.peak_entries - 1

    def to_dict(self) -> dict[str, int]:
        return {"rolled_chunks": self.chunks, "rolling_peak_entries": self.peak_entries, "rolling_max_position": self.max_position}


@dataclass(frozen=True)
class RollingPlan:
    """``chunks``: ``[start, end)`` of each forward's own tokens in the prompt; ``window``: the
    observation window's ``[start, end)``, appended to every chunk but the last (None: none)."""

    chunks: list[tuple[int, int]]
    window: tuple[int, int] | None
    budget: int


def rolling_plan(n: int, policy: CompressionPolicy) -> RollingPlan | None:
    """How a prompt of ``n`` tokens rolls under ``policy`` (None: it fits in one chunk, or the policy does not roll)."""
    chunk = getattr(policy, "rolling", None)
    if chunk is None:
        return None
    window = policy.query_window or 0  # None (every query votes: H2O) scores a chunk by its own queries
    body = n - window
    if body <= chunk:
        return None
    starts = list(range(0, body, chunk))
    chunks = [(a, min(a + chunk, body)) for a in starts]
    chunks[-1] = (chunks[-1][0], n)  # the last chunk ends with the real window
    return RollingPlan(chunks, (body, n) if window else None, policy.max_capacity_prompt)


def pack_positions(cache, kept: dict[int, torch.Tensor], shift) -> int:
    """Move every compressed layer's kept keys from their positions (``kept[layer]``: ``[b, kv_heads, k]``,
    ascending, equal to the positions they were computed at) to ``0..k-1``; returns ``k``."""
    width = 0
    for layer_idx, indices in kept.items():
        layer = cache.layers[layer_idx]
        k = layer.keys.shape[2]
        target = torch.arange(k, device=indices.device)
        offsets = target - indices  # <= 0: every kept entry moves earlier or stays
        if bool((offsets != 0).any()):
            layer.keys = shift.each(layer.keys, offsets, layer_idx)
        width = max(width, k)
    return width


def rolling_prefill(run, policy: CompressionPolicy, plan: RollingPlan, shift) -> Generator[None, None, torch.Tensor]:
    """Prefill ``run``'s one unpadded prompt by ``plan``; yields between chunks, returns the last logits ``[1, vocab]``.

    ``run``: a :class:`~snapkv_rag.engine.generation.DecodeRun`; ``shift``: its model's
    :class:`~snapkv_rag.reuse.blending.RopeShift`."""
    ids = run.input_ids
    device = ids.device
    stats = run.rolling = RollingStats()
    window_ids = ids[:, plan.window[0] : plan.window[1]] if plan.window is not None else ids[:, :0]
    w = window_ids.shape[1]
    scoring = policy.with_budget(plan.budget + w) if w else policy
    held = 0  # entries per layer in the cache before this chunk (packed at 0..held-1)
    windows = SlidingWindows(run.cache, [i for i, slides in enumerate(run.sliding) if slides])
    votes: dict[int, torch.Tensor] = {}  # layer -> [heads, n]: each position's votes in the forward that read it
    for i, (a, b) in enumerate(plan.chunks):
        last = i == len(plan.chunks) - 1
        tokens = ids[:, a:b] if last else torch.cat([ids[:, a:b], window_ids], dim=1)
        positions = torch.arange(held, held + tokens.shape[1], device=device)[None]
        stats.chunks += 1
        stats.peak_entries = max(stats.peak_entries, held + tokens.shape[1])
        session = PrefillCompression(policy if last else scoring, run.cache, None, run.sliding, run.policy_state)
        run.session = session
        with compressing(session, record=False):  # kept indices here are chunk positions, not the prompt's
            run._forward(tokens, None, positions)
        for layer, mass in (session.votes or {}).items():
            votes.setdefault(layer, torch.zeros(mass.shape[0], ids.shape[1]))[:, a:b] = mass[:, held : held + (b - a)]
        if last:
            if votes:
                record_window_votes(WindowVotes(ids.shape[1], votes))
            windows.finish()
            run._last_position = positions[:, -1:]
            return run.last_logits
        kept = {layer: indices for layer, indices in session.kept_indices.items() if isinstance(indices, torch.Tensor)}
        if w:
            drop_window(run.cache, kept, held + (b - a))
        packed = pack_positions(run.cache, kept, shift)
        windows.move(held + (b - a), packed, w, shift)
        held = packed
        yield
    raise AssertionError("a rolling plan has at least one chunk")


def drop_window(cache, kept: dict[int, torch.Tensor], boundary: int) -> None:
    """Drop the entries at positions ``>= boundary`` (the appended window's) from every compressed layer,
    and from ``kept`` the indices that pointed at them."""
    for layer_idx, indices in kept.items():
        inside = indices < boundary  # [b, kv_heads, k]; the window's entries are the last ones
        k = int(inside[0, 0].sum())
        if not bool((inside.sum(-1) == k).all()):
            raise InvalidCompressionError("the policy kept different numbers of window entries per head; rolling= needs a policy that keeps its window")
        layer = cache.layers[layer_idx]
        layer.keys, layer.values = layer.keys[:, :, :k], layer.values[:, :, :k]
        kept[layer_idx] = indices[..., :k]


class SlidingWindows:
    """The sliding-window layers of a rolled prefill's cache (see the module's docstring).

    While rolling they keep every entry a chunk adds (transformers' ``record_past``), so the
    window's appended entries can be dropped before the layer is cut back to its window."""

    def __init__(self, cache, layers: list[int]):
        self.layers = [cache.layers[i] for i in layers]
        self.indices = layers
        for layer in self.layers:
            layer.record_past = True

    def move(self, boundary: int, packed: int, window: int, shift) -> None:
        """After a chunk whose text ends before position ``boundary`` (``window`` entries of the
        appended window after it): keep the last ``min(W - 1, packed)`` entries of the text, moved
        to end at ``packed``, where the next chunk starts."""
        for layer_idx, layer in zip(self.indices, self.layers):
            end = layer.keys.shape[2] - window
            keep = min(layer.sliding_window - 1, packed, end)
            layer.keys = shift(layer.keys[:, :, end - keep : end], packed - boundary, layer_idx)
            layer.values = layer.values[:, :, end - keep : end]
            layer.cumulative_length = packed

    def finish(self) -> None:
        """After the last chunk: back to a plain sliding window for decoding."""
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, -layer.sliding_window + 1 :], layer.values[:, :, -layer.sliding_window + 1 :]
            layer.record_past = False
