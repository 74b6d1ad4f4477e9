"""The compiled decode step (snapkv_rag.engine.compiled_decode): greedy tokens identical to the eager
step on tiny fp32 models, for single requests, padded batches, rows joining and leaving, capacity
growth and packed weights; the number of compiled graphs stays bounded; whatever cannot run
compiled runs eager and says why."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from snapkv_rag.engine import compiled_decode, scheduler
from snapkv_rag.engine.engine import Engine
from snapkv_rag.model.packed_linear import pack_linear_weights, packing_available
from snapkv_rag.testing import tiny_config, tiny_model

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Long documents need compressed caches; SnapKV keeps what the question looks at. " * 3,
]
SNAP = "snapkv:budget=24,window=8,kernel=3"
GREEDY = {"max_new_tokens": 20, "ignore_eos": True}


def engines(family: str, tokenizer, *, packed: bool = False, seed: int = 3) -> tuple[Engine, Engine]:
    """An eager and a compiled engine over the same random weights."""
    pair = []
    for compiled in (False, True):
        model = tiny_model(family, len(tokenizer), seed=seed)
        if packed:
            pack_linear_weights(model)
        pair.append(Engine(model, tokenizer, name=f"tiny-{family}", compile_decode=compiled))
    return pair[0], pair[1]


def together(engine: Engine, calls: list[tuple[str, dict]]) -> list:
    """Every ``(prompt, kwargs)`` from its own thread at once: prefills queue up and the rows join
    the running batch one by one, and leave it at their own lengths."""
    results: list = [None] * len(calls)
    errors: list = []
    barrier = threading.Barrier(len(calls))

    def worker(i: int, prompt: str, kwargs: dict) -> None:
        barrier.wait()
        try:
            results[i] = engine.generate(prompt, **kwargs)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p, k)) for i, (p, k) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "phi3"])
def test_compiled_tokens_equal_eager_tokens_for_each_family(family, tokenizer):
    eager, compiled = engines(family, tokenizer)
    for compression in (None, SNAP):
        alone_e = eager.generate(PROMPTS[1], compression=compression, **GREEDY)
        alone_c = compiled.generate(PROMPTS[1], compression=compression, **GREEDY)
        assert alone_c.token_ids == alone_e.token_ids
        assert alone_c.stats.decode_step == "compiled"
        assert alone_e.stats.decode_step == "eager (compile_decode is off)"
        batch_e = eager.generate_batch(PROMPTS, compression=compression, **GREEDY)
        batch_c = compiled.generate_batch(PROMPTS, compression=compression, **GREEDY)
        assert [r.token_ids for r in batch_c] == [r.token_ids for r in batch_e]
        assert all(r.stats.decode_step == "compiled" for r in batch_c)
    stats = compiled.compiled_decode.stats()
    assert stats["why_not"] is None and 1 <= stats["graphs"] <= 3, stats
    assert compiled.info().compiled_decode == "on" and eager.info().compiled_decode == "compile_decode is off"


def test_rows_joining_and_leaving_and_capacity_growth_keep_the_tokens_and_bound_the_graphs(tokenizer, monkeypatch):
    # the buffers fill every few steps and are moved to larger ones
    monkeypatch.setattr(scheduler, "HEADROOM", 3)
    monkeypatch.setattr(compiled_decode, "COLUMN_ALIGN", 1)
    eager, compiled = engines("llama", tokenizer, seed=7)
    calls = [
        (PROMPTS[0], {"max_new_tokens": 30, "ignore_eos": True}),
        (PROMPTS[1], {"max_new_tokens": 12, "ignore_eos": True, "compression": SNAP}),
        (PROMPTS[2], {"max_new_tokens": 22, "ignore_eos": True, "compression": "snapkv:budget=40,window=8,kernel=3"}),
        (PROMPTS[2], {"max_new_tokens": 5, "ignore_eos": True}),
    ]
    alone = [eager.generate(p, **k) for p, k in calls]
    for _ in range(2):
        for a, t in zip(alone, together(compiled, calls)):
            assert t.token_ids == a.token_ids
            assert t.stats.decode_step == "compiled"
    single = compiled.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    assert single.token_ids == eager.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True).token_ids
    # a batch of one and a batch of several rows: two graphs, whatever the widths and capacities
    assert compiled.compiled_decode.graphs <= 3, compiled.compiled_decode.stats()
    assert compiled.compiled_decode.loads >= 20, compiled.compiled_decode.stats()  # joins, leaves and growth moved the buffers


@pytest.mark.skipif(not packing_available(torch.float32), reason="oneDNN cannot pack weights here")
def test_packed_and_fused_weights_compile_to_the_same_tokens(tokenizer):
    eager, compiled = engines("qwen2", tokenizer, packed=True, seed=11)  # qwen2: biases on the fused q/k/v
    calls = [(p, GREEDY) for p in PROMPTS]
    assert [r.token_ids for r in compiled.generate_batch([p for p, _ in calls], **GREEDY)] == [
        r.token_ids for r in eager.generate_batch([p for p, _ in calls], **GREEDY)
    ]
    assert compiled.compiled_decode.why_not is None and compiled.compiled_decode.steps > 0


def test_prompt_lookup_drafts_are_checked_by_the_compiled_step_with_the_eager_tokens(tokenizer):
    eager, compiled = engines("llama", tokenizer, seed=13)
    # a prompt that repeats itself, so drafts are found and some accepted
    for prompt, compression in ((PROMPTS[2], None), (PROMPTS[2] * 2, SNAP), (PROMPTS[1] * 3, None)):
        options = {"prompt_lookup_num_tokens": 4, "max_new_tokens": 40, "ignore_eos": True, "compression": compression}
        expected = eager.generate(prompt, **options)
        got = compiled.generate(prompt, **options)
        assert got.token_ids == expected.token_ids
        assert got.stats.drafts == expected.stats.drafts and got.stats.drafts["draft_forwards"] > 0
        assert got.stats.decode_step == "compiled"
    assert compiled.compiled_decode.graphs <= 3, compiled.compiled_decode.stats()


def test_what_cannot_run_compiled_runs_eager_and_says_why(tokenizer):
    eager, compiled = engines("llama", tokenizer, seed=5)
    cases = {
        "snapkv:budget=24,window=8,kernel=3,decode_budget=28,decode_interval=4": "eager (the policy keeps state while decoding",
        "snapkv:budget=24,window=8,kernel=3,kv_bits=8": "eager (kv_bits",
    }
    for compression, said in cases.items():
        expected = eager.generate(PROMPTS[2], compression=compression, **GREEDY)
        got = compiled.generate(PROMPTS[2], compression=compression, **GREEDY)
        assert got.token_ids == expected.token_ids
        assert got.stats.decode_step.startswith(said), got.stats.decode_step
    invariant = Engine(tiny_model("llama", len(tokenizer), seed=5), tokenizer, compile_decode=True, invariant=True)
    result = invariant.generate(PROMPTS[1], **GREEDY)
    assert result.stats.decode_step == "eager (the invariant mode decodes each request alone)"


def test_a_sliding_window_model_is_not_compiled(tokenizer):
    config = tiny_config("mistral", len(tokenizer))
    config.sliding_window = 8  # shorter than the prompts: the window changes the answer
    models = []
    for _ in range(2):
        torch.manual_seed(21)
        models.append(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval())
    eager, compiled = Engine(models[0], tokenizer), Engine(models[1], tokenizer, compile_decode=True)
    assert compiled.info().compiled_decode == "the model's sliding window is not compiled"
    result = compiled.generate(PROMPTS[2], **GREEDY)
    assert result.token_ids == eager.generate(PROMPTS[2], **GREEDY).token_ids
    assert result.stats.decode_step.startswith("eager (")


def test_no_compiler_and_a_failing_compile_fall_back_to_eager_with_the_reason(tokenizer, monkeypatch):
    eager, _ = engines("llama", tokenizer, seed=9)
    expected = eager.generate(PROMPTS[1], **GREEDY).token_ids
    monkeypatch.setattr(compiled_decode.shutil, "which", lambda name: None)
    no_compiler = Engine(tiny_model("llama", len(tokenizer), seed=9), tokenizer, compile_decode=True)
    assert "no C++ compiler" in no_compiler.info().compiled_decode
    result = no_compiler.generate(PROMPTS[1], **GREEDY)
    assert result.token_ids == expected and "no C++ compiler" in result.stats.decode_step
    monkeypatch.undo()

    failing = Engine(tiny_model("llama", len(tokenizer), seed=9), tokenizer, compile_decode=True)

    def broken(*args, **kwargs):
        raise RuntimeError("an operator Inductor cannot lower")

    monkeypatch.setattr(failing.compiled_decode, "_compiled", lambda: broken)
    result = failing.generate(PROMPTS[1], **GREEDY)
    assert result.token_ids == expected
    assert result.stats.decode_step.startswith("eager (compiling failed: RuntimeError: an operator Inductor cannot lower")
    assert failing.compiled_decode.stats()["why_not"].startswith("compiling failed")
