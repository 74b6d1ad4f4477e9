"""Prefix cache (issue 10): reuse of stored uncompressed prompt K/V is exact for every policy.

Tolerance: next-token logits with reuse match a fresh prefill within 1e-4 (fp32 tiny models;
the reused K/V were computed in a different forward, so matmul shapes and summation order
differ); kept indices and greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression import H2O, RandomKeep, SnapKV, StreamingLLM
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.preparation import resolve_policy
from snapkv_rag.engine.prompts import render_prompt
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.reuse.prefix_cache import PrefixCache, reusable_tokens

DOC = "The quick brown fox jumps over the lazy dog. Numbers like 1234 appear. " * 4
POLICIES = {
    "full": None,
    "snapkv": SnapKV(window_size=8, max_capacity_prompt=24, kernel_size=3),
    "snapkv-question": SnapKV(window_size="question", max_capacity_prompt=40, min_window=4, max_window=16),
    "streamingllm": StreamingLLM(sink_tokens=4, max_capacity_prompt=24),
    "random": RandomKeep(max_capacity_prompt=24, recent=8),
    "h2o": H2O(max_capacity_prompt=24, recent=8, query_chunk=16),
}
ATOL = 1e-4


@pytest.fixture(autouse=True)
def any_prefix_share(monkeypatch):
    """These tests check that reuse is exact for a prefix of any length; the share below
    which reuse is skipped as a slowdown (MIN_REUSE_SHARE) has its own test."""
    monkeypatch.setattr("snapkv_rag.reuse.prefix_cache.MIN_REUSE_SHARE", 0.0)
    monkeypatch.setattr("snapkv_rag.reuse.prefix_cache.MIN_REUSE_SHARE_LOW_PRECISION", 0.0)


@pytest.fixture(scope="module")
def eng(tokenizer):
    """Reuse's mechanics, so every prompt is stored ("always"); the default admission has its own tests."""
    engine = tiny_engine("llama", tokenizer)
    engine.prefix_cache.admission = "always"
    return engine


def ids(engine, text):
    return engine.tokenizer(text)["input_ids"]


def resolve(engine, policy, text):
    if policy is not None and policy.needs_question_span:
        return resolve_policy(engine, policy, [text], False, [None])[0]
    return policy


def prefill(engine, text, policy, cache):
    run = DecodeRun(engine.model, [ids(engine, text)], GenerationParams(max_new_tokens=2), resolve(engine, policy, text), engine._pad_id, prefix_cache=cache)
    next(run.steps())
    return run


def assert_same_prefill(reused: DecodeRun, fresh: DecodeRun):
    torch.testing.assert_close(reused.last_logits, fresh.last_logits, atol=ATOL, rtol=ATOL)
    assert reused.kept_tokens_per_layer == fresh.kept_tokens_per_layer
    if fresh.session is not None:
        for layer, indices in fresh.session.kept_indices.items():
            assert torch.equal(reused.session.kept_indices[layer], indices), f"layer {layer}"


@pytest.mark.parametrize("name", list(POLICIES))
def test_reuse_equals_fresh_prefill(eng, name):
    policy = POLICIES[name]
    cache = PrefixCache(1 << 30, admission="always")
    first = DOC + "\n\nWhat number appears in the text?"
    second = DOC + "\n\nWhich animal is lazy?"
    prefill(eng, first, policy, cache)
    reused = prefill(eng, second, policy, cache)
    fresh = prefill(eng, second, policy, None)
    assert_same_prefill(reused, fresh)
    n_common = next(i for i, (a, b) in enumerate(zip(ids(eng, first), ids(eng, second))) if a != b)
    if name == "h2o":
        assert reused.reused_tokens == [0]  # needs every prompt query: never reuses
    else:
        assert reused.reused_tokens[0] == reusable_tokens(n_common, len(ids(eng, second)), resolve(eng, policy, second)) > 0
    # greedy generations through the engine are identical with and without reuse
    eng.prefix_cache.clear()
    eng.generate(first, chat=False, compression=policy, max_new_tokens=2)
    with_reuse = eng.generate(second, chat=False, compression=policy, max_new_tokens=10, ignore_eos=True)
    without = eng.generate(second, chat=False, compression=policy, max_new_tokens=10, ignore_eos=True, prefix_cache=False)
    assert with_reuse.token_ids == without.token_ids
    assert with_reuse.stats.reused_prompt_tokens == reused.reused_tokens[0]
    assert with_reuse.stats.prefilled_prompt_tokens == with_reuse.usage.prompt_tokens - reused.reused_tokens[0]
    assert without.stats.reused_prompt_tokens == 0


