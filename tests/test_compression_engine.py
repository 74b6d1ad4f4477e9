"""Compression inside the engine, for every supported family, on tiny random models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FAMILIES, gemma3_engine, tiny_engine, tiny_model

from snapkv_rag.compression import H2O, RandomKeep, SnapKV, StreamingLLM
from snapkv_rag.compression.runtime import register_attention_functions
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.sampling import GenerationParams

LONG = "The quick brown fox jumps over the lazy dog. " * 6 + "Numbers like 1234 appear. What is the number?"
POLICIES = [
    SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3),
    StreamingLLM(sink_tokens=4, max_capacity_prompt=24),
    H2O(max_capacity_prompt=24, recent=8, query_chunk=16),
    RandomKeep(max_capacity_prompt=24, recent=8),
]


def prompt_ids(engine, text=LONG):
    return engine.tokenizer(text)["input_ids"]


def prefill(engine, ids, policy, steps=1):
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=steps + 1), policy, engine._pad_id)
    it = run.steps()
    tokens = [next(it) for _ in range(steps + 1)]
    return run, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_at_or_above_length_is_bit_identical(family, tokenizer):
    engine = tiny_engine(family, tokenizer)
    ids = prompt_ids(engine)
    full, _ = prefill(engine, ids, None)
    full_logits = full.last_logits.clone()
    for policy in (SnapKV(window_size=8, max_capacity_prompt=len(ids)), H2O(max_capacity_prompt=len(ids) + 5)):
        run, _ = prefill(engine, ids, policy)
        assert torch.equal(run.last_logits, full_logits)
        assert run.kept_tokens_per_layer == [len(ids)] * 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_compressed_cache_matches_reference_at_true_positions(family, policy, tokenizer):
    engine = tiny_engine(family, tokenizer)
    ids = prompt_ids(engine)
    n, budget = len(ids), policy.max_capacity_prompt
    assert n > budget
    run, tokens = prefill(engine, ids, policy, steps=1)
    kv_heads = engine.info().num_kv_heads
    # each layer holds exactly `budget` prompt entries (+1 decoded token) per KV head
    assert run.kept_tokens_per_layer == [budget] * 2
    for layer in run.cache.layers:
        assert layer.keys.shape == (1, kv_heads, budget + 1, 16)
    compressed_logits = run.last_logits

    # Reference: the full prefill's K/V gathered at the kept indices, next token at position n.
    from transformers import DynamicCache

    model = engine.model
    full_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=full_cache, use_cache=True, logits_to_keep=1)
        for layer_idx, layer in enumerate(full_cache.layers):
            index = run.session.kept_indices[layer_idx].unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)

        def next_logits(position: int) -> torch.Tensor:
            cache = DynamicCache(config=model.config)
            for src, dst in zip(full_cache.layers, range(len(full_cache.layers))):
                cache.update(src.keys.clone(), src.values.clone(), dst)
            out = model(input_ids=tokens[0][:, None], position_ids=torch.tensor([[position]]), cache=cache, use_cache=True)
            return out.logits[:, -1]

        reference = next_logits(n)
        wrong_position = next_logits(budget)
    torch.testing.assert_close(compressed_logits, reference, atol=1e-5, rtol=1e-5)
    # the check can fail: the positions the naive implementation would use give other logits
    assert not torch.allclose(wrong_position, reference, atol=1e-5, rtol=1e-5)


def test_each_layer_is_compressed_before_the_next_runs(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    ids = prompt_ids(engine)
    policy = SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3)
    run = DecodeRun(engine.model, [ids], GenerationParams(max_new_tokens=1), policy, engine._pad_id)
    seen: list[list[int]] = []

    def before_attention(module, args, kwargs):
        seen.append([layer.keys.shape[2] for layer in run.cache.layers[: module.layer_idx] if layer.keys is not None])

    hooks = [layer.self_attn.register_forward_pre_hook(before_attention, with_kwargs=True) for layer in engine.model.model.layers]
    try:
        next(run.steps())
    finally:
        for h in hooks:
            h.remove()
    assert seen == [[], [24]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_batch_with_compression_equals_single_runs(family, tokenizer):
    engine = tiny_engine(family, tokenizer)
    prompts = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]
    policy = "snapkv:budget=24,window=8,kernel=3"
    singles = [engine.generate(p, max_new_tokens=8, compression=policy, chat=False) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=8, compression=policy, chat=False)
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    assert batch[0].stats.kept_tokens_per_layer == [24, 24]


def test_stats_report_compression(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    result = engine.generate(LONG, max_new_tokens=3, compression=SnapKV(window_size=8, max_capacity_prompt=24), chat=False)
    stats = result.stats
    n = result.usage.prompt_tokens
    per_token = engine.info().kv_bytes_per_token
    assert stats.prompt_kv_bytes_full == n * per_token
    assert stats.prompt_kv_bytes_kept == 24 * per_token
    assert stats.compression_ratio == pytest.approx(n / 24)
    assert stats.compression_ratio_text == f"{n / 24:.1f}"
    slightly = dataclasses.replace(stats, prompt_kv_bytes_full=1064, prompt_kv_bytes_kept=1024)
    assert slightly.compression_ratio_text == "1.04"  # a few tokens evicted do not read as 1.0x
    assert stats.compression["method"] == "snapkv" and stats.compression["max_capacity_prompt"] == 24
    assert stats.compression["question_aware"] is True


def test_gemma3_sliding_layers_stay_uncompressed(tokenizer):
    engine = gemma3_engine(tokenizer)
    ids = prompt_ids(engine)
    run, _ = prefill(engine, ids, SnapKV(window_size=8, max_capacity_prompt=24))
    assert run.kept_tokens_per_layer == [len(ids), 24]


def test_registration_is_idempotent():
    register_attention_functions()
    register_attention_functions()
    model = tiny_model("llama", 400)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("policy", [None, SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3)], ids=["full", "snapkv"])
def test_teacher_forcing_matches_step_by_step_decoding(policy, tokenizer):
    engine = tiny_engine("llama", tokenizer)
    result = engine.generate(LONG, max_new_tokens=6, compression=policy, chat=False, ignore_eos=True)
    logits = engine.score(LONG, result.token_ids, compression=policy, chat=False)
    assert logits.shape == (6, len(tokenizer))
    assert logits.argmax(-1).tolist() == result.token_ids
    run, _ = prefill(engine, prompt_ids(engine), policy, steps=3)
    torch.testing.assert_close(logits[3], run.last_logits[0], atol=1e-4, rtol=1e-4)
