"""The invariant mode (issue 65): a greedy request's tokens are the same, bit for bit, whether its
prompt is computed cold or reused from the prefix cache (in part or whole), alone or in a batch of
mixed lengths, streamed or not, beside other requests, with or without prompt-lookup drafts, for
every policy, in bf16 and fp32. Each case also runs with the mode off, where some of them differ
in bf16 (the reason for the mode)."""

from __future__ import annotations

import threading

import pytest
import torch

from snapkv_rag.testing import tiny_engine

CHUNK = 32
DOC = " ".join(f"Record {i}: ferry {i * 7 % 97} left berth {i % 13} at {i % 24}:15 with {i * 3 % 50} passengers." for i in range(9))
QUESTIONS = ["\nWhich berth?", "\nHow many passengers on record 7?", "\nWhen did record 3 leave?", "\nName a ferry."]
SPECS = [
    None,
    "snapkv:budget=64,window=8",
    "snapkv:budget=48,window=question,max_window=16",
    "snapkv:budget=64,window=8,kv_bits=8",
    "snapkv:budget=64,window=8,decode_budget=80,decode_interval=8",
    "streaming:budget=40,sinks=4",
    "random:budget=64",
    "h2o:budget=48",
]


def engine_for(tokenizer, dtype, invariant=True, seed=2):
    engine = tiny_engine("llama", tokenizer, seed=seed)
    engine.model.to(dtype)
    engine.invariant, engine.invariant_chunk_tokens = invariant, CHUNK
    engine.prefix_cache.admission = "always"  # every prompt stored: reuse from the second read
    return engine


def greedy(engine, prompt, spec, **kwargs):
    return engine.generate(prompt, compression=spec, max_new_tokens=10, ignore_eos=True, chat=False, **kwargs)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def invariant_engine(request, tokenizer):
    return engine_for(tokenizer, request.param)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s or "full")
def test_cold_reused_batched_streamed_and_drafted_are_one_answer(invariant_engine, spec):
    engine = invariant_engine
    prompts = [DOC + q for q in QUESTIONS]
    engine.prefix_cache.clear()
    cold = [greedy(engine, p, spec, prefix_cache=False).token_ids for p in prompts]
    greedy(engine, DOC + "\nFirst?", spec)  # stores the document
    reused = [greedy(engine, p, spec) for p in prompts]
    if spec is None or not spec.startswith("h2o"):
        assert all(r.stats.reused_prompt_tokens > 0 for r in reused), [r.stats.reused_prompt_tokens for r in reused]
    assert [r.token_ids for r in reused] == cold
    batch = engine.generate_batch(prompts + ["Hi."], compression=spec, max_new_tokens=10, ignore_eos=True, chat=False, prefix_cache=False)
    assert [r.token_ids for r in batch[:-1]] == cold  # mixed lengths: a short row among long ones
    drafted = [greedy(engine, p, spec, prefix_cache=False, prompt_lookup_num_tokens=4) for p in prompts]
    assert [r.token_ids for r in drafted] == cold
    assert "invariant mode" in (drafted[0].stats.drafts or {}).get("draft_off", "")
    with engine.stream(prompts[0], compression=spec, max_new_tokens=10, ignore_eos=True, chat=False) as stream:
        "".join(str(piece) for piece in stream)
    assert stream.result.token_ids == cold[0]


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_any_share_of_the_prompt_reused_gives_the_cold_answer(tokenizer, share):
    engine = engine_for(tokenizer, torch.bfloat16)
    prompt = DOC + QUESTIONS[1]
    ids = engine.tokenizer(prompt)["input_ids"]
    cold = greedy(engine, prompt, "snapkv:budget=64,window=8", prefix_cache=False).token_ids
    engine.prefix_cache.clear()
    stored = engine.tokenizer.decode(ids[: int(share * len(ids))]) if share < 1 else prompt
    if stored:
        greedy(engine, stored, "snapkv:budget=64,window=8")
    again = greedy(engine, prompt, "snapkv:budget=64,window=8")
    assert again.token_ids == cold
    assert again.stats.reused_prompt_tokens % CHUNK == 0
    assert (again.stats.reused_prompt_tokens > 0) == (share > 0)
    assert again.stats.reused_prompt_tokens <= share * len(ids)


