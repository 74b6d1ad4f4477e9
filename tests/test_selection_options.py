"""SnapKV's selection options (issue 30): span-aware keep (ChunkKV) and per-layer budgets (PyramidKV)."""

from __future__ import annotations

import pytest
import torch
from conftest import gemma3_engine, tiny_engine
from test_compression_engine import LONG, prefill, prompt_ids

from snapkv_rag.compression import SnapKV, parse_compression
from snapkv_rag.compression.snapkv import pyramid_budget, span_scores
from snapkv_rag.engine.results import kept_tokens_text
from snapkv_rag.errors import InvalidCompressionError


def random_qk(b=1, q_heads=4, kv_heads=2, window=8, n=96, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, q_heads, window, d, generator=g), torch.randn(b, kv_heads, n, d, generator=g)


# ------------------------------------------------------------------ span-aware keep


def test_span_scores_share_one_sum_per_span_counted_back_from_the_window():
    votes = torch.arange(10, dtype=torch.float32).reshape(1, 1, 10)  # positions 0..9, window starts at 10
    scores = span_scores(votes, 4)[0, 0].tolist()
    # spans from the end: [6..9], [2..5], then the short [0..1]
    assert scores == [1.0, 1.0, 14.0, 14.0, 14.0, 14.0, 30.0, 30.0, 30.0, 30.0]


def test_span_scores_do_not_depend_on_left_padding():
    votes = torch.rand(1, 2, 23)
    padded = torch.cat([torch.zeros(1, 2, 5), votes], dim=-1)
    assert torch.equal(span_scores(padded, 4)[..., 5:], span_scores(votes, 4))


@pytest.mark.parametrize("seed", range(3))
def test_chunked_snapkv_keeps_whole_spans(seed):
    span, window, budget = 4, 8, 40
    queries, keys = random_qk(seed=seed)
    n = keys.shape[2]
    kept = SnapKV(window_size=window, max_capacity_prompt=budget, kernel_size=1, chunk_size=span).select(queries, keys)
    assert kept.shape == (1, 2, budget)
    prefix = n - window
    for head in kept[0]:
        assert head[-window:].tolist() == list(range(prefix, n))  # the window is whole
        voted = head[:-window].tolist()
        spans: dict[int, int] = {}
        for position in voted:
            spans[(prefix - 1 - position) // span] = spans.get((prefix - 1 - position) // span, 0) + 1
        partial = [s for s, count in spans.items() if count < span]
        assert len(partial) <= 1  # (budget - window) / span = 8 whole spans: here none is cut
        assert len(voted) == budget - window


def test_chunked_snapkv_selects_the_same_tokens_under_left_padding():
    # (in a real batch, padding also changes later layers' inputs by rounding; span sums of a
    # random model's near-uniform votes then tie, so the exact check is made here)
    queries, keys = random_qk(seed=5)
    policy = SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=4)
    alone = policy.select(queries, keys)
    pad = 7
    padded_keys = torch.cat([torch.zeros(1, 2, pad, 16), keys], dim=2)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, keys.shape[2])], dim=1).long()
    assert torch.equal(policy.select(queries, padded_keys, mask) - pad, alone)


def test_chunked_snapkv_differs_from_token_level_and_chunk_one_is_the_paper():
    queries, keys = random_qk(seed=4)
    token = SnapKV(window_size=8, max_capacity_prompt=40).select(queries, keys)
    assert torch.equal(SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=1).select(queries, keys), token)
    assert not torch.equal(SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=8).select(queries, keys), token)


def test_spans_only_for_cuts_at_least_chunk_min_ratio_deep():
    queries, keys = random_qk(seed=6, n=96)
    token = SnapKV(window_size=8, max_capacity_prompt=40).select(queries, keys)
    spans = SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=8).select(queries, keys)
    assert not torch.equal(token, spans)
    shallow = SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=8, chunk_min_ratio=3)  # 96 < 3 x 40
    deep = SnapKV(window_size=8, max_capacity_prompt=40, chunk_size=8, chunk_min_ratio=2)  # 96 >= 2 x 40
    assert torch.equal(shallow.select(queries, keys), token)
    assert torch.equal(deep.select(queries, keys), spans)
    # a padded row decides by its real length: 96 real tokens behind 30 of padding are still < 3 x 40
    padded = torch.cat([torch.zeros(1, 2, 30, 16), keys], dim=2)
    mask = torch.cat([torch.zeros(1, 30), torch.ones(1, 96)], dim=1).long()
    assert torch.equal(shallow.select(queries, padded, mask) - 30, token)


# ------------------------------------------------------------------ per-layer budgets


@pytest.mark.parametrize("layers", [1, 2, 12, 30])
@pytest.mark.parametrize("budget,window", [(256, 32), (1024, 64), (40, 8)])
def test_pyramid_schedule_decreases_and_keeps_the_mean(layers, budget, window):
    budgets = [pyramid_budget(budget, window, 20, i, layers) for i in range(layers)]
    assert budgets == sorted(budgets, reverse=True)
    assert min(budgets) > window
    assert abs(sum(budgets) / layers - budget) <= 1
    if layers > 1:
        assert budgets[0] > budget > budgets[-1]


def test_default_options_leave_the_spec_as_it_was():
    assert SnapKV().spec() == "snapkv:window_size=32,max_capacity_prompt=1024,kernel_size=7,pooling=max,gqa_reduce=mean,min_window=8,max_window=64"
    assert "chunk_size=4" in SnapKV(chunk_size=4).spec() and "layer_budgets" not in SnapKV(chunk_size=4).spec()


