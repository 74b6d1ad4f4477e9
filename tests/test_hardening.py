"""Issue 7: defects found by trying the engine as a new user would, and mutation-killing tests.

Every test here failed on the code before its fix (see the commit messages).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
import torch
from conftest import FAMILIES, ForwardProbe, gemma3_engine, tiny_engine

from snapkv_rag import (
    InvalidDeviceError,
    InvalidGenerationParameterError,
    InvalidPromptError,
    PromptTooLongError,
    SnapKVRagError,
)
from snapkv_rag.compression import SnapKV
from snapkv_rag.engine.detokenize import SequenceText
from snapkv_rag.engine.sampling import GenerationParams, select_next_tokens

LONG = "The quick brown fox jumps over the lazy dog. " * 6 + "Numbers like 1234 appear. What is the number?"
SNAP = "snapkv:budget=24,window=8,kernel=3"


def in_thread(fn, timeout=30.0):
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) when it blocks."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # pragma: no cover - reported below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "call blocked: the engine lock is held by a paused stream"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ----------------------------------------------------------------- 1. streams and the lock
def test_paused_stream_does_not_block_other_calls(engine):
    stream = engine.stream("Hello world", max_new_tokens=20, ignore_eos=True)
    for _ in stream:
        break
    other = in_thread(lambda: engine.generate("Paris", max_new_tokens=3))
    assert other.usage.completion_tokens >= 1
    # the paused stream still finishes with the same tokens as an uninterrupted one
    rest = list(stream)
    assert stream.result.usage.completion_tokens == 20
    assert stream.result.token_ids == engine.generate("Hello world", max_new_tokens=20, ignore_eos=True).token_ids
    assert isinstance(rest, list)


def test_unread_and_abandoned_streams_do_not_block(engine):
    unread = engine.stream("Hello world", max_new_tokens=5)  # created, never read
    abandoned = engine.stream("The quick brown fox", max_new_tokens=20, ignore_eos=True)
    next(iter(abandoned))
    del abandoned  # dropped mid-way
    result = in_thread(lambda: engine.generate("Paris", max_new_tokens=3))
    assert result.usage.completion_tokens >= 1
    assert unread is not None


def test_close_gives_a_cancelled_usable_result(engine):
    # generation runs ahead of the reader: slow forwards keep it running when close() comes
    with ForwardProbe(engine.model, sleep_s=0.01):
        stream = engine.stream("Hello world", max_new_tokens=200, ignore_eos=True)
        first = next(iter(stream))
        stream.close()
    result = stream.result
    assert result.finish_reason == "cancelled"
    assert result.text.startswith(first) or first == ""
    assert 1 <= result.usage.completion_tokens < 200
    assert list(stream) == []  # exhausted after close
    in_thread(lambda: engine.generate("Paris", max_new_tokens=2))


def test_stream_as_context_manager(engine):
    with ForwardProbe(engine.model, sleep_s=0.01), engine.stream("Hello world", max_new_tokens=200, ignore_eos=True) as stream:
        for _ in stream:
            break
    assert stream.result.finish_reason == "cancelled"
    with engine.stream("Hello world", max_new_tokens=4, ignore_eos=True) as stream:
        text = "".join(stream)
    assert stream.result.finish_reason == "length" and stream.result.text == text


def test_cancelling_agenerate_stops_generation(tokenizer):
    engine = tiny_engine("llama", tokenizer)

    async def main(probe):
        task = asyncio.create_task(engine.agenerate("Hello world", max_new_tokens=400, ignore_eos=True))
        while probe.calls < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        calls_at_cancel = probe.calls
        await asyncio.sleep(0.3)
        return calls_at_cancel

    with ForwardProbe(engine.model, sleep_s=0.005) as probe:
        calls_at_cancel = asyncio.run(main(probe))
        settled = probe.calls
    assert settled == calls_at_cancel, "generation kept running after its task was cancelled"
    assert settled < 100


def test_engine_lock_serializes_model_calls(tokenizer):
    """Removing the engine's lock lets two forwards run at once; this catches it."""
    engine = tiny_engine("llama", tokenizer)
    with ForwardProbe(engine.model, sleep_s=0.01) as probe:
        threads = [threading.Thread(target=engine.generate, args=(p,), kwargs={"max_new_tokens": 4}) for p in ("a b", "c d", "e f")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert probe.calls >= 3 and probe.max_active == 1


def test_astream_validates_at_once(engine):
    with pytest.raises(InvalidPromptError):
        engine.astream(b"bytes")
    with pytest.raises(PromptTooLongError):
        engine.astream("hello world " * 400, max_new_tokens=8)
    with pytest.raises(SnapKVRagError):
        engine.astream("hi", compression="zip")


def test_astream_break_then_generate(engine):
    async def main():
        stream = engine.astream("Hello world", max_new_tokens=50, ignore_eos=True)
        async with stream:
            async for _ in stream:
                break
        assert stream.result.finish_reason == "cancelled"
        return await asyncio.wait_for(engine.agenerate("Paris", max_new_tokens=2), timeout=30)

    assert asyncio.run(main()).usage.completion_tokens >= 1


# ----------------------------------------------------------------- 2. sliding-window layers in padded batches
BATCH = [LONG, "Short prompt here.", LONG.replace("fox", "cat") + " Tell me."]


@pytest.mark.parametrize("family", [*FAMILIES, "gemma3"])
def test_padded_compressed_batch_equals_single_runs_every_family(family, tokenizer):
    engine = gemma3_engine(tokenizer) if family == "gemma3" else tiny_engine(family, tokenizer)
    singles = [engine.generate(p, max_new_tokens=8, compression=SNAP, chat=False, ignore_eos=True) for p in BATCH]
    batch = engine.generate_batch(BATCH, max_new_tokens=8, compression=SNAP, chat=False, ignore_eos=True, bucket=False)
    assert batch[0].stats.batch_size == 3 and batch[0].stats.prompt_tokens_padded > batch[1].usage.prompt_tokens
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]