def test_arrival_order_and_neighbours_change_nothing(tokenizer):
    engine = engine_for(tokenizer, torch.bfloat16)
    prompts = [DOC + q for q in QUESTIONS]
    alone = [greedy(engine, p, "snapkv:budget=64,window=8", prefix_cache=False).token_ids for p in prompts]
    results: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        results[i] = greedy(engine, prompts[i], "snapkv:budget=64,window=8", prefix_cache=False).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in reversed(range(len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == alone


def test_the_mode_is_reported_and_off_by_default(tokenizer, monkeypatch):
    monkeypatch.delenv("SNAPKV_RAG_INVARIANT", raising=False)
    assert tiny_engine("llama", tokenizer).info().invariant is False
    monkeypatch.setenv("SNAPKV_RAG_INVARIANT", "1")
    assert tiny_engine("llama", tokenizer).info().invariant is True
    with pytest.raises(ValueError, match="invariant_chunk_tokens"):
        from snapkv_rag.engine.invariant import checked_invariant_chunk

        checked_invariant_chunk(8)


def test_without_the_mode_bf16_answers_move_with_reuse_and_batching(tokenizer):
    """What the mode is for: the same sweep with it off finds answers that differ (tiny random
    models have near-tied logits, so a few last bits decide tokens)."""
    moved = 0
    for seed in range(3):
        engine = engine_for(tokenizer, torch.bfloat16, invariant=False, seed=seed)
        prompts = [DOC + q for q in QUESTIONS]
        for spec in SPECS[:3]:
            engine.prefix_cache.clear()
            cold = [greedy(engine, p, spec, prefix_cache=False).token_ids for p in prompts]
            greedy(engine, DOC + "\nFirst?", spec)
            reused = [greedy(engine, p, spec).token_ids for p in prompts]
            batch = [r.token_ids for r in engine.generate_batch(prompts, compression=spec, max_new_tokens=10, ignore_eos=True, chat=False, prefix_cache=False)]
            moved += sum(a != b for a, b in zip(cold, reused)) + sum(a != b for a, b in zip(cold, batch))
    assert moved > 0


@pytest.fixture(scope="module")
def invariant_embedded():
    from snapkv_rag import Engine

    return Engine.default(invariant=True)


@pytest.mark.integration
def test_the_embedded_model_answers_the_issues_cases_alike(invariant_embedded):
    """The cases that moved in bf16 with the mode off: a generate then a stream of one prompt (the
    second reused the first's K/V), a batch against single calls, and a long document answered cold
    and through prefix reuse."""
    engine = invariant_embedded
    kwargs = dict(max_new_tokens=24)
    first = engine.generate("Name three colours.", **kwargs).token_ids
    with engine.stream("Name three colours.", **kwargs) as stream:
        "".join(str(piece) for piece in stream)
    assert stream.result.token_ids == first
    prompts = ["Name three colours.", "What is the capital of France?", "Write a haiku about the sea.", "Count to five."]
    singles = [engine.generate(p, prefix_cache=False, **kwargs).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_batch(prompts, prefix_cache=False, **kwargs)] == singles
    doc = " ".join(f"Harbour log, day {i}: the ferry left at {6 + i % 5}:{15 * (i % 4):02d} with {20 + 3 * i} passengers." for i in range(50))
    question = doc + "\n\nOn day 12, how many passengers did the ferry carry?"
    cold = engine.generate(question, compression="snapkv:budget=256,window=question", prefix_cache=False, **kwargs)
    engine.prefix_cache.clear()
    for tail in ("\n\nWhen did the ferry leave on day 3?", "\n\nWhich day had the most passengers?"):  # stored at the second read
        engine.generate(doc + tail, compression="snapkv:budget=256,window=question", max_new_tokens=2)
    again = engine.generate(question, compression="snapkv:budget=256,window=question", **kwargs)
    assert again.stats.reused_prompt_tokens >= 512 and again.token_ids == cold.token_ids


def test_the_server_and_the_cli_say_whether_the_mode_is_on(tokenizer):
    from starlette.testclient import TestClient

    from snapkv_rag.cli import build_parser
    from snapkv_rag.server import ServerConfig, create_app

    for mode in (False, True):
        engine = tiny_engine("llama", tokenizer)
        engine.invariant = mode
        with TestClient(create_app(ServerConfig(engine, model_id="tiny"))) as client:
            cards = client.get("/v1/models").json()["data"]
        assert cards[0]["snapkv"]["invariant"] == mode
        assert engine.info().to_dict()["invariant"] is mode
    assert build_parser().parse_args(["info", "--invariant"]).invariant is True
    assert build_parser().parse_args(["serve", "--no-invariant"]).invariant is False
    assert build_parser().parse_args(["eval", "speed"]).invariant is None  # the harness turns it on unless --no-invariant


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_every_family_answers_alike_cold_reused_and_batched(tokenizer, family):
    """The tiny model of each family in bf16 (the sliding-window ones are prefilled whole and never
    reuse, which is invariant too)."""
    engine = tiny_engine(family, tokenizer, seed=1)
    engine.model.to(torch.bfloat16)
    engine.invariant, engine.invariant_chunk_tokens = True, CHUNK
    engine.prefix_cache.admission = "always"
    prompts = [DOC + q for q in QUESTIONS[:3]]
    for spec in (None, "snapkv:budget=64,window=8"):
        engine.prefix_cache.clear()
        cold = [greedy(engine, p, spec, prefix_cache=False).token_ids for p in prompts]
        greedy(engine, DOC + "\nFirst?", spec)
        assert [greedy(engine, p, spec).token_ids for p in prompts] == cold, (family, spec)
        batch = engine.generate_batch(prompts, compression=spec, max_new_tokens=10, ignore_eos=True, chat=False, prefix_cache=False)
        assert [r.token_ids for r in batch] == cold, (family, spec)


def test_a_prefix_aligned_in_another_chunk_size_is_not_reused(tokenizer):
    """Chunks of another size are other forwards (other bytes in bf16): a stored prefix records the
    size it was aligned to, and only a prompt chunked alike reuses it."""
    engine = engine_for(tokenizer, torch.bfloat16)
    spec, prompt = "snapkv:budget=64,window=8", DOC + QUESTIONS[1]
    greedy(engine, DOC + "\nFirst?", spec)  # stored in 32-token chunks
    engine.invariant_chunk_tokens = 48
    cold = greedy(engine, prompt, spec, prefix_cache=False).token_ids
    again = greedy(engine, prompt, spec)
    assert again.stats.reused_prompt_tokens == 0 and again.token_ids == cold
    third = greedy(engine, prompt, spec)  # the prompt stored in 48-token chunks serves it now
    assert third.stats.reused_prompt_tokens > 0 and third.stats.reused_prompt_tokens % 48 == 0 and third.token_ids == cold


def test_an_entry_records_its_chunk_size_and_lookups_skip_other_sizes():
    from snapkv_rag.reuse.prefix_cache import PrefixCache, aligned_reuse

    cache = PrefixCache(1 << 20, admission="always")
    kv = [torch.zeros(1, 1, 200, 2)]
    cache.insert(list(range(200)), kv, kv, aligned=192, chunk=64)
    cache.insert([*range(100), *range(500, 600)], kv, kv, aligned=192, chunk=32)
    row = list(range(300))
    assert aligned_reuse(cache, row, "", end=288, chunk=64)[1] == 192
    assert aligned_reuse(cache, row, "", end=288, chunk=32)[1] == 96  # the other entry, of the same size
    assert aligned_reuse(cache, row, "", end=288, chunk=16) == (None, 0)
    cache.insert(list(range(250)), kv, kv)  # not aligned: nothing for the invariant mode
    assert cache.entries()[-1].chunk == 0 and aligned_reuse(cache, row, "", end=288, chunk=64)[1] == 0


def test_the_repeat_admission_stores_what_the_invariant_mode_would_reuse(tokenizer):
    """The "repeat" admission keeps a long compressed prompt's K/V when a prompt seen before shares
    enough of it to be reused; in bf16 that was half the prompt outside the mode, but the mode
    reuses (bit-exact) from a tenth, so it must store by its own rule."""
    engine = engine_for(tokenizer, torch.bfloat16)
    engine.prefix_cache.admission, engine.prefix_cache.first_sight_bytes = "repeat", 0  # every prompt counts as long
    spec, prompt = "snapkv:budget=64,window=8", DOC + QUESTIONS[1]
    ids = engine.tokenizer(prompt)["input_ids"]
    other = engine.tokenizer.decode(ids[:80]) + " " + " ".join(f"Note {i}: crane {i} lifted {i * 11 % 70} crates." for i in range(12))
    shared = 80 / len(engine.tokenizer(other)["input_ids"])
    assert 0.1 < shared < 0.5
    greedy(engine, prompt, spec)  # first sight: not stored
    assert len(engine.prefix_cache) == 0
    greedy(engine, other, spec)  # shares whole chunks with the prompt seen: stored
    assert len(engine.prefix_cache) == 1
    cold = greedy(engine, prompt, spec, prefix_cache=False).token_ids
    again = greedy(engine, prompt, spec)
    assert again.stats.reused_prompt_tokens >= CHUNK and again.token_ids == cold
