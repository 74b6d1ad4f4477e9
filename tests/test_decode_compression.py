"""Decode-time compression (``decode_budget``/``decode_interval``) on the policy interface, on tiny models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FAMILIES, gemma3_engine, tiny_engine

from snapkv_rag.compression import H2O, RandomKeep, SnapKV, StreamingLLM, parse_compression
from snapkv_rag.compression.decoding import layer_entries
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.errors import InvalidCompressionError

LONG = "The quick brown fox jumps over the lazy dog. " * 6 + "Numbers like 1234 appear. What is the number?"
DECODING = [
    SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=32, decode_interval=16),
    StreamingLLM(sink_tokens=4, max_capacity_prompt=24, decode_budget=32, decode_interval=16),
    H2O(max_capacity_prompt=24, recent=8, query_chunk=16, decode_budget=32, decode_interval=16),
    RandomKeep(max_capacity_prompt=24, recent=8, decode_budget=32, decode_interval=16),
]


@pytest.fixture(scope="module")
def long_engine(tokenizer):
    return tiny_engine("llama", tokenizer, context=2048)


def run_tracking_entries(engine, ids, policy, steps):
    """Decode ``steps`` tokens; returns the run and the largest full-layer entry count after each step."""
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=steps), policy, engine._pad_id)
    largest = []
    for _ in run.steps():
        largest.append(max(layer_entries(layer) for layer in run.cache.layers))
    return run, largest


# ---------------------------------------------------------------------------- specs
def test_decode_settings_parse_round_trip_and_stay_out_of_plain_specs():
    policy = parse_compression("snapkv:budget=256,decode_budget=128,decode_interval=32")
    assert (policy.decode_budget, policy.decode_interval) == (128, 32)
    assert parse_compression(policy.spec()) == policy
    plain = parse_compression("snapkv:budget=256")
    assert "decode" not in plain.spec() and "decode_budget" not in plain.settings()
    less = parse_compression("less:base=snapkv,budget=64,decode_budget=96")
    assert less.decode_budget == 96 and "decode_budget=96" in less.spec()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:budget=256,window=32,decode_budget=32", r"decode_budget \(32\)"),
        ("snapkv:budget=256,window=question,decode_budget=64", "max_window"),
        ("streamingllm:budget=256,sinks=8,decode_budget=8", r"decode_budget \(8\)"),
        ("h2o:budget=256,recent=64,decode_budget=64", r"decode_budget \(64\)"),
        ("random:budget=256,decode_budget=0", "decode_budget must be an integer >= 1"),
        ("snapkv:budget=256,decode_budget=128,decode_interval=0", "decode_interval must be an integer >= 1"),
    ],
)
def test_impossible_decode_budgets_are_refused_with_the_reason(spec, message):
    with pytest.raises(InvalidCompressionError, match=message):
        parse_compression(spec)


def test_errors_name_settings_as_the_spec_wrote_them():
    with pytest.raises(InvalidCompressionError, match=r"^SnapKV: budget must be an integer >= 1, got 0$"):
        parse_compression("snapkv:budget=0")
    with pytest.raises(InvalidCompressionError, match="max_capacity_prompt must be"):
        parse_compression("snapkv:max_capacity_prompt=0")
    with pytest.raises(InvalidCompressionError, match=r"window \(32\) must be smaller than budget \(4\)"):
        parse_compression("snapkv:budget=4")
    with pytest.raises(InvalidCompressionError, match=r"settings: .*\bbudget\b.*\bwindow\b") as error:
        parse_compression("snapkv:bogus=3")
    assert "max_capacity_prompt" not in str(error.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:budget=64,budget=32", r"^snapkv: 'budget' is given twice; give each setting once$"),
        ("snapkv:budget=64,max_capacity_prompt=32", r"'budget' and 'max_capacity_prompt' name the same setting"),
        ("h2o:budget=64,capacity=32", r"'budget' and 'capacity' name the same setting"),
        ("less:base=snapkv,base=h2o,budget=64", r"LESS: 'base' is given twice"),
        ("less:base=snapkv,budget=64,budget=32", r"'budget' is given twice"),
    ],
)
def test_a_setting_given_twice_is_its_own_error(spec, message):
    with pytest.raises(InvalidCompressionError, match=message):
        parse_compression(spec)


# ---------------------------------------------------------------------------- bound
@pytest.mark.parametrize("policy", DECODING, ids=lambda p: p.name)
def test_a_1200_token_generation_keeps_the_cache_within_its_bound(long_engine, policy):
    ids = long_engine.tokenizer(LONG)["input_ids"]
    run, largest = run_tracking_entries(long_engine, ids, policy, 1200)
    bound = max(policy.max_capacity_prompt, policy.decode_budget) + policy.decode_interval
    assert len(largest) == 1200 and max(largest) <= bound
    # the cut really happens every interval: right after it the layer holds decode_budget entries
    assert policy.decode_budget in largest[policy.decode_interval :]
    stats = run.policy_stats()
    # the peak is measured inside the step (after its forward, before the cut): one more than a caller ever sees
    assert stats["decode_cache_entries_max"] == max(largest) + 1 <= bound
    assert stats["decode_compactions"] >= (1200 - policy.decode_interval) // policy.decode_interval - 1
    _, grown = run_tracking_entries(long_engine, ids, dataclasses.replace(policy, decode_budget=None, decode_interval=None), 200)
    assert max(grown) > 200  # without decode_budget the same run grows with every token


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_within_the_bound(family, tokenizer):
    engine = tiny_engine(family, tokenizer, context=1024)
    policy = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=32, decode_interval=8)
    result = engine.generate(LONG, max_new_tokens=120, ignore_eos=True, compression=policy, chat=False)
    stats = result.stats
    assert result.usage.completion_tokens == 120
    assert stats.policy_stats["decode_cache_entries_max"] <= 32 + 8
    assert stats.policy_stats["decode_compactions"] >= 10
    assert stats.kv_bytes_final <= (32 + 8) * engine.info().kv_bytes_per_token


# ---------------------------------------------------------------------------- exactness
def test_a_decode_cut_keeps_exactly_the_policy_entries_at_their_true_positions(tokenizer):
    """StreamingLLM's decode cut is known in advance: 4 sinks and the 12 latest entries. The
    logits after the cut must equal a forward over those entries of the uncut cache."""
    from transformers import DynamicCache

    engine = tiny_engine("llama", tokenizer)
    ids = engine.tokenizer(LONG)["input_ids"]
    n = len(ids)
    policy = StreamingLLM(sink_tokens=4, max_capacity_prompt=24, decode_budget=16, decode_interval=8)
    continuation = [int(t) for t in torch.randint(10, 200, (10,), generator=torch.Generator().manual_seed(0))]
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=10), policy, engine._pad_id)
    logits = run.teacher_force(continuation)
    assert run.policy_stats()["decode_compactions"] == 1  # after the 8th decode forward: 24 + 8 entries cut to 16

    # the same prefill without decode cuts, then the 8 decoded tokens: 32 entries per layer
    uncut = DecodeRun(
        engine.model, [ids], GenerationParams(max_new_tokens=9), dataclasses.replace(policy, decode_budget=None, decode_interval=None), engine._pad_id
    )
    uncut_logits = uncut.teacher_force(continuation[:9])
    torch.testing.assert_close(uncut_logits[:9], logits[:9])  # identical up to the cut
    kept = torch.tensor(list(range(4)) + list(range(32 - 12, 32)))
    with torch.inference_mode():
        cache = DynamicCache(config=engine.model.config)
        for layer_idx, layer in enumerate(uncut.cache.layers):
            assert layer.keys.shape[2] == 32
            cache.update(layer.keys[:, :, kept].clone(), layer.values[:, :, kept].clone(), layer_idx)

        def next_logits(position):
            copy = DynamicCache(config=engine.model.config)
            for layer_idx, layer in enumerate(cache.layers):
                copy.update(layer.keys.clone(), layer.values.clone(), layer_idx)
            out = engine.model(input_ids=torch.tensor([[continuation[8]]]), position_ids=torch.tensor([[position]]), cache=copy, use_cache=True)
            return out.logits[0, -1]

        reference, stale = next_logits(n + 8), next_logits(16)
    torch.testing.assert_close(logits[9], reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stale, reference, atol=1e-5, rtol=1e-5)  # the check can fail: positions matter


def test_a_budget_above_the_generation_changes_nothing(long_engine):
    ids = long_engine.tokenizer(LONG)["input_ids"]
    base = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3)
    roomy = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=500, decode_interval=16)
    a = long_engine.generate(LONG, max_new_tokens=60, ignore_eos=True, compression=base, chat=False)
    b = long_engine.generate(LONG, max_new_tokens=60, ignore_eos=True, compression=roomy, chat=False)
    assert a.token_ids == b.token_ids and b.stats.policy_stats["decode_compactions"] == 0
    tight = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=12, decode_interval=4)
    c = long_engine.generate(LONG, max_new_tokens=60, ignore_eos=True, compression=tight, chat=False)
    assert c.stats.policy_stats["decode_compactions"] > 0 and c.token_ids != a.token_ids  # cutting to 12 changes a random model's greedy path
    assert len(ids) > 24


@pytest.mark.parametrize("policy", DECODING[:2], ids=lambda p: p.name)
def test_a_padded_batch_with_decode_cuts_equals_single_runs(long_engine, policy):
    prompts = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]
    singles = [long_engine.generate(p, max_new_tokens=70, ignore_eos=True, compression=policy, chat=False) for p in prompts]
    batch = long_engine.generate_batch(prompts, max_new_tokens=70, ignore_eos=True, compression=policy, chat=False)
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    assert batch[0].stats.policy_stats["decode_compactions"] >= 3


def test_decode_cuts_compose_with_the_prefix_cache(long_engine):
    policy = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=32, decode_interval=8)
    history = LONG + " And then some more context about foxes and dogs follows here."
    first = long_engine.generate(history, max_new_tokens=50, ignore_eos=True, compression=policy, chat=False)
    again = long_engine.generate(history + " Next?", max_new_tokens=50, ignore_eos=True, compression=policy, chat=False)
    assert again.stats.reused_prompt_tokens > 0
    for result in (first, again):
        assert result.stats.policy_stats["decode_cache_entries_max"] <= 32 + 8


def test_gemma3_sliding_layers_are_left_whole_at_decode_time(tokenizer):
    engine = gemma3_engine(tokenizer, sliding_window=16, context=1024)
    policy = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3, decode_budget=20, decode_interval=8)
    ids = tokenizer(LONG)["input_ids"]
    run, _ = run_tracking_entries(engine, ids, policy, 100)
    assert layer_entries(run.cache.layers[1]) <= 20 + 8
    assert run.policy_stats()["decode_compactions"] > 0
    batch = engine.generate_batch([LONG, "Short prompt here."], max_new_tokens=40, ignore_eos=True, compression=policy, chat=False)
    singles = [engine.generate(p, max_new_tokens=40, ignore_eos=True, compression=policy, chat=False) for p in (LONG, "Short prompt here.")]
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]


def test_decode_errors_speak_of_what_the_user_set():
    with pytest.raises(InvalidCompressionError, match=r"decode_interval applies only together with decode_budget"):
        parse_compression("snapkv:budget=256,decode_interval=32")
    with pytest.raises(InvalidCompressionError) as info:
        parse_compression("snapkv:budget=256,decode_budget=16")
    message = str(info.value)
    assert "decode_budget (16)" in message and "max_capacity_prompt (16)" not in message and "raise decode_budget" in message
    assert parse_compression("snapkv:budget=256,decode_budget=128").decode_every == 64  # the default interval