# ----------------------------------------------------------------- 3. multi-byte stop strings
def feed(tokenizer, text, stop=()):
    seq = SequenceText(tokenizer, tuple(stop), frozenset())
    pieces = [seq.add(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return seq, pieces


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("答案是你好世界", "你好", "答案是"),
        ("done 🎉 party", "🎉", "done "),
        ("ok 完成🎉 more", "完成🎉", "ok "),
        ("café au lait", "é au", "caf"),
        ("Grüße aus Köln", "ße", "Grü"),
    ],
)
def test_non_ascii_stop_strings_never_leak(tokenizer, text, stop, expected):
    seq, pieces = feed(tokenizer, text, [stop])
    assert seq.finish_reason == "stop"
    assert "".join(pieces) == seq.text == expected
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_is_dropped_at_length_limit(tokenizer):
    ids = tokenizer("ab你", add_special_tokens=False)["input_ids"]
    seq = SequenceText(tokenizer, (), frozenset())
    pieces = [seq.add(t) for t in ids[:-1]]  # the last byte of 你 never arrives
    pieces.append(seq.finish_for_length())
    assert seq.text == "ab" == "".join(pieces)


def test_non_ascii_stop_string_through_the_engine(engine):
    base = engine.generate(LONG, max_new_tokens=24, chat=False, ignore_eos=True)
    # any stop string that never matches must leave the text whole and end on length
    cut = engine.generate(LONG, max_new_tokens=24, chat=False, ignore_eos=True, stop=["你好", "🎉"])
    assert cut.text == base.text.rstrip("\ufffd") and cut.finish_reason == "length"


# ----------------------------------------------------------------- 4. typed errors
@pytest.mark.parametrize(
    "kwargs", [{"dtype": "foo"}, {"device": "foo"}, {"device": "cuda:99"}, {"device": "mps" if not torch.backends.mps.is_available() else "cuda:99"}]
)
def test_bad_device_or_dtype_is_typed(kwargs, tmp_path):
    from snapkv_rag import Engine

    if kwargs.get("device", "").startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 99:
        pytest.skip("has 100 GPUs")
    with pytest.raises(InvalidDeviceError):
        Engine.from_pretrained("default", **kwargs)


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, -1.0]])
    for temperature in (1e-30, 1e-45, 5e-324):
        params = GenerationParams(temperature=temperature, seed=0)
        gen = torch.Generator().manual_seed(0)
        assert select_next_tokens(logits, params, gen).tolist() == [2, 0]


def test_top_p_is_applied():
    """Ignoring top_p must change what is sampled (mutation test)."""
    logits = torch.zeros(1, 50)
    logits[0, :5] = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    gen = torch.Generator().manual_seed(0)
    params = GenerationParams(temperature=1.0, top_p=0.2, seed=0)
    drawn = {int(select_next_tokens(logits, params, gen)) for _ in range(300)}
    # the mass of token 0 alone is < 0.2, tokens 0-1 reach it: only those two may be drawn
    probs = logits.softmax(-1)[0]
    assert probs[0] < 0.2 <= probs[:2].sum()
    assert drawn == {0, 1}


