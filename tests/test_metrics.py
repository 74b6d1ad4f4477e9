"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from snapkv_rag.harness.metrics import (
    citation_prf,
    greedy_agreement,
    macro_f1,
    micro_prf,
    needle_exact_match,
    next_token_kl,
    parse_citations,
    relative_difference,
)


@pytest.mark.parametrize(
    "text,n_docs,valid,invalid",
    [
        ("Paris [2].", 5, [2], []),
        ("See [1][3] and again [1].", 5, [1, 3], []),
        ("Both [1, 3] and [4;2].", 5, [1, 3, 4, 2], []),
        ("Out of range [0] [6] [2]", 5, [2], [0, 6]),
        ("No citations here.", 5, [], []),
        ("[a] [1-3] [ 2 ] [x, 1]", 5, [2], []),
        ("nested [[3]]", 5, [3], []),
    ],
)
def test_parse_citations(text, n_docs, valid, invalid):
    assert parse_citations(text, n_docs) == (valid, invalid)


def test_citation_prf_hand_computed():
    assert citation_prf([1, 2], [2, 3]) == (0.5, 0.5, 0.5)
    p, r, f = citation_prf([1, 2, 3], [3])
    assert (p, r) == (pytest.approx(1 / 3), 1.0) and f == pytest.approx(0.5)
    assert citation_prf([], []) == (1.0, 1.0, 1.0)
    assert citation_prf([1], []) == (0.0, 0.0, 0.0)
    assert citation_prf([], [1]) == (0.0, 0.0, 0.0)
    assert citation_prf([4], [1]) == (0.0, 0.0, 0.0)


def test_macro_and_micro():
    pairs = [([1, 2], [2, 3]), ([], []), ([1], [1, 2, 3, 4])]
    # per-question F1: 0.5, 1.0, 0.4
    assert macro_f1(pairs) == pytest.approx((0.5 + 1.0 + 0.4) / 3)
    # micro: tp = 1 + 0 + 1 = 2, cited = 3, reference = 6 -> p=2/3, r=1/3, f1=4/9
    p, r, f = micro_prf(pairs)
    assert (p, r, f) == (pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(4 / 9))
    assert micro_prf([([], [])]) == (1.0, 1.0, 1.0)
    assert math.isnan(macro_f1([]))


def test_relative_difference():
    assert relative_difference(0.79, 0.8) == pytest.approx(-0.0125)
    assert math.isnan(relative_difference(0.5, 0.0))


def test_greedy_agreement():
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.5, 0.75)
    assert greedy_agreement([1, 2], [1, 2]) == (1.0, 1.0)
    assert greedy_agreement([1, 2, 3, 4], [1]) == (0.25, 0.25)
    assert greedy_agreement([], [5]) == (1.0, 1.0)


def test_next_token_kl():
    p = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    q = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    kl, top1 = next_token_kl(p, q)
    # step 0: identical -> 0; step 1: P=(.75,.25), Q=(.25,.75): KL = .75 ln3 + .25 ln(1/3) = .5 ln 3
    assert kl[0].item() == pytest.approx(0.0, abs=1e-7)
    assert kl[1].item() == pytest.approx(0.5 * math.log(3.0), rel=1e-5)
    assert top1.tolist() == [True, False]


def test_needle_exact_match():
    assert needle_exact_match("The pass key is 27611.", "27611")
    assert not needle_exact_match("The pass key is 2761.", "27611")
    assert not needle_exact_match("The pass key is 276110.", "27611")
    assert needle_exact_match("It is in Lyon", "Lyon")
