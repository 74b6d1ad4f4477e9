"""Per-head budgets (AdaKV, issue 30): the allocation, the ragged cache that really holds less, and the engine path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine
from test_compression_engine import LONG, prefill, prompt_ids

from snapkv_rag.compression import LESS, SnapKV, parse_compression, recording_kept_indices
from snapkv_rag.compression.base import keep_adaptive
from snapkv_rag.compression.ragged import RaggedHeadsLayer
from snapkv_rag.compression.runtime import decode_attention
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.engine.scheduler import SharedGroup
from snapkv_rag.errors import InvalidCompressionError

ADAPTIVE = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, head_budgets="adaptive")
UNIFORM = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3)


def skewed_scores(heads=3, prefix=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, heads, prefix, generator=g)
    scores[0, 0] *= 10  # head 0's votes are far more peaked: it should win most of the shared budget
    return scores


def test_adaptive_allocation_keeps_the_layer_total_the_window_and_the_floor():
    scores, n, capacity = skewed_scores(), 48, 24  # prefix 40, window 8, 16 voted entries per head on average
    kept = keep_adaptive(scores, n, capacity, floor=0.25)
    assert sum(len(k) for k in kept) == 3 * capacity
    for head in kept:
        assert head.tolist() == sorted(set(head.tolist()))
        assert head[-8:].tolist() == list(range(40, 48))
        assert len(head) - 8 >= 4  # floor: a quarter of the 16 voted entries of a uniform head
    lengths = [len(k) for k in kept]
    assert lengths[0] > capacity > min(lengths[1:])
    # the safeguard's entries are each head's own best
    for h in (1, 2):
        best = set(scores[0, h].argsort(descending=True)[:4].tolist())
        assert best <= set(kept[h].tolist())


def test_floor_one_is_uniform_top_k_and_floor_zero_is_one_global_top_k():
    scores, n, capacity = skewed_scores(seed=1), 48, 24
    uniform = keep_adaptive(scores, n, capacity, floor=1.0)
    for h, head in enumerate(uniform):
        top = scores[0, h].sort(descending=True, stable=True).indices[:16].sort().values
        assert head.tolist() == top.tolist() + list(range(40, 48))
    pooled = keep_adaptive(scores, n, capacity, floor=0.0)
    voted = {(h, p) for h, head in enumerate(pooled) for p in head[:-8].tolist()}
    threshold = sorted(scores.flatten().tolist(), reverse=True)[47]
    assert voted == {(h, p) for h in range(3) for p in range(40) if scores[0, h, p] >= threshold}


def test_short_prompts_keep_everything_in_every_head():
    kept = keep_adaptive(torch.rand(1, 2, 0), 20, 24, floor=0.2)
    assert [k.tolist() for k in kept] == [list(range(20))] * 2


def test_ragged_attention_equals_dense_attention_over_each_heads_own_entries():
    g = torch.Generator().manual_seed(3)
    lengths, dim, groups = [5, 11, 2], 8, 2
    keys = [torch.randn(n, dim, generator=g) for n in lengths]
    values = [torch.randn(n, dim, generator=g) for n in lengths]
    layer = RaggedHeadsLayer(keys, values)
    new_k, new_v = torch.randn(1, 3, 1, dim, generator=g), torch.randn(1, 3, 1, dim, generator=g)
    layer.update(new_k, new_v)
    assert layer.lengths == [6, 12, 3]
    query = torch.randn(1, 3 * groups, 1, dim, generator=g)
    # dense reference: heads padded to the longest, the padding masked out per query head
    width = max(layer.lengths)
    dense_k = torch.zeros(1, 3, width, dim)
    dense_v = torch.zeros(1, 3, width, dim)
    allowed = torch.zeros(1, 3 * groups, 1, width, dtype=torch.bool)
    for h, n in enumerate(layer.lengths):
        dense_k[0, h, :n], dense_v[0, h, :n] = layer.head_keys(h), layer.head_values(h)
        allowed[0, h * groups : (h + 1) * groups, 0, :n] = True
    expected, _ = decode_attention(None, query, dense_k, dense_v, allowed)
    torch.testing.assert_close(layer.attend(query, None), expected)
    assert layer.keys.numel() == sum(layer.lengths) * dim  # nothing padded is held


def run_with(engine, ids, policy, steps=4):
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=steps), policy, engine._pad_id)
    logits = [run.prefill()]
    generated = []
    for _ in range(steps - 1):
        token = logits[-1].argmax(-1)
        generated.append(int(token))
        logits.append(run.decode_step(token))
    return run, torch.stack(logits), generated


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_floor_one_decodes_exactly_like_uniform_snapkv(family, tokenizer):
    # every head then keeps the uniform policy's entries: the ragged layout and its attention
    # must give the dense cache's logits at every step (GQA: 4 query heads over 2 KV heads)
    engine = tiny_engine(family, tokenizer)
    ids = prompt_ids(engine)
    ragged_run, ragged, ragged_tokens = run_with(
        engine, ids, SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, head_budgets="adaptive", head_floor=1.0)
    )
    dense_run, dense, dense_tokens = run_with(engine, ids, UNIFORM)
    assert all(isinstance(layer, RaggedHeadsLayer) for layer in ragged_run.cache.layers)
    torch.testing.assert_close(ragged, dense, atol=1e-5, rtol=1e-5)
    assert ragged_tokens == dense_tokens


def test_teacher_forcing_through_ragged_heads_matches_step_by_step_decoding(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    _, stepped, tokens = run_with(engine, ids, ADAPTIVE, steps=5)
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=5), ADAPTIVE, engine._pad_id)
    forced = run.teacher_force([*tokens, 0])
    torch.testing.assert_close(forced, stepped[:, 0], atol=1e-5, rtol=1e-5)


def test_heads_hold_their_own_counts_and_the_memory_is_the_kept_entries(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    assert len(ids) > 2 * 24
    run, _ = prefill(engine, ids, ADAPTIVE)
    layers = run.cache.layers
    assert all(isinstance(layer, RaggedHeadsLayer) for layer in layers)
    assert all(sum(layer.lengths) == 2 * (24 + 1) for layer in layers)  # 2 KV heads x budget, + the decoded token
    assert any(len(set(layer.lengths)) > 1 for layer in layers)  # the random model's heads do not vote alike
    result = engine.generate(LONG, max_new_tokens=2, compression=ADAPTIVE, chat=False)
    uniform = engine.generate(LONG, max_new_tokens=2, compression=UNIFORM, chat=False)
    full = engine.generate(LONG, max_new_tokens=2, chat=False)
    assert result.stats.kept_tokens_per_layer == [24, 24]
    assert result.stats.prompt_kv_bytes_kept == uniform.stats.prompt_kv_bytes_kept < full.stats.prompt_kv_bytes_kept / 2
    assert result.stats.prompt_kv_bytes_kept == 2 * 24 * engine.info().kv_bytes_per_token // 2


def test_batches_run_row_by_row_and_equal_single_runs(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    prompts = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]
    singles = [engine.generate(p, max_new_tokens=6, compression=ADAPTIVE, chat=False) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=6, compression=ADAPTIVE, chat=False, bucket=False)
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    assert {r.stats.batch_size for r in batch} == {1}
    with pytest.raises(InvalidCompressionError, match="one prompt at a time"):
        DecodeRun(engine.model, [prompt_ids(engine), prompt_ids(engine)], GenerationParams(), ADAPTIVE, engine._pad_id)


def test_ragged_runs_never_join_a_shared_batch_and_record_what_each_head_kept(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    with recording_kept_indices() as kept:
        run, _ = prefill(engine, ids, ADAPTIVE)
    assert not SharedGroup.accepts(run)
    share = kept[-1].share()
    assert share.shape == (len(ids),)
    assert share.sum().item() == pytest.approx(24)  # entries kept per layer and head, on average
    assert share[-8:].tolist() == [1.0] * 8  # the window, in every head


def test_span_attention_is_not_recorded_under_ragged_heads(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    result = engine.generate(LONG, max_new_tokens=2, compression=ADAPTIVE, chat=False, attend_to=["quick brown fox"])
    assert result.span_attention is None
    assert "per-head budgets" in result.stats.span_attention


def test_spec_round_trips_and_bad_combinations_are_one_clear_error():
    policy = parse_compression("snapkv:budget=64,window=8,heads=adaptive,floor=0.5")
    assert (policy.head_budgets, policy.head_floor) == ("adaptive", 0.5)
    assert parse_compression(policy.spec()) == policy
    assert "head_budgets" not in SnapKV().spec()
    for spec in ("snapkv:heads=ragged", "snapkv:heads=adaptive,floor=1.5", "snapkv:heads=adaptive,floor=-1", "snapkv:heads=adaptive,decode_budget=512"):
        with pytest.raises(InvalidCompressionError):
            parse_compression(spec)
    with pytest.raises(InvalidCompressionError, match="LESS"):
        LESS(base=ADAPTIVE)
    with pytest.raises(InvalidCompressionError, match="select_heads"):
        ADAPTIVE.select(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 40, 16))


def test_layers_that_keep_everything_stay_dense_and_exact(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    roomy = SnapKV(window_size=8, max_capacity_prompt=len(ids) + 10, kernel_size=3, head_budgets="adaptive")
    run, logits, _ = run_with(engine, ids, roomy)
    _, full, _ = run_with(engine, ids, None)
    assert not any(isinstance(layer, RaggedHeadsLayer) for layer in run.cache.layers)
    assert torch.equal(logits, full)
    whole = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, head_budgets="adaptive", whole_layers=1)
    run, _ = prefill(engine, ids, whole)
    assert [isinstance(layer, RaggedHeadsLayer) for layer in run.cache.layers] == [False, True]
    assert run.kept_tokens_per_layer == [len(ids), 24]


def test_reported_bytes_include_the_rows_after_the_last_head():
    layer = RaggedHeadsLayer([torch.zeros(n, 8) for n in (3, 5)], [torch.zeros(n, 8) for n in (3, 5)])
    from snapkv_rag.engine.generation import cache_bytes

    class Cache:
        layers = [layer]

    assert cache_bytes(Cache()) == layer.held_bytes() == 2 * (8 + RaggedHeadsLayer.BUCKET) * 8 * 4
