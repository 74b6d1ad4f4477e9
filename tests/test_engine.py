"""Engine behaviour on tiny random models: determinism, streaming, batching, usage, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import FAMILIES, tiny_engine

from snapkv_rag import (
    EmptyPromptError,
    InvalidCompressionError,
    InvalidGenerationParameterError,
    InvalidPromptError,
    ModelNotFoundError,
    PromptTooLongError,
)
from snapkv_rag.engine.prompts import render_prompt

PROMPTS = ["The quick brown fox", "Hello world, hello engine! Numbers like 1234", "Paris"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_deterministic_and_streaming_matches(family, tokenizer):
    engine = tiny_engine(family, tokenizer)
    first = engine.generate(PROMPTS[1], max_new_tokens=12)
    second = engine.generate(PROMPTS[1], max_new_tokens=12)
    assert first.token_ids == second.token_ids and first.text == second.text
    stream = engine.stream(PROMPTS[1], max_new_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == first.text == stream.result.text
    assert stream.result.token_ids == first.token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batch_rows_equal_single_runs(family, tokenizer):
    engine = tiny_engine(family, tokenizer)
    singles = [engine.generate(p, max_new_tokens=10) for p in PROMPTS]
    batch = engine.generate_batch(PROMPTS, max_new_tokens=10)
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    assert [r.usage.prompt_tokens for r in batch] == [r.usage.prompt_tokens for r in singles]
    assert batch[0].stats.batch_size == 3


def test_usage_and_stats(engine, tokenizer):
    result = engine.generate(PROMPTS[0], max_new_tokens=6)
    prompt_ids = render_prompt(tokenizer, PROMPTS[0])
    assert result.usage.prompt_tokens == len(prompt_ids)
    if result.finish_reason == "length":
        assert result.usage.completion_tokens == 6 == len(result.token_ids)
    else:  # ended on the EOS token, which counts as generated but carries no text
        assert result.usage.completion_tokens == len(result.token_ids) + 1 <= 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    stats = result.stats
    assert stats.prefill_seconds > 0
    assert stats.kept_tokens_per_layer == [len(prompt_ids)] * 2
    assert stats.prompt_kv_bytes_full == stats.prompt_kv_bytes_kept == len(prompt_ids) * 2 * 2 * 2 * 16 * 4
    assert stats.compression is None and stats.compression_ratio == 1.0
    assert stats.peak_memory_bytes > 0
    as_dict = result.to_dict()
    assert set(as_dict) == {"text", "finish_reason", "tool_calls", "parsed", "usage", "stats"}
    assert as_dict["tool_calls"] == [] and as_dict["parsed"] is None


def test_prompt_has_exactly_one_bos(tokenizer):
    ids = render_prompt(tokenizer, "hello")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    ids = render_prompt(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert ids.count(tokenizer.bos_token_id) == 1
    raw = render_prompt(tokenizer, "hello", chat=False)
    assert raw.count(tokenizer.bos_token_id) <= 1


def test_stop_string_truncates(engine):
    full = engine.generate(PROMPTS[1], max_new_tokens=16)
    if len(full.text) < 4:
        pytest.skip("random model produced too little text to pick a stop string")
    stop = full.text[2:4]
    cut = engine.generate(PROMPTS[1], max_new_tokens=16, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    streamed = "".join(engine.stream(PROMPTS[1], max_new_tokens=16, stop=stop))
    assert streamed == cut.text


def test_sampling_with_seed_is_reproducible(engine):
    a = engine.generate(PROMPTS[0], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = engine.generate(PROMPTS[0], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


def test_async_forms(engine):
    expected = engine.generate(PROMPTS[2], max_new_tokens=8)

    async def main():
        result = await engine.agenerate(PROMPTS[2], max_new_tokens=8)
        stream = engine.astream(PROMPTS[2], max_new_tokens=8)
        pieces = [p async for p in stream]
        return result, pieces, stream.result

    result, pieces, streamed = asyncio.run(main())
    assert result.token_ids == expected.token_ids
    assert "".join(pieces) == expected.text == streamed.text


def test_concurrent_callers_do_not_interfere(engine):
    expected = {p: engine.generate(p, max_new_tokens=8).token_ids for p in PROMPTS}
    got: dict[str, list[int]] = {}

    def call(p):
        got[p] = engine.generate(p, max_new_tokens=8).token_ids

    threads = [threading.Thread(target=call, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": 2.5},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"stop": [""]},
        {"stop": 5},
        {"seed": -1},
        {"max_tokens": 5},
        {"ignore_eos": "yes"},
    ],
)
def test_invalid_generation_parameters(engine, kwargs):
    with pytest.raises(InvalidGenerationParameterError):
        engine.generate(PROMPTS[0], **kwargs)


@pytest.mark.parametrize("prompt", ["", "   \n", [], [{"role": "user", "content": "  "}]])
def test_empty_prompt(engine, prompt):
    with pytest.raises(EmptyPromptError):
        engine.generate(prompt)


@pytest.mark.parametrize(
    "prompt",
    [b"bytes prompt", [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}], b"not-a-list", 42],
)
def test_malformed_prompt(engine, prompt):
    with pytest.raises(InvalidPromptError):
        engine.generate(prompt)


def test_prompt_too_long_names_both_numbers(engine):
    long_prompt = "hello world " * 400
    with pytest.raises(PromptTooLongError) as info:
        engine.generate(long_prompt, max_new_tokens=8)
    assert info.value.context_length == 512
    assert str(info.value.prompt_tokens) in str(info.value) and "512" in str(info.value)


def test_unknown_compression(engine):
    with pytest.raises(InvalidCompressionError):
        engine.generate(PROMPTS[0], compression="zip:budget=3")


@pytest.mark.parametrize("path", ["/no/such/model", "./missing-dir", "/tmp/x/y/z.gguf"])
def test_unknown_model_path(path):
    from snapkv_rag import Engine

    with pytest.raises(ModelNotFoundError):
        Engine.from_pretrained(path)


def test_engine_usable_after_error(engine):
    with pytest.raises(EmptyPromptError):
        engine.generate("")
    assert engine.generate(PROMPTS[0], max_new_tokens=3).usage.completion_tokens >= 1