def test_window_tail_is_always_recomputed(eng):
    """The stored prompt covers the whole new prompt: its window's queries are recomputed."""
    policy = POLICIES["snapkv"]
    cache = PrefixCache(1 << 30, admission="always")
    text = DOC + "\n\nWhat number appears?"
    prefill(eng, text, policy, cache)
    again = prefill(eng, text, policy, cache)
    fresh = prefill(eng, text, policy, None)
    assert again.reused_tokens == [len(ids(eng, text)) - 8]  # all but the window
    assert_same_prefill(again, fresh)
    # full cache: all but the last token (its logits are needed)
    prefill(eng, text, None, cache)
    full = prefill(eng, text, None, cache)
    assert full.reused_tokens == [len(ids(eng, text)) - 1]
    assert_same_prefill(full, prefill(eng, text, None, None))


def test_prefix_ending_at_an_odd_token(eng):
    """Reuse is token-exact, not rounded to blocks: a stored prompt of 37 tokens gives 37."""
    cache = PrefixCache(1 << 30, admission="always")
    base = ids(eng, DOC)
    stored = base[:37]
    run = DecodeRun(eng.model, [stored], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)
    next(run.steps())
    policy = POLICIES["snapkv"]
    run = DecodeRun(eng.model, [base], GenerationParams(max_new_tokens=1), policy, eng._pad_id, prefix_cache=cache)
    next(run.steps())
    assert run.reused_tokens == [37]
    fresh = DecodeRun(eng.model, [base], GenerationParams(max_new_tokens=1), policy, eng._pad_id, None)
    next(fresh.steps())
    assert_same_prefill(run, fresh)


def test_divergence_at_the_first_token_reuses_nothing(eng):
    cache = PrefixCache(1 << 30, admission="always")
    a, b = ids(eng, "Alpha " + DOC), ids(eng, "Numbers " + DOC)
    assert a[0] != b[0]
    DecodeRun(eng.model, [a], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)._prefill()
    run = DecodeRun(eng.model, [b], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)
    run._prefill()
    assert run.reused_tokens == [0]
    assert len(cache) == 2


@pytest.mark.parametrize("name", ["full", "snapkv", "streamingllm", "snapkv-question"])
def test_batched_and_padded_reuse(eng, name):
    """Rows reuse different amounts (one nothing) in one padded batch; each equals its fresh run."""
    policy = POLICIES[name]
    eng.prefix_cache.clear()
    eng.generate(DOC + "\n\nWhat number appears in the text?", chat=False, compression=policy, max_new_tokens=1)
    eng.generate("Short unrelated prompt about Paris.", chat=False, compression=policy, max_new_tokens=1)
    prompts = [
        DOC + "\n\nWhich animal is lazy?",
        "Hello world, hello engine!",
        DOC[:90] + " and then something else entirely, a longer tail?",
        "Short unrelated prompt about Paris. And more?",
    ]
    batch = eng.generate_batch(prompts, chat=False, compression=policy, max_new_tokens=8, ignore_eos=True, bucket=False)
    reused = [r.stats.reused_prompt_tokens for r in batch]
    # every reusing row prefills the same T = max new tokens, so rows stay contiguous
    new = [r.usage.prompt_tokens - u for r, u in zip(batch, reused)]
    assert reused[0] > reused[2] > 0 and reused[1] == 0
    assert len({t for t, u in zip(new, reused) if u}) == 1 and max(new) == new[2]
    fresh = [eng.generate(p, chat=False, compression=policy, max_new_tokens=8, ignore_eos=True, prefix_cache=False) for p in prompts]
    assert [r.token_ids for r in batch] == [r.token_ids for r in fresh]
    for r, f in zip(batch, fresh):
        assert r.stats.kept_tokens_per_layer == f.stats.kept_tokens_per_layer
        assert r.stats.prompt_kv_bytes_kept == f.stats.prompt_kv_bytes_kept