def test_options_parse_and_round_trip():
    policy = parse_compression("snapkv:budget=64,window=8,chunk=4,chunk_from=2,layers=pyramid,beta=10")
    assert (policy.chunk_size, policy.chunk_min_ratio, policy.layer_budgets, policy.pyramid_beta) == (4, 2, "pyramid", 10)
    assert parse_compression(policy.spec()) == policy
    assert parse_compression(policy.spec() + ",decode_budget=48").for_decode().layer_budgets == "uniform"


@pytest.mark.parametrize("spec", ["snapkv:chunk=0", "snapkv:chunk=8,chunk_from=0", "snapkv:layers=triangle", "snapkv:layers=pyramid,beta=0"])
def test_bad_options_are_one_clear_error(spec):
    with pytest.raises(InvalidCompressionError):
        parse_compression(spec)


PYRAMID = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, layer_budgets="pyramid")


def test_pyramid_layers_hold_their_own_budgets_and_free_the_memory(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    expected = [pyramid_budget(24, 8, 20, i, 2) for i in range(2)]
    assert len(ids) > expected[0]
    run, _ = prefill(engine, ids, PYRAMID)
    assert run.kept_tokens_per_layer == expected
    assert [layer.keys.shape[2] for layer in run.cache.layers] == [k + 1 for k in expected]  # + the decoded token
    result = engine.generate(LONG, max_new_tokens=2, compression=PYRAMID, chat=False)
    per_layer = engine.info().kv_bytes_per_token // 2
    assert result.stats.kept_tokens_per_layer == expected
    assert result.stats.prompt_kv_bytes_kept == sum(expected) * per_layer
    assert kept_tokens_text(result.stats.kept_tokens_per_layer) == f"{min(expected)}-{max(expected)}"  # the server's log line, ask's summary
    assert engine.generate(LONG, max_new_tokens=2, compression="snapkv:budget=24,window=8", chat=False).stats.kept_tokens_per_layer == [24, 24]


def test_pyramid_logits_match_the_full_prefill_gathered_per_layer(tokenizer):
    from transformers import DynamicCache

    engine = tiny_engine("qwen3", tokenizer)
    ids = prompt_ids(engine)
    run, tokens = prefill(engine, ids, PYRAMID)
    model = engine.model
    full = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=full, use_cache=True, logits_to_keep=1)
        cache = DynamicCache(config=model.config)
        for layer_idx, layer in enumerate(full.layers):
            index = run.session.kept_indices[layer_idx].unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
            cache.update(layer.keys.gather(2, index), layer.values.gather(2, index), layer_idx)
        out = model(input_ids=tokens[0][:, None], position_ids=torch.tensor([[len(ids)]]), cache=cache, use_cache=True)
    torch.testing.assert_close(run.last_logits, out.logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "policy",
    [
        "snapkv:budget=24,window=8,kernel=3,layers=pyramid",
        "snapkv:budget=24,window=8,kernel=3,layers=pyramid,decode_budget=20,decode_interval=3",
    ],
)
def test_padded_batch_with_per_layer_budgets_equals_single_runs(policy, tokenizer):
    # layers of a padded batch hold different widths: each narrower layer must see the last
    # columns of the widest layer's mask, or the short prompt would attend to its padding
    engine = tiny_engine("llama", tokenizer)
    prompts = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]
    singles = [engine.generate(p, max_new_tokens=8, compression=policy, chat=False) for p in prompts]
    # one padded batch (bucket=False): the short prompt's padding reaches into the widest layer only
    batch = engine.generate_batch(prompts, max_new_tokens=8, compression=policy, chat=False, bucket=False)
    assert batch[0].stats.batch_size == 3
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    assert len(set(batch[0].stats.kept_tokens_per_layer)) == 2


def test_gemma3_pyramid_compresses_only_the_full_layer_at_the_mean_budget(tokenizer):
    engine = gemma3_engine(tokenizer)
    ids = prompt_ids(engine)
    run, _ = prefill(engine, ids, PYRAMID)
    assert run.kept_tokens_per_layer == [len(ids), 24]  # one compressed layer: its budget is the mean


def test_pyramid_needs_a_resolved_window():
    with pytest.raises(InvalidCompressionError, match="resolved"):
        SnapKV(window_size="question", max_capacity_prompt=256, layer_budgets="pyramid").for_layer(0, 4)


# ------------------------------------------------------------------ first layers whole

WHOLE = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, whole_layers=1)


def test_whole_first_layers_keep_the_prompt_and_the_rest_keep_their_budget(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    run, _ = prefill(engine, ids, WHOLE)
    assert run.kept_tokens_per_layer == [len(ids), 24]
    uniform, _ = prefill(engine, ids, SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3))
    # the compressed layer keeps what it keeps without the option (layer 0's K/V are the same)
    assert torch.equal(run.session.kept_indices[1], uniform.session.kept_indices[1])
    assert not torch.equal(run.last_logits, uniform.last_logits)
    assert prefill(engine, ids, SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, whole_layers=5))[0].kept_tokens_per_layer == [len(ids)] * 2


def test_padded_batch_with_whole_first_layers_equals_single_runs(tokenizer):
    engine = tiny_engine("qwen3", tokenizer)
    prompts = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]
    singles = [engine.generate(p, max_new_tokens=8, compression=WHOLE, chat=False) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=8, compression=WHOLE, chat=False, bucket=False)
    assert batch[0].stats.batch_size == 3
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]


def test_whole_layers_spec():
    policy = parse_compression("snapkv:budget=64,window=8,whole=2")
    assert policy.whole_layers == 2 and parse_compression(policy.spec()) == policy
    assert "whole_layers" not in SnapKV().spec()
    with pytest.raises(InvalidCompressionError):
        parse_compression("snapkv:whole=-1")
