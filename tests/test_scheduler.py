"""Continuous batching (snapkv_rag.engine.scheduler): requests join the running decode batch and leave
it when done; every answer equals the same request run alone (greedy, fp32 tiny models)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ForwardProbe, gemma3_engine, terse_bias, tiny_engine, tiny_tool_engine

from snapkv_rag.errors import InvalidGenerationParameterError

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Numbers like 1234 and 5678 appear in passkeys.",
    "Long documents need compressed caches; SnapKV keeps what the question looks at. " * 3,
    "Paris",
]
SNAP = "snapkv:budget=24,window=8,kernel=3"


def run_together(engine, calls, *, slow_s: float = 0.005):
    """Start every ``(prompt, kwargs)`` at once from its own thread; results in order, and the forward count.

    Forwards sleep ``slow_s`` so that requests are still running when the others arrive."""
    results: list = [None] * len(calls)
    errors: list = []
    barrier = threading.Barrier(len(calls))

    def worker(i, prompt, kwargs):
        barrier.wait()
        try:
            results[i] = engine.generate(prompt, **kwargs)
        except BaseException as exc:
            errors.append(exc)

    with ForwardProbe(engine.model, sleep_s=slow_s) as probe:
        threads = [threading.Thread(target=worker, args=(i, p, k)) for i, (p, k) in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    return results, probe


@pytest.fixture(scope="module")
def batch_engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=5)


def test_concurrent_requests_share_decode_steps_and_equal_lone_runs(batch_engine):
    calls = [(p, {"max_new_tokens": 24, "ignore_eos": True}) for p in PROMPTS[:4]]
    alone = [batch_engine.generate(p, **k) for p, k in calls]
    together, probe = run_together(batch_engine, calls)
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
        assert t.stats.decode_steps == a.stats.decode_steps == 23
    # 4 prefills + ~24 shared steps (joins stagger a little), against 4 + 4 * 23 run one by one
    assert probe.calls <= 4 + 23 + 8, probe.calls
    assert max(t.stats.decode_batch_rows_max for t in together) >= 3
    assert all(a.stats.decode_batch_rows_max == 1 for a in alone)


def test_mixed_policies_sampling_stops_and_lengths(batch_engine):
    calls = [
        (PROMPTS[0], {"max_new_tokens": 30, "ignore_eos": True}),
        (PROMPTS[3], {"max_new_tokens": 12, "compression": SNAP, "ignore_eos": True}),
        (PROMPTS[1], {"max_new_tokens": 20, "temperature": 0.9, "seed": 7, "ignore_eos": True}),
        (PROMPTS[2], {"max_new_tokens": 40, "compression": "streaming:budget=20,sinks=4", "ignore_eos": True}),
        (PROMPTS[4], {"max_new_tokens": 5}),
    ]
    alone = [batch_engine.generate(p, **k) for p, k in calls]
    # a stop string the lone run produces ends that request early, in the batch too
    stop_text = alone[0].text[len(alone[0].text) // 2 :][:3]
    calls.append((PROMPTS[0], {"max_new_tokens": 30, "ignore_eos": True, "stop": [stop_text]}))
    alone.append(batch_engine.generate(PROMPTS[0], **calls[-1][1]))
    together, _ = run_together(batch_engine, calls)
    for a, t in zip(alone, together):
        assert (t.token_ids, t.text, t.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert t.stats.kept_tokens_per_layer == a.stats.kept_tokens_per_layer
    assert together[-1].finish_reason == "stop" and len(together[-1].token_ids) < 30


def test_padded_batch_calls_join_single_requests(batch_engine):
    """generate_batch rows and single requests decode in one batch; each row equals its lone run."""
    prompts = PROMPTS[:3]
    alone = [batch_engine.generate(p, max_new_tokens=16, ignore_eos=True, compression=SNAP) for p in prompts]
    box: dict = {}

    def batch():
        box["batch"] = batch_engine.generate_batch(prompts, max_new_tokens=16, ignore_eos=True, compression=SNAP, bucket=False)

    with ForwardProbe(batch_engine.model, sleep_s=0.005):
        thread = threading.Thread(target=batch)
        thread.start()
        single = batch_engine.generate(PROMPTS[3], max_new_tokens=16, ignore_eos=True, compression=SNAP)
        thread.join(60)
    assert [r.token_ids for r in box["batch"]] == [a.token_ids for a in alone]
    assert single.token_ids == batch_engine.generate(PROMPTS[3], max_new_tokens=16, ignore_eos=True, compression=SNAP).token_ids


def test_tool_calls_and_json_rows_keep_their_own_grammar(smollm_tokenizer):
    engine = tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    calls = [
        ("Look it up.", {"max_new_tokens": 80, "tools": tools, "tool_choice": "required"}),
        ("Answer in JSON.", {"max_new_tokens": 80, "response_format": {"type": "json_object"}}),
        ("Say something.", {"max_new_tokens": 20, "ignore_eos": True}),
        ("Look it up, maybe.", {"max_new_tokens": 80, "tools": tools, "temperature": 1.0, "seed": 3}),
    ]
    alone = [engine.generate(p, **k) for p, k in calls]
    together, _ = run_together(engine, calls)
    assert together[0].tool_calls and together[0].tool_calls[0].name == "lookup"
    assert isinstance(together[1].parsed, dict)
    for a, t in zip(alone, together):
        calls_of = lambda r: [(c.name, c.arguments) for c in r.tool_calls]  # noqa: E731 (ids are random)
        assert (t.token_ids, t.finish_reason, calls_of(t), t.parsed) == (a.token_ids, a.finish_reason, calls_of(a), a.parsed)


def test_decode_state_policies_run_beside_the_shared_batch(batch_engine):
    """Decode-time cuts keep state per request: such a request decodes in its own group while others batch."""
    cut = "snapkv:budget=16,window=4,kernel=3,decode_budget=20,decode_interval=8"
    calls = [
        (PROMPTS[3], {"max_new_tokens": 40, "compression": cut, "ignore_eos": True}),
        (PROMPTS[0], {"max_new_tokens": 30, "ignore_eos": True}),
        (PROMPTS[1], {"max_new_tokens": 30, "ignore_eos": True}),
    ]
    alone = [batch_engine.generate(p, **k) for p, k in calls]
    together, _ = run_together(batch_engine, calls)
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
    assert together[0].stats.policy_stats["decode_compactions"] == alone[0].stats.policy_stats["decode_compactions"] > 0
    assert together[0].stats.decode_batch_rows_max == 1
    assert max(t.stats.decode_batch_rows_max for t in together[1:]) == 2


def test_sliding_window_model_requests_interleave_and_equal_lone_runs(tokenizer):
    engine = gemma3_engine(tokenizer, sliding_window=8, context=256)
    calls = [(p, {"max_new_tokens": 20, "ignore_eos": True, "compression": SNAP}) for p in PROMPTS[:3]]
    alone = [engine.generate(p, **k) for p, k in calls]
    together, _ = run_together(engine, calls)
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]


def test_cancelled_request_leaves_and_the_others_finish_unchanged(batch_engine):
    alone = [batch_engine.generate(p, max_new_tokens=30, ignore_eos=True) for p in PROMPTS[:2]]
    with ForwardProbe(batch_engine.model, sleep_s=0.005):
        streams = [batch_engine.stream(p, max_new_tokens=30, ignore_eos=True) for p in PROMPTS[:3]]
        next(iter(streams[2]))
        streams[2].close()
        for s in streams[:2]:
            for _ in s:
                pass
    assert streams[2].result.finish_reason == "cancelled" and streams[2].result.usage.completion_tokens < 30
    assert [s.result.token_ids for s in streams[:2]] == [a.token_ids for a in alone]


def test_max_batch_size_bounds_the_rows_decoded_together(tokenizer):
    engine = tiny_engine("llama", tokenizer, seed=5)
    engine.max_batch_size = 2
    calls = [(p, {"max_new_tokens": 12, "ignore_eos": True}) for p in PROMPTS]
    together, _ = run_together(engine, calls)
    assert all(r.usage.completion_tokens == 12 for r in together)
    assert max(r.stats.decode_batch_rows_max for r in together) == 2
    with pytest.raises(InvalidGenerationParameterError, match="max_batch_size"):
        engine.max_batch_size = 0


def test_a_failing_forward_ends_the_running_requests_with_the_error_and_the_engine_recovers(tokenizer):
    engine = tiny_engine("llama", tokenizer, seed=5)
    original = engine.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # a decode step, after the prefill
            raise RuntimeError("simulated out of memory")
        return original(*args, **kwargs)

    engine.model.forward = flaky
    try:
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            engine.generate("Hello world", max_new_tokens=10, ignore_eos=True)
    finally:
        del engine.model.forward
    assert engine.generate("Hello world", max_new_tokens=4, ignore_eos=True).usage.completion_tokens == 4
    assert engine.scheduler_stats().running_requests == 0


def test_async_streams_are_not_limited_by_the_default_thread_pool(batch_engine):
    """Twelve concurrent astreams (more than asyncio's default pool of cpu+4 threads here) all decode together."""

    async def main():
        async def one(prompt):
            stream = batch_engine.astream(prompt, max_new_tokens=16, ignore_eos=True)
            async for _ in stream:
                pass
            return stream.result

        return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(12)))

    with ForwardProbe(batch_engine.model, sleep_s=0.01):
        results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 16 for r in results)
    assert max(r.stats.decode_batch_rows_max for r in results) >= 9
    stats = batch_engine.scheduler_stats()
    assert stats.running_requests == 0 and stats.decoded_rows > stats.decode_steps


