"""A stuffing order that lets the next question reuse the last prompts' K/V exactly.

The engine's prefix cache reuses the longest stored *token prefix* of a prompt. A stuffed
prompt is the system prompt, then the numbered documents, then the question, so two questions
share the K/V of every leading document that they stuff at the same place. In score order two
questions that retrieve the same chunks rank them differently and share little past the
instructions. The reuse order ("cache") stuffs first the longest head of a recently stuffed
prompt whose chunks are all in the new selection, in that prompt's order, then the rest by
score (RAGCache's prefix tree, kept here as a short list of recent orders). The *set* of chunks
is chosen by score exactly as before; only their places change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from threading import Lock
from weakref import WeakKeyDictionary

#: Recent prompts remembered; the engine's prefix cache (1 GiB on the CPU) holds about 20
#: 1K-token prompts of the embedded model, so more would mostly point at evicted entries.
DEFAULT_REMEMBERED = 16


@dataclass
class StuffedOrders:
    """The chunk orders of the last prompts stuffed for one engine, most recent last (thread-safe;
    :func:`orders_for` gives an engine's)."""

    remembered: int = DEFAULT_REMEMBERED
    _orders: deque = field(default_factory=deque)
    _lock: Lock = field(default_factory=Lock)

    def __post_init__(self) -> None:
        if isinstance(self.remembered, bool) or not isinstance(self.remembered, int) or self.remembered < 1:
            raise ValueError(f"remembered must be a positive integer, got {self.remembered!r}")

    def record(self, chunk_ids: Sequence[str], system_prompt: str) -> None:
        with self._lock:
            entry = (system_prompt, tuple(chunk_ids))
            if entry in self._orders:
                self._orders.remove(entry)
            self._orders.append(entry)
            while len(self._orders) > self.remembered:
                self._orders.popleft()

    def recent(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(system prompt, chunk ids)`` of the remembered prompts, most recent first."""
        with self._lock:
            return list(reversed(self._orders))

    def clear(self) -> None:
        with self._lock:
            self._orders.clear()


_BY_ENGINE: WeakKeyDictionary = WeakKeyDictionary()
_BY_ENGINE_LOCK = Lock()


def orders_for(engine) -> StuffedOrders:
    """The orders of every prompt stuffed for ``engine``'s prefix cache (one per engine), so
    retrievers made per call (LangChain's, the app's) still follow what it holds."""
    with _BY_ENGINE_LOCK:
        try:
            orders = _BY_ENGINE.get(engine)
            if orders is None:
                orders = _BY_ENGINE[engine] = StuffedOrders()
        except TypeError:  # not weakly referenceable or hashable: this retriever's own
            return StuffedOrders()
        return orders


def shared_head(order: Sequence[str], selected: set[str]) -> int:
    """How many leading chunks of ``order`` are all in ``selected``."""
    n = 0
    for chunk_id in order:
        if chunk_id not in selected:
            break
        n += 1
    return n


def reuse_order(chunk_ids: Sequence[str], orders: StuffedOrders, system_prompt: str, cost: Callable[[str], int]) -> tuple[list[str], int]:
    """``chunk_ids`` (best first) reordered for prefix reuse, and how many lead from a remembered prompt.

    The remembered prompt whose shared head costs the most tokens (``cost(chunk_id)``) wins,
    the most recent among equals; with none sharing a chunk the score order stands.
    """
    selected = set(chunk_ids)
    best: tuple[str, ...] = ()
    best_tokens = 0
    for system, order in orders.recent():
        if system != system_prompt:
            continue
        head = order[: shared_head(order, selected)]
        tokens = sum(cost(c) for c in head)
        if tokens > best_tokens:
            best, best_tokens = head, tokens
    lead = set(best)
    return [*best, *(c for c in chunk_ids if c not in lead)], len(best)