def test_top_p_in_the_engine_keeps_only_the_top_token(engine):
    greedy = engine.generate(LONG, max_new_tokens=10, chat=False, ignore_eos=True)
    for seed in range(3):
        sampled = engine.generate(LONG, max_new_tokens=10, chat=False, ignore_eos=True, temperature=5.0, top_p=1e-6, seed=seed)
        assert sampled.token_ids == greedy.token_ids


@pytest.mark.parametrize("continuation", [[], [10**6], [5, -1], [5, 10**6], [5, 2.5], "abc", [True]])
def test_score_rejects_bad_continuations(engine, continuation):
    with pytest.raises(InvalidPromptError):
        engine.score("Hello", continuation)


def test_score_accepts_a_tensor(engine):
    ids = engine.generate("Hello", max_new_tokens=3, ignore_eos=True).token_ids
    assert engine.score("Hello", torch.tensor(ids)).shape == (3, len(engine.tokenizer))


def test_context_check_is_exact(engine):
    """Loosening the context check (even by one token) is caught."""
    prompt = LONG * 5
    n = engine.count_tokens(prompt, chat=False)
    room = 512 - n
    assert 0 < room < 100
    with pytest.raises(PromptTooLongError):
        engine.generate(prompt, chat=False, max_new_tokens=room + 1)
    with pytest.raises(PromptTooLongError):
        engine.score(prompt, [5] * (room + 1), chat=False)
    assert engine.generate(prompt, chat=False, max_new_tokens=room, ignore_eos=True).usage.completion_tokens == room


# ----------------------------------------------------------------- 5. batches of different lengths
def test_batch_stats_are_per_row_and_never_count_padding(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    short, long_ = "Paris", LONG * 2
    results = engine.generate_batch([short, long_], max_new_tokens=3, compression=SNAP, chat=False, bucket=False)
    per_token = engine.info().kv_bytes_per_token
    s, long_result = results
    assert s.stats.batch_size == long_result.stats.batch_size == 2
    n_short, n_long = s.usage.prompt_tokens, long_result.usage.prompt_tokens
    assert n_short < 24 < n_long
    assert s.stats.kept_tokens_per_layer == [n_short, n_short]
    assert s.stats.prompt_kv_bytes_kept == s.stats.prompt_kv_bytes_full == n_short * per_token
    assert s.stats.compression_ratio == 1.0
    assert long_result.stats.kept_tokens_per_layer == [24, 24]
    assert long_result.stats.compression_ratio == pytest.approx(n_long / 24)
    # the whole batch's cache (padding slots included) is reported apart
    assert s.stats.batch_prompt_kv_bytes == long_result.stats.batch_prompt_kv_bytes == 2 * 24 * per_token


def test_batch_buckets_rows_by_length(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    prompts = ["Paris", LONG * 2, "Hello world", LONG * 2 + " Why?"]
    singles = [engine.generate(p, max_new_tokens=5, chat=False) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=5, chat=False)
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    sizes = [r.stats.batch_size for r in batch]
    assert sizes == [2, 2, 2, 2]
    # no row of a bucket carries more than a small share of padding
    for r in batch:
        assert r.stats.prompt_tokens_padded - r.usage.prompt_tokens <= max(16, 0.25 * r.stats.prompt_tokens_padded)
    assert engine.generate_batch(prompts, max_new_tokens=2, chat=False, max_batch_size=1)[0].stats.batch_size == 1


# ----------------------------------------------------------------- small things
def test_help_does_not_import_torch():
    code = "import sys; from snapkv_rag.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generation_stats_has_no_dead_fields():
    from dataclasses import fields

    from snapkv_rag import GenerationStats
    from snapkv_rag.compression.runtime import PrefillCompression

    assert "extra" not in {f.name for f in fields(GenerationStats)}
    assert not hasattr(PrefillCompression(SnapKV(), None, None, [False]), "kept_tokens")


def test_invalid_generation_parameter_still_typed(engine):
    with pytest.raises(InvalidGenerationParameterError):
        engine.astream("hi", top_p=0)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": 3}, "stop"),
        ({"seed": -2}, "seed"),
        ({"compression": "snapkv:budget=0"}, "compression"),
        ({"tools": [{"type": "web"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"recompute": 2, "reuse_segments": ["x"]}, "recompute"),
    ],
)
def test_bad_arguments_name_the_argument_at_fault(engine, kwargs, param):
    """Errors carry the argument as ``param`` (the server reports it), not only in the message."""
    from snapkv_rag.errors import SnapKVRagError

    with pytest.raises(SnapKVRagError) as info:
        engine.generate("Hello", max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)
    assert info.value.param == param
