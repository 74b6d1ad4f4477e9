"""Expected Attention: its scores against a reference computed by hand, its selection contract, and
the engine handing it the model's rotary angles and values."""

from __future__ import annotations

import math

import pytest
import torch

from snapkv_rag.compression import ExpectedAttention, parse_compression
from snapkv_rag.compression import expected_attention as expected_module
from snapkv_rag.compression.rotary import angles, angles_for_layer, rotary_angles
from snapkv_rag.errors import InvalidCompressionError

THETA = 100.0


def hand_angles(offsets: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotate-half RoPE over 4 dimensions (2 frequencies), as a model's rotary embedding gives it."""
    freqs = THETA ** (-torch.arange(0, 4, 2, dtype=torch.float32) / 4)
    phase = offsets.float()[:, None] * freqs[None]
    return torch.cat([phase.cos()] * 2, dim=-1), torch.cat([phase.sin()] * 2, dim=-1)


def rotation_matrix(offset: float) -> torch.Tensor:
    """The 4x4 matrix of :func:`hand_angles` at ``offset``: dimension i pairs with i + 2."""
    m = torch.zeros(4, 4)
    for i, f in enumerate(THETA ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)):
        c, s = math.cos(offset * f), math.sin(offset * f)
        m[i, i], m[i, i + 2], m[i + 2, i], m[i + 2, i + 2] = c, -s, s, c
    return m


def reference_scores(queries, keys, values, future: int, scale: float, rotate: bool) -> torch.Tensor:
    """Expected Attention written out one query head at a time with explicit matrices."""
    q_heads, w = queries.shape[1], queries.shape[2]
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    ahead = sum(rotation_matrix(j) for j in range(future)) / future
    out = torch.zeros(kv_heads, n)
    for h in range(q_heads):
        samples = torch.stack([(rotation_matrix(w - s) if rotate else torch.eye(4)) @ queries[0, h, s] for s in range(w)])
        mu0 = samples.mean(0)
        sigma0 = (samples - mu0).T @ (samples - mu0) / (w - 1)
        mu, sigma = (ahead @ mu0, ahead @ sigma0 @ ahead.T) if rotate else (mu0, sigma0)
        kv = h // group
        logits = torch.tensor([scale * float(mu @ k) + 0.5 * scale**2 * float(k @ sigma @ k) for k in keys[0, kv]])
        out[kv] += logits.softmax(0) / group
    return out * values[0].norm(dim=-1)


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(1, 4, 3, 4, generator=g)  # 4 query heads over 2 KV heads, a window of 3
    keys = torch.randn(1, 2, 12, 4, generator=g)
    values = torch.randn(1, 2, 12, 4, generator=g)
    return queries, keys, values


@pytest.mark.parametrize("rotate", [True, False])
def test_scores_match_the_closed_form_by_hand(tensors, rotate):
    queries, keys, values = tensors
    policy = ExpectedAttention(max_capacity_prompt=8, window_size=3, future=5, sink_tokens=0)
    if rotate:
        with rotary_angles(hand_angles), angles_for_layer(0):
            got = policy.scores(queries, keys, None, 0.5, values)
    else:
        got = policy.scores(queries, keys, None, 0.5, values)  # no model named: the queries stay in place
    torch.testing.assert_close(got[0], reference_scores(queries, keys, values, 5, 0.5, rotate), atol=1e-5, rtol=1e-4)


def test_the_angles_are_the_layers_being_compressed():
    seen = []
    with rotary_angles(lambda offsets, layer: seen.append(layer) or hand_angles(offsets, layer)):
        assert angles(torch.arange(2)) is None  # no layer named yet
        with angles_for_layer(7):
            assert angles(torch.arange(2)) is not None
    assert seen == [7]


def test_selection_keeps_sinks_and_window_and_the_best_expected(tensors):
    queries, keys, values = tensors
    policy = ExpectedAttention(max_capacity_prompt=7, window_size=3, future=5, sink_tokens=1, vnorm=0)
    kept = policy.select(queries, keys, None, scaling=0.5)
    assert kept.shape == (1, 2, 7)
    scores = policy.scores(queries, keys, None, 0.5)[..., 1:9]
    for head in range(2):
        best = (scores[0, head].topk(3).indices + 1).sort().values.tolist()
        assert kept[0, head].tolist() == [0, *best, 9, 10, 11]


def test_padding_is_never_kept_while_real_tokens_remain(tensors):
    queries, keys, values = tensors
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    kept = ExpectedAttention(max_capacity_prompt=6, window_size=3, sink_tokens=1).select(queries, keys, mask, scaling=0.5, values=values)
    assert 3 in kept[0, 0].tolist() and not set(kept[0].flatten().tolist()) & {0, 1, 2}  # the first real token is the sink


def test_spec_and_bad_settings():
    policy = parse_compression("expected:budget=256,window=16,future=128")
    assert (policy.max_capacity_prompt, policy.window_size, policy.future) == (256, 16, 128)
    assert parse_compression(policy.spec()) == policy
    assert parse_compression("expected:budget=256,rolling=512,kv_bits=8").kv_bits == 8
    with pytest.raises(InvalidCompressionError, match="must be smaller than budget"):
        parse_compression("expected:budget=64,window=64")
    with pytest.raises(InvalidCompressionError, match="covariance"):
        parse_compression("expected:covariance=2")


def test_the_engine_names_the_models_angles_and_values(monkeypatch):
    from snapkv_rag.testing import tiny_engine

    engine = tiny_engine()
    seen = []
    original = ExpectedAttention.scores

    def spying(self, queries, keys, mask, scaling, values=None):
        seen.append((angles(torch.arange(3)) is not None, values is not None))
        return original(self, queries, keys, mask, scaling, values)

    monkeypatch.setattr(expected_module.ExpectedAttention, "scores", spying)
    prompt = " ".join(f"w{i}" for i in range(150))
    result = engine.generate(prompt, compression="expected:budget=48,window=8", max_new_tokens=3, chat=False)
    assert seen and all(s == (True, True) for s in seen)
    assert max(result.stats.kept_tokens_per_layer) == 48


@pytest.mark.parametrize("options", ["rolling=64", "kv_bits=8", "decode_budget=40,decode_interval=2"])
def test_the_shared_options_compose(options):
    from snapkv_rag.testing import tiny_engine

    engine = tiny_engine()
    prompt = " ".join(f"w{i}" for i in range(200))
    result = engine.generate(prompt, compression=f"expected:budget=48,window=8,{options}", max_new_tokens=4, chat=False)
    assert result.usage.completion_tokens == 4 and max(result.stats.kept_tokens_per_layer) <= 48


def test_kvzip_scores_are_the_most_attention_any_repeat_query_gives(tensors):
    from snapkv_rag.compression import KVzip

    queries, keys, _ = tensors  # 3 repeat queries at the last 3 of 12 positions; the first 6 keys are the context
    got = KVzip(max_capacity_prompt=5, query_chunk=2).attention_from_repeat(queries, keys, 6, 0.5)
    want = torch.zeros(2, 6)
    for h in range(4):
        for s in range(3):
            seen = 12 - 3 + s + 1  # causal: query s sees keys 0..9+s
            weights = (0.5 * keys[0, h // 2, :seen] @ queries[0, h, s]).softmax(0)
            want[h // 2] = torch.maximum(want[h // 2], weights[:6])
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-5)
    kept = KVzip(max_capacity_prompt=4, sink_tokens=1).keep(got)
    for head in range(2):
        assert kept[0, head].tolist() == [0, *sorted((got[0, head, 1:].topk(3).indices + 1).tolist())]


def test_kvzip_asks_for_keep_context():
    from snapkv_rag.testing import tiny_engine

    with pytest.raises(InvalidCompressionError, match="keep_context"):
        tiny_engine().generate("a b c d", compression="kvzip:budget=64", max_new_tokens=2, chat=False)


@pytest.mark.parametrize("policy", [ExpectedAttention(max_capacity_prompt=19, window_size=3, sink_tokens=0, chunk_size=4), "kvzip"])
def test_spans_are_kept_whole(policy):
    from snapkv_rag.compression import KVzip

    g = torch.Generator().manual_seed(5)
    queries, keys = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 1, 35, 4, generator=g)
    if policy == "kvzip":
        kept = KVzip(max_capacity_prompt=16, sink_tokens=0, chunk_size=4).keep(torch.rand(1, 1, 32, generator=g))[0, 0].tolist()
    else:
        kept = policy.select(queries, keys, None, scaling=0.5)[0, 0].tolist()[:-3]  # the window's 3 last
    assert len(kept) == 16
    spans = {p // 4 for p in kept}  # spans counted back from position 32 start at multiples of 4
    assert len(spans) == 4 and all({4 * s + i for i in range(4)} <= set(kept) for s in spans)