def test_batched_reuse_logits_match(eng):
    policy = POLICIES["snapkv"]
    cache = PrefixCache(1 << 30, admission="always")
    prefill(eng, DOC + "\n\nWhat number appears in the text?", policy, cache)
    rows = [ids(eng, DOC + "\n\nWhich animal is lazy?"), ids(eng, "Hello world, hello engine! Numbers like 1234")]
    run = DecodeRun(eng.model, rows, GenerationParams(max_new_tokens=1), policy, eng._pad_id, prefix_cache=cache)
    next(run.steps())
    assert run.reused_tokens[0] > 0 and run.reused_tokens[1] == 0
    for i, row in enumerate(rows):
        fresh = DecodeRun(eng.model, [row], GenerationParams(max_new_tokens=1), policy, eng._pad_id, None)
        next(fresh.steps())
        torch.testing.assert_close(run.last_logits[i : i + 1], fresh.last_logits, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", ["full", "snapkv", "h2o"])
def test_score_with_reuse(eng, name):
    policy = POLICIES[name]
    eng.prefix_cache.clear()
    eng.generate(DOC + "\n\nWhat number appears in the text?", chat=False, compression=policy, max_new_tokens=1)
    continuation = eng.generate(DOC + "\n\nWhich animal?", chat=False, max_new_tokens=5, ignore_eos=True, prefix_cache=False).token_ids
    reused = eng.score(DOC + "\n\nWhich animal?", continuation, chat=False, compression=policy)
    fresh = eng.score(DOC + "\n\nWhich animal?", continuation, chat=False, compression=policy, prefix_cache=False)
    torch.testing.assert_close(reused, fresh, atol=ATOL, rtol=ATOL)


def test_lru_honours_the_byte_bound(eng):
    per_token = eng.info().kv_bytes_per_token
    texts = [f"{word} prompt: " + DOC[: 60 + 10 * i] for i, word in enumerate(["Alpha", "Numbers", "Hello", "Long"])]
    assert len({ids(eng, t)[0] for t in texts}) == 4  # no shared prefix: reuse does not reorder
    sizes = [len(ids(eng, t)) * per_token for t in texts]
    bound = sizes[2] + sizes[3] + per_token  # room for the last two only
    cache = PrefixCache(bound, admission="always")
    for t in texts:
        DecodeRun(eng.model, [ids(eng, t)], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)._prefill()
        assert cache.nbytes <= bound
    assert [e.tokens.tolist() for e in cache.entries()] == [ids(eng, texts[2]), ids(eng, texts[3])]
    assert cache.evictions == 2 and cache.nbytes == sizes[2] + sizes[3]
    # a prompt larger than the whole bound is not stored (and evicts nothing)
    huge = DOC * 3
    DecodeRun(eng.model, [ids(eng, huge)], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)._prefill()
    assert len(cache) == 2
    # looking an entry up makes it most recent: the other one is evicted next
    small = PrefixCache(3 * 2 * 4 * 10)  # three entries of 10 one-float K/V tokens (1 layer)
    kv = [torch.zeros(1, 1, 10, 1)]
    for start in (0, 100, 200):
        assert small.insert(list(range(start, start + 10)), kv, kv)
    entry, common = small.lookup(list(range(0, 5)) + [999])
    assert common == 5 and entry.tokens.tolist() == list(range(10))
    assert [e.tokens[0].item() for e in small.entries()] == [0, 100, 200]  # a lookup alone changes nothing
    small.record_reuse(entry, 5)
    small.insert(list(range(300, 310)), kv, kv)
    assert [e.tokens[0].item() for e in small.entries()] == [200, 0, 300]


def test_a_stored_prefix_is_subsumed_by_its_extension(eng):
    cache = PrefixCache(1 << 30, admission="always")
    turn1 = ids(eng, DOC)
    turn2 = turn1 + ids(eng, " Tool log: all good.")
    for row in (turn1, turn2):
        DecodeRun(eng.model, [row], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)._prefill()
    assert [len(e) for e in cache.entries()] == [len(turn2)]


def test_disabled_prefix_cache(tokenizer):
    engine = tiny_engine("llama", tokenizer, prefix_cache_bytes=0) if False else None
    from conftest import tiny_model

    from snapkv_rag import Engine

    engine = Engine(tiny_model("llama", len(tokenizer)), tokenizer, prefix_cache_bytes=0)
    engine.generate(DOC, chat=False, max_new_tokens=1)
    again = engine.generate(DOC, chat=False, max_new_tokens=1)
    assert again.stats.reused_prompt_tokens == 0 and len(engine.prefix_cache) == 0
    default = Engine(tiny_model("llama", len(tokenizer)), tokenizer)
    assert default.prefix_cache.max_bytes == 1 << 30
    with pytest.raises(ValueError):
        Engine(tiny_model("llama", len(tokenizer)), tokenizer, prefix_cache_bytes=-1)


def test_sliding_window_models_do_not_reuse(tokenizer):
    from conftest import gemma3_engine

    engine = gemma3_engine(tokenizer)
    policy = POLICIES["snapkv"]
    engine.generate(DOC + "\n\nFirst?", chat=False, compression=policy, max_new_tokens=1)
    r = engine.generate(DOC + "\n\nSecond?", chat=False, compression=policy, max_new_tokens=6, ignore_eos=True)
    f = engine.generate(DOC + "\n\nSecond?", chat=False, compression=policy, max_new_tokens=6, ignore_eos=True, prefix_cache=False)
    assert r.stats.reused_prompt_tokens == 0 and r.token_ids == f.token_ids


def test_chat_turns_reuse_the_previous_prompt(eng):
    """An agent-like session: each turn's prompt extends the previous one."""
    eng.prefix_cache.clear()
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Read the log."}]
    first = eng.generate(messages, max_new_tokens=4)
    messages += [{"role": "assistant", "content": first.text}, {"role": "tool", "content": DOC}, {"role": "user", "content": "Summarize."}]
    second = eng.generate(messages, max_new_tokens=4)
    assert second.stats.reused_prompt_tokens >= first.usage.prompt_tokens - 2
    assert second.token_ids == eng.generate(messages, max_new_tokens=4, prefix_cache=False).token_ids


def test_a_prefix_under_the_minimum_share_is_not_reused(eng, monkeypatch):
    """Reusing a tiny share costs more than it saves (the fixed cost of reusing), so a stored
    prefix shorter than MIN_REUSE_SHARE of the prompt is left unused (set to a half here)."""
    monkeypatch.setattr("snapkv_rag.reuse.prefix_cache.MIN_REUSE_SHARE", 0.5)
    cache = PrefixCache(1 << 30, admission="always")
    base = ids(eng, DOC)
    other = ids(eng, "Hello world, hello engine! " * 8)
    DecodeRun(eng.model, [base], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)._prefill()
    short = base[: len(base) // 3] + other[: len(base)]
    run = DecodeRun(eng.model, [short], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)
    run._prefill()
    assert run.reused_tokens == [0]
    long = base[: 3 * len(base) // 4] + other[:8]
    run = DecodeRun(eng.model, [long], GenerationParams(max_new_tokens=1), None, eng._pad_id, prefix_cache=cache)
    run._prefill()
    assert run.reused_tokens == [3 * len(base) // 4]


def test_the_least_share_reused_depends_on_the_precision(monkeypatch):
    """fp32 reuse is exact and pays from a tenth of the prompt; in bf16 it is not bit-exact and stays at half."""
    from snapkv_rag.reuse import prefix_cache

    monkeypatch.setattr(prefix_cache, "MIN_REUSE_SHARE", 0.1)
    monkeypatch.setattr(prefix_cache, "MIN_REUSE_SHARE_LOW_PRECISION", 0.5)
    assert prefix_cache.reusable_tokens(300, 1000, None, torch.float32) == 300
    assert prefix_cache.reusable_tokens(300, 1000, None, torch.bfloat16) == 0
    assert prefix_cache.reusable_tokens(600, 1000, None, torch.bfloat16) == 600
    assert prefix_cache.reusable_tokens(50, 1000, None, torch.float32) == 0


def test_chat_turns_reuse_the_whole_earlier_prompt_or_all_before_a_rewritten_tail(tokenizer):
    """Issue 48: an appended turn reuses every token of the earlier prompt; a turn whose last
    message was rewritten reuses everything before it; output equals a fresh prefill (fp32)."""
    engine = tiny_engine("llama", tokenizer, context=4096)
    history = [{"role": "system", "content": "You keep a ship's log."}]
    for k in range(6):
        history += [{"role": "user", "content": f"Entry {k}: " + DOC}, {"role": "assistant", "content": f"Logged entry {k}."}]

    def prompt_ids(messages):
        return render_prompt(engine.tokenizer, messages)

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    engine.generate(history, max_new_tokens=2)
    appended = history + [{"role": "user", "content": "And the weather?"}]
    turn = engine.generate(appended, max_new_tokens=2)
    earlier = prompt_ids(history)
    assert common(earlier, prompt_ids(appended)) >= len(earlier) - 2  # the template's generation prompt differs
    assert turn.stats.reused_prompt_tokens == common(earlier, prompt_ids(appended))
    rewritten = appended[:-2] + [{"role": "assistant", "content": "Logged entry five, rewritten."}, appended[-1]]
    again = engine.generate(rewritten, max_new_tokens=2)
    shared = common(prompt_ids(appended), prompt_ids(rewritten))
    assert shared > 0.8 * len(prompt_ids(rewritten)) and again.stats.reused_prompt_tokens == shared
    engine.prefix_cache.clear()
    fresh = engine.generate(rewritten, max_new_tokens=2)
    assert fresh.stats.reused_prompt_tokens == 0 and fresh.token_ids == again.token_ids


def test_a_compressed_prompt_is_stored_when_it_repeats_and_reused_after(tokenizer):
    """The default admission ("repeat"): a one-off compressed prefill collects no full K/V (it
    would peak like a full prefill, issue 63), a repeated one is stored and then reused."""
    engine = tiny_engine("llama", tokenizer)
    assert engine.prefix_cache.admission == "repeat"
    engine.prefix_cache.first_sight_bytes = 0  # as if the prompt were long (a tiny model's is a few KiB)
    prompt = DOC + "\n\nWhat number appears in the text?"
    policy = "snapkv:budget=24,window=8"
    first = engine.generate(prompt, chat=False, compression=policy, max_new_tokens=3)
    assert len(engine.prefix_cache) == 0 and first.stats.reused_prompt_tokens == 0
    second = engine.generate(prompt, chat=False, compression=policy, max_new_tokens=3)
    assert len(engine.prefix_cache) == 1 and second.stats.reused_prompt_tokens == 0
    other_question = DOC + "\n\nWhich animal is lazy?"  # the stored documents serve another question
    third = engine.generate(other_question, chat=False, compression=policy, max_new_tokens=3)
    assert third.stats.reused_prompt_tokens > 0
    assert third.token_ids == engine.generate(other_question, chat=False, compression=policy, max_new_tokens=3, prefix_cache=False).token_ids


def test_a_full_cache_prompt_is_stored_at_once_and_a_too_big_one_never(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    engine.generate(DOC, chat=False, max_new_tokens=2)  # its full K/V exists anyway: no extra peak to store it
    assert len(engine.prefix_cache) == 1
    assert engine.generate(DOC + " More.", chat=False, max_new_tokens=2).stats.reused_prompt_tokens > 0
    small = PrefixCache(1000, admission="always")
    assert not small.admits([1, 2, 3], "", 1001, None, torch.float32)  # over the whole bound: not collected
    assert small.admits([1, 2, 3], "", 999, None, torch.float32)


def test_the_admission_is_checked_and_remembers_prompts_per_namespace():
    from snapkv_rag.compression import as_policy

    policy = as_policy("snapkv:budget=8,window=4")
    cache = PrefixCache(1 << 20)
    row = list(range(100))
    assert cache.admits(row, "a", (1 << 20) // 16, policy, torch.float32)  # short: stored at first sight
    cache.clear()
    big = (1 << 20) // 16 + 1
    assert not cache.admits(row, "a", big, policy, torch.float32)  # first sight of a long one
    assert not cache.admits(row, "b", big, policy, torch.float32)  # another namespace's first sight
    assert cache.admits(row[:90] + [7] * 10, "a", big, policy, torch.float32)  # 90% shared with a seen prompt
    cache.admission = "sometimes"
    with pytest.raises(ValueError, match="admission"):
        cache.admits(row, "a", 100, policy, torch.float32)


@pytest.mark.parametrize("paused", ["lookup", "insert"])
def test_a_store_from_another_thread_waits_for_a_walk_over_the_entries(monkeypatch, paused):
    """lookup and insert compare the prompt with every stored entry: a store from another thread
    (the engine's worker beside a caller's own run) landing mid-walk changed the entries under it
    ("OrderedDict mutated during iteration"); the cache's lock holds the store until the walk ends."""
    import threading

    cache = PrefixCache(max_bytes=1 << 20)
    kv = [torch.zeros(1, 1, 4, 2)]
    for first in range(3):
        cache.insert([first, 1, 2, 3], kv, kv)
    stored, others = threading.Event(), []
    compare = PrefixCache._common_prefix

    def store_elsewhere():
        cache.insert([9, 9, 9, 9], kv, kv)
        stored.set()

    def comparing(entry_tokens, query):
        if not others:  # the walk's first comparison: another thread stores now
            others.append(threading.Thread(target=store_elsewhere))
            others[0].start()
            stored.wait(timeout=0.5)  # an unguarded store lands well within this; a guarded one waits for the walk
        return compare(entry_tokens, query)

    monkeypatch.setattr(PrefixCache, "_common_prefix", staticmethod(comparing))
    if paused == "lookup":
        entry, shared = cache.lookup([1, 1, 2, 3, 5])
        assert entry is not None and entry.tokens.tolist() == [1, 1, 2, 3] and shared == 4
    else:
        assert cache.insert([1, 1, 2, 3, 5], kv, kv)
    others[0].join()
    assert stored.is_set()
    assert sorted(e.tokens.tolist() for e in cache.entries()) == sorted(
        [[0, 1, 2, 3], [2, 1, 2, 3], [9, 9, 9, 9]] + ([[1, 1, 2, 3]] if paused == "lookup" else [[1, 1, 2, 3, 5]])
    )
