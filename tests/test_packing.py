"""The shared greedy packer (StuffingRetriever and the LlamaIndex budget postprocessor use it)."""

from __future__ import annotations

import pytest

from snapkv_rag.rag.packing import pack_greedy


def test_takes_in_order_and_skips_what_does_not_fit():
    costs = [40, 70, 30, 20]
    p = pack_greedy(len(costs), lambda i, slot: costs[i], 100)
    assert p.kept == [0, 2, 3] and p.left_out == [1] and p.used == 90
    assert not p.complete and p.costs == {0: 40, 1: 70, 2: 30, 3: 20}


def test_slot_numbers_follow_what_was_kept():
    seen = []
    pack_greedy(3, lambda i, slot: seen.append((i, slot)) or (200 if i == 0 else 10), 100)
    assert seen == [(0, 1), (1, 1), (2, 2)]


def test_stops_when_the_room_left_is_too_small_and_all_or_nothing_mode():
    p = pack_greedy(3, lambda i, slot: 95 if i == 0 else 1, 100)
    assert p.kept == [0] and p.left_out == [1, 2] and p.costs == {0: 95}
    p = pack_greedy(3, lambda i, slot: 95 if i == 0 else 1, 100, min_room=0)
    assert p.kept == [0, 1, 2] and p.complete
    p = pack_greedy(3, lambda i, slot: 60, 100, min_room=0, stop_at_first_miss=True)
    assert p.kept == [0] and p.left_out == [1, 2] and not p.complete


def test_rejects_a_negative_budget():
    with pytest.raises(ValueError):
        pack_greedy(1, lambda i, slot: 1, -1)
