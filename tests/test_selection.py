"""The public selection contract, on hand-made tensors and as properties (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snapkv_rag.compression import H2O, FullCache, RandomKeep, SnapKV, StreamingLLM, parse_compression
from snapkv_rag.errors import InvalidCompressionError


def logit_keys(logits: list[float]) -> torch.Tensor:
    """Keys whose dot product with the query [1, 0] is exactly ``logits`` (scaling=1)."""
    keys = torch.zeros(1, 1, len(logits), 2)
    keys[0, 0, :, 0] = torch.tensor(logits)
    return keys


def unit_queries(window: int, heads: int = 1) -> torch.Tensor:
    q = torch.zeros(1, heads, window, 2)
    q[..., 0] = 1.0
    return q


def test_snapkv_keeps_the_most_attended_prefix_positions():
    # prefix logits rank positions 3 > 6 > everything else; the last 2 are the window
    logits = [0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0]
    policy = SnapKV(window_size=2, max_capacity_prompt=4, kernel_size=1)
    idx = policy.select(unit_queries(2), logit_keys(logits), scaling=1.0)
    assert idx.tolist() == [[[3, 6, 8, 9]]]


def test_snapkv_pooling_prefers_clusters():
    # One isolated strong position (6) vs a cluster (1,2,3) of moderate ones.
    logits = [0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 2.6, 0.0, 0.0, 0.0]
    keys = logit_keys(logits)
    no_pool = SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=1).select(unit_queries(2), keys, scaling=1.0)
    avg_pool = SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=3, pooling="avg").select(unit_queries(2), keys, scaling=1.0)
    assert no_pool.tolist() == [[[6, 8, 9]]]
    assert avg_pool.tolist() == [[[2, 8, 9]]]


def test_snapkv_window_is_causal():
    # The first window query (position 8) cannot see key 9; both see the prefix. A huge logit
    # on key 9 must not change the prefix ranking.
    base = [0.0, 4.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    spiked = base[:-1] + [50.0]
    policy = SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=1)
    assert policy.select(unit_queries(2), logit_keys(base), scaling=1.0).tolist() == [[[1, 8, 9]]]
    # With the spike, query 9 puts ~all its mass on key 9, so the prefix votes are those of
    # query 8 alone: a softmax over keys 0..8 (key 9 is in its future).
    votes = policy.votes(unit_queries(2), logit_keys(spiked), None, 1.0)
    expected = torch.tensor(base[:9]).softmax(-1)[:8]
    torch.testing.assert_close(votes[0, 0], expected, atol=1e-6, rtol=1e-5)


def test_snapkv_gqa_mean_vs_max():
    # 2 query heads share 1 KV head. Head 0 attends position 1 a bit more than position 2;
    # head 1 attends position 2 only. The best single head (max) picks 1, the group's
    # average (mean) picks 2: the two reductions must differ here.
    keys = torch.zeros(1, 1, 8, 2)
    keys[0, 0, 1] = torch.tensor([4.0, 0.0])
    keys[0, 0, 2] = torch.tensor([3.7, 2.0])
    q = torch.zeros(1, 2, 2, 2)
    q[0, 0, :, 0] = 1.0
    q[0, 1, :, 1] = 1.0
    by_max = SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=1, gqa_reduce="max").select(q, keys, scaling=1.0)
    by_mean = SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=1, gqa_reduce="mean").select(q, keys, scaling=1.0)
    assert by_max.tolist() == [[[1, 6, 7]]]
    assert by_mean.tolist() == [[[2, 6, 7]]]
    # the default is mean
    assert SnapKV(window_size=2, max_capacity_prompt=3, kernel_size=1).select(q, keys, scaling=1.0).tolist() == [[[2, 6, 7]]]
    # the cache keeps one score per KV head: output has 1 head, not 2
    assert by_mean.shape == (1, 1, 3)


def test_streamingllm_indices():
    keys = torch.randn(1, 2, 10, 4)
    idx = StreamingLLM(sink_tokens=2, max_capacity_prompt=6).select(None, keys)
    assert idx.tolist() == [[[0, 1, 6, 7, 8, 9], [0, 1, 6, 7, 8, 9]]]


def test_padding_is_never_kept_and_sinks_are_first_real_tokens():
    keys = torch.randn(2, 1, 10, 4)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # row 1: 3 pads then 7 real tokens
    idx = StreamingLLM(sink_tokens=2, max_capacity_prompt=6).select(None, keys, mask)
    assert idx[0, 0].tolist() == [0, 1, 6, 7, 8, 9]
    assert idx[1, 0].tolist() == [3, 4, 6, 7, 8, 9]


def test_short_rows_keep_everything_and_fill_with_earliest_padding():
    keys = torch.randn(2, 2, 12, 4)
    q = torch.randn(2, 4, 4, 4)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :8] = 0  # row 1 has only 4 real tokens, budget is 6
    idx = SnapKV(window_size=4, max_capacity_prompt=6, kernel_size=3).select(q, keys, mask)
    assert idx[1, 0].tolist() == idx[1, 1].tolist() == [0, 1, 8, 9, 10, 11]
    kept_mask = mask.gather(1, idx[:, 0])
    assert kept_mask[1].tolist() == [0, 0, 1, 1, 1, 1]
    assert kept_mask[0].tolist() == [1] * 6


def test_budget_at_or_above_length_keeps_everything():
    keys = torch.randn(1, 2, 8, 4)
    q = torch.randn(1, 2, 2, 4)
    for budget in (8, 9, 100):
        idx = SnapKV(window_size=2, max_capacity_prompt=budget).select(q, keys)
        assert idx[0, 0].tolist() == list(range(8))


def test_h2o_uses_accumulated_attention_in_chunks():
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 40, 8)
    q = torch.randn(1, 2, 40, 8)
    a = H2O(max_capacity_prompt=12, recent=4, query_chunk=7).select(q, keys)
    b = H2O(max_capacity_prompt=12, recent=4, query_chunk=64).select(q, keys)
    assert torch.equal(a, b)
    # reference: full causal attention matrix (fine at this size), mean over the group
    scores = torch.einsum("bhqd,bknd->bhqn", q, keys) / 8**0.5
    causal = torch.ones(40, 40).tril().bool()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1).sum(2).mean(1)
    expected = weights[0, :36].topk(8).indices.sort().values.tolist() + list(range(36, 40))
    assert a[0, 0].tolist() == expected


def test_random_keep_is_seeded():
    keys = torch.randn(1, 2, 50, 4)
    a = RandomKeep(max_capacity_prompt=10, seed=1, recent=3).select(None, keys)
    b = RandomKeep(max_capacity_prompt=10, seed=1, recent=3).select(None, keys)
    c = RandomKeep(max_capacity_prompt=10, seed=2, recent=3).select(None, keys)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a[0, 0, -3:].tolist() == [47, 48, 49]


@pytest.mark.parametrize(
    "factory",
    [
        lambda: SnapKV(window_size=32, max_capacity_prompt=32),
        lambda: SnapKV(window_size=64, max_capacity_prompt=32),
        lambda: SnapKV(kernel_size=4),
        lambda: SnapKV(kernel_size=0),
        lambda: SnapKV(pooling="median"),
        lambda: SnapKV(gqa_reduce="sum"),
        lambda: SnapKV(max_capacity_prompt=0),
        lambda: StreamingLLM(sink_tokens=8, max_capacity_prompt=8),
        lambda: H2O(max_capacity_prompt=8, recent=8),
        lambda: RandomKeep(max_capacity_prompt=4, recent=4),
    ],
)
def test_invalid_policies_raise(factory):
    with pytest.raises(InvalidCompressionError):
        factory()


def test_parse_compression_strings():
    p = parse_compression("snapkv:budget=512,window=16,kernel=5,pooling=avg")
    assert p == SnapKV(window_size=16, max_capacity_prompt=512, kernel_size=5, pooling="avg")
    assert parse_compression(p.spec()) == p
    assert parse_compression("streamingllm:budget=256,sinks=4") == StreamingLLM(4, 256)
    assert parse_compression("h2o:budget=128") == H2O(max_capacity_prompt=128)
    assert isinstance(parse_compression("full"), FullCache)
    for bad in ("", "zip", "snapkv:budget", "snapkv:colour=red", "snapkv:budget=abc"):
        with pytest.raises(InvalidCompressionError):
            parse_compression(bad)


@st.composite
def selection_case(draw):
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    n = draw(st.integers(1, 48))
    window = draw(st.integers(1, 8))
    budget = draw(st.integers(window + 1, 60))
    kernel = draw(st.sampled_from([1, 3, 5, 7]))
    pads = [draw(st.integers(0, n - 1)) for _ in range(batch)]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    pooling = draw(st.sampled_from(["max", "avg"]))
    seed = draw(st.integers(0, 2**16))
    return batch, kv_heads, group, n, window, budget, kernel, pads, dtype, pooling, seed


@settings(max_examples=150, deadline=None)
@given(selection_case())
def test_selection_properties(case):
    batch, kv_heads, group, n, window, budget, kernel, pads, dtype, pooling, seed = case
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, n, 8, generator=gen).to(dtype)
    w = min(window, n)
    queries = torch.randn(batch, kv_heads * group, w, 8, generator=gen).to(dtype)
    mask = torch.ones(batch, n, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    policy = SnapKV(window_size=window, max_capacity_prompt=budget, kernel_size=kernel, pooling=pooling)
    if n > budget and w != window:
        return
    idx = policy.select(queries, keys, mask)
    k = min(n, budget)
    assert idx.shape == (batch, kv_heads, k) and idx.dtype == torch.long
    assert (idx[..., 1:] > idx[..., :-1]).all(), "sorted, no duplicates"
    assert idx.min() >= 0 and idx.max() < n
    for b in range(batch):
        real = int(mask[b].sum())
        kept_real = mask[b][idx[b]].sum(dim=-1)  # [kv_heads]
        assert (kept_real == min(real, k)).all(), "budget spent on real tokens first"
        if n > budget:
            assert (idx[b, :, -window:] == torch.arange(n - window, n)).all(), "window always kept"
            fillers = idx[b, :, : k - min(real, k)]
            assert (fillers == fillers[0]).all(), "filler slots are identical across heads"