@pytest.mark.parametrize("compression", [SNAP, "snapkv:budget=24,window=20,kernel=3,decode_budget=30,decode_interval=4"])
def test_a_prompt_arriving_mid_stream_is_prefilled_in_chunks_between_decode_steps(batch_engine, compression):
    """Also with decode-time cuts whose window (20) outlasts their interval (4): the chunks must
    not reach the policy's decode state, or the first cut would vote with prompt queries."""
    long_prompt = PROMPTS[1] * 4
    options = {"ignore_eos": True, "prefix_cache": False}  # every prompt token runs through the model
    lone_stream = batch_engine.generate(PROMPTS[0], max_new_tokens=60, **options)
    lone_long = batch_engine.generate(long_prompt, max_new_tokens=8, compression=compression, **options)
    n = lone_long.usage.prompt_tokens
    assert n > 4 * 16
    widths: list[int] = []
    original = batch_engine.model.forward

    def recording(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        time.sleep(0.003)
        return original(*args, **kwargs)

    batch_engine.model.forward = recording
    batch_engine.prefill_chunk_tokens = 16
    box: dict = {}
    try:
        stream = batch_engine.stream(PROMPTS[0], max_new_tokens=60, **options)
        next(iter(stream))
        thread = threading.Thread(target=lambda: box.update(long=batch_engine.generate(long_prompt, max_new_tokens=8, compression=compression, **options)))
        thread.start()
        text = "".join(stream)
        thread.join(60)
    finally:
        del batch_engine.model.forward
        batch_engine.prefill_chunk_tokens = 512
    chunks = [i for i, w in enumerate(widths) if w > 1][1:]  # the first is the stream's own prefill
    assert sum(widths[i] for i in chunks) == n and all(widths[i] == 16 for i in chunks[:-1]) and widths[chunks[-1]] >= 8  # SNAP's window
    assert all(b - a == 2 for a, b in zip(chunks, chunks[1:])), widths  # one decode step between two chunks
    assert box["long"].token_ids == lone_long.token_ids
    assert box["long"].stats.kept_tokens_per_layer == lone_long.stats.kept_tokens_per_layer
    assert stream.result.token_ids == lone_stream.token_ids and text


def test_chunked_prefill_keeps_what_a_whole_prefill_keeps(batch_engine):
    """DecodeRun.prefill_steps: chunks then a compressed last chunk select the same entries and logits."""
    from snapkv_rag.compression import as_policy
    from snapkv_rag.engine.generation import DecodeRun
    from snapkv_rag.engine.sampling import GenerationParams

    row = batch_engine.tokenizer(PROMPTS[1] * 4)["input_ids"]
    for spec in (SNAP, "snapkv:budget=24,window=20,kernel=3", None):
        runs = []
        for chunk in (None, 16):
            run = DecodeRun(batch_engine.model, [row], GenerationParams(max_new_tokens=4), as_policy(spec), batch_engine._pad_id)
            steps = run.prefill_steps(chunk)
            chunks = 0
            with torch.inference_mode():
                while True:
                    try:
                        next(steps)
                        chunks += 1
                    except StopIteration as done:
                        runs.append((done.value, run, chunks))
                        break
        (whole, run_whole, none), (chunked, run_chunked, some) = runs
        assert none == 0 and some >= 3
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
        assert run_chunked.kept_tokens_per_layer == run_whole.kept_tokens_per_layer
        for a, b in zip(run_whole.cache.layers, run_chunked.cache.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)


def test_a_request_cancelled_before_its_prefill_does_no_model_work(batch_engine):
    import threading as _threading

    request = batch_engine._prepare_kwargs("Hello world", max_new_tokens=10)
    cancel = _threading.Event()
    cancel.set()
    with ForwardProbe(batch_engine.model) as probe:
        result = batch_engine._complete(request, cancel)
    assert result.finish_reason == "cancelled" and result.usage.completion_tokens == 0 and probe.calls == 0


def test_generate_inside_run_on_model_is_refused_not_a_deadlock(batch_engine):
    with pytest.raises(RuntimeError, match="run_on_model"):
        batch_engine.run_on_model(lambda: batch_engine.generate("Hello", max_new_tokens=2))
    assert batch_engine.generate("Hello", max_new_tokens=2).usage.completion_tokens == 2


def test_model_work_without_rows_does_not_wait_behind_a_prefill_waiting_for_room(tokenizer):
    engine = tiny_engine("llama", tokenizer, seed=5)
    engine.max_batch_size = 1
    with ForwardProbe(engine.model, sleep_s=0.01):
        running = engine.stream(PROMPTS[0], max_new_tokens=300, ignore_eos=True)
        next(iter(running))
        waiting = threading.Thread(target=engine.generate, args=(PROMPTS[1],), kwargs={"max_new_tokens": 2})
        waiting.start()
        time.sleep(0.1)  # the second prefill now waits for room
        start = time.perf_counter()
        engine.score("Hello world", [5, 6, 7])
        seconds = time.perf_counter() - start
        assert not running.finished
        running.close()
        waiting.join(30)
    assert seconds < 1.5, seconds  # the running stream still had about 3 s to go


def test_rows_of_very_different_widths_decode_in_separate_groups(batch_engine):
    long_prompt = PROMPTS[3] * 3
    calls = [
        (long_prompt, {"max_new_tokens": 20, "ignore_eos": True}),  # full cache: every prompt token
        (PROMPTS[1], {"max_new_tokens": 20, "ignore_eos": True, "compression": SNAP}),
        (PROMPTS[2], {"max_new_tokens": 20, "ignore_eos": True, "compression": SNAP}),
    ]
    alone = [batch_engine.generate(p, **k) for p, k in calls]
    assert alone[0].usage.prompt_tokens > 2 * 24 + 64
    together, _ = run_together(batch_engine, calls)
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert together[0].stats.decode_batch_rows_max == 1
    assert together[1].stats.decode_batch_rows_max == together[2].stats.decode_batch_rows_max == 2


def test_batching_settings_through_from_pretrained_and_their_checks(tmp_path, tokenizer):
    from snapkv_rag import Engine

    tiny_engine("llama", tokenizer).model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), max_batch_size=3, prefill_chunk_tokens=0)
    assert engine.max_batch_size == 3 and engine.prefill_chunk_tokens == 0
    assert Engine.from_pretrained(str(tmp_path)).prefill_chunk_tokens == 512  # the CPU default
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        Engine.from_pretrained(str(tmp_path), prefill_chunk_tokens=8)
    with pytest.raises(InvalidGenerationParameterError, match="max_batch_size"):
        Engine.from_pretrained(str(tmp_path), max_batch_size=True)


def test_the_worker_is_stopped_before_the_interpreter_exits(tmp_path):
    """A daemon worker still in torch at exit aborted the process now and then (status -6,
    "terminate called without an active exception"); an atexit hook stops it first."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from conftest import tiny_engine\n"
        "from snapkv_rag.engine import scheduler\n"
        "engine = tiny_engine()\n"
        "engine.generate('hello world', max_new_tokens=4)\n"
        "stream = engine.stream('hello world', max_new_tokens=400, ignore_eos=True)\n"
        "next(iter(stream))\n"  # leave with a generation running
        "assert engine._scheduler in set(scheduler._SCHEDULERS)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr
