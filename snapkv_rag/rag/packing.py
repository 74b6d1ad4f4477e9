"""The one greedy packer behind every "as many passages as fit" decision.

:class:`~snapkv_rag.rag.stuffing.StuffingRetriever` packs chunks from the Chroma store with it,
and the LlamaIndex connector's token-budget postprocessor packs retrieved nodes with it, so
both count the same way: candidates in rank order, each costed in the *LLM's* tokens by the
caller (its numbered header and separator included), taken while they fit; a candidate that
does not fit is skipped and a later, shorter one may still go in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

#: Stop early when less than this many tokens are left: no real passage is that short.
MIN_ROOM = 8


@dataclass(frozen=True)
class Packing:
    """What :func:`pack_greedy` took: candidate indices in the order taken, and the tokens used."""

    kept: list[int]
    left_out: list[int]
    used: int
    budget: int
    costs: dict[int, int] = field(default_factory=dict)  # measured candidates only

    @property
    def complete(self) -> bool:
        return not self.left_out


def pack_greedy(
    count: int,
    cost: Callable[[int, int], int],
    budget: int,
    *,
    min_room: int = MIN_ROOM,
    stop_at_first_miss: bool = False,
) -> Packing:
    """Take candidates ``0..count-1`` in order while their cost fits ``budget``.

    ``cost(index, slot)`` is the token cost of candidate ``index`` if it becomes the
    ``slot``-th passage (1-based; numbered headers may depend on it). Packing stops when
    less than ``min_room`` tokens are left (``min_room=0`` measures every candidate), or at
    the first candidate that does not fit with ``stop_at_first_miss`` (all-or-nothing callers
    then see ``complete`` False).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    kept: list[int] = []
    left: list[int] = []
    costs: dict[int, int] = {}
    used = 0
    for index in range(count):
        if min_room and budget - used < min_room:
            left.extend(range(index, count))
            break
        c = cost(index, len(kept) + 1)
        costs[index] = c
        if used + c <= budget:
            kept.append(index)
            used += c
        else:
            left.append(index)
            if stop_at_first_miss:
                left.extend(range(index + 1, count))
                break
    return Packing(kept, left, used, budget, costs)
