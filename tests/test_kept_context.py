"""Compress once, ask many (keep_context): the context read without its question, kept, and asked again."""

from __future__ import annotations

import pytest

from snapkv_rag.errors import InvalidCompressionError, InvalidGenerationParameterError, InvalidPromptError
from snapkv_rag.testing import tiny_engine

DOCS = " ".join(f"w{i}" for i in range(300))
POLICY = "expected:budget=64,window=8"


def ask(engine, question, compression=POLICY, **options):
    prompt = f"{DOCS}\n\nQuestion: {question}"
    return engine.generate(prompt, compression=compression, question=question, keep_context=True, max_new_tokens=6, chat=False, **options)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(context=4096)


@pytest.mark.parametrize(
    "compression",
    [POLICY, "snapkv:budget=96,window=question", "snapkv:budget=64,kv_bits=8", "expected:budget=64,window=8,rolling=128", "kvzip:budget=64,repeat_chunk=96"],
)
def test_a_kept_context_answers_a_follow_up_as_a_fresh_read_would(engine, compression):
    engine.kept_contexts.clear()
    first = ask(engine, "what is w5?", compression)
    follow = ask(engine, "and what about w7?", compression)
    assert (first.stats.context_reuse, follow.stats.context_reuse) == ("stored", "reused")
    assert follow.stats.prefilled_prompt_tokens < 12  # the question and nothing else was read
    engine.kept_contexts.clear()
    fresh = ask(engine, "and what about w7?", compression)
    assert fresh.stats.context_reuse == "stored"
    assert follow.token_ids == fresh.token_ids


@pytest.mark.parametrize("compression", ["snapkv:budget=4000", "kvzip:budget=4000,repeat_chunk=64"])
def test_with_nothing_evicted_the_split_read_equals_one_whole_prefill(engine, compression):
    prompt = f"{DOCS[:200]}\n\nQuestion: what is w5?"
    whole = engine.generate(prompt, compression=None, max_new_tokens=8, chat=False, prefix_cache=False)
    split = engine.generate(prompt, compression=compression, question="what is w5?", keep_context=True, max_new_tokens=8, chat=False)
    assert split.token_ids == whole.token_ids
    assert max(split.stats.kept_tokens_per_layer) == split.usage.prompt_tokens  # the repeat left nothing behind


def test_the_kept_context_does_not_depend_on_the_question(engine):
    import torch

    kept = []
    for question in ("what is w5?", "name w250 please"):
        engine.kept_contexts.clear()
        ask(engine, question)
        (entry,) = engine.kept_contexts._entries.values()
        kept.append(torch.cat([layer.keys for layer in entry.layers]))
    assert kept[0].shape[2] == 64
    assert torch.equal(kept[0], kept[1])


def test_namespaces_keep_contexts_apart(engine):
    engine.kept_contexts.clear()
    assert ask(engine, "what is w5?", cache_salt="tenant-a").stats.context_reuse == "stored"
    assert ask(engine, "what is w6?", cache_salt="tenant-b").stats.context_reuse == "stored"
    assert ask(engine, "what is w7?", cache_salt="tenant-a").stats.context_reuse == "reused"
    assert ask(engine, "what is w8?", compression="expected:budget=80,window=8", cache_salt="tenant-a").stats.context_reuse == "stored"  # another policy


def test_the_bound_evicts_the_least_recent(engine):
    from snapkv_rag.reuse.kept_contexts import KeptContexts

    saved = engine.kept_contexts
    try:
        engine.kept_contexts = KeptContexts(1)  # smaller than any context
        assert "larger than" in ask(engine, "what is w5?").stats.context_reuse
        assert len(engine.kept_contexts) == 0
    finally:
        engine.kept_contexts = saved


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"keep_context": 3}, InvalidGenerationParameterError),
        ({"keep_context": "yes"}, InvalidCompressionError),
        ({"keep_context": "full"}, InvalidGenerationParameterError),
        ({"keep_context": True, "compression": None}, InvalidGenerationParameterError),
        ({"keep_context": True, "keep_texts": ["w5"]}, InvalidGenerationParameterError),
        ({"keep_context": True, "question": "not in the prompt"}, InvalidPromptError),
    ],
)
def test_bad_requests_get_one_clear_error(engine, options, error):
    kwargs = {"compression": POLICY, "chat": False, "max_new_tokens": 2, **options}
    with pytest.raises(error, match="keep_context"):
        engine.generate(f"{DOCS[:300]}\n\nQuestion: what?", **kwargs)


def test_batches_refuse_it(engine):
    with pytest.raises(InvalidGenerationParameterError, match="one prompt"):
        engine.generate_batch(["a b c", "d e f"], compression=POLICY, keep_context=True, chat=False, max_new_tokens=2)


def test_a_conversation_extends_its_kept_context(engine):
    engine.kept_contexts.clear()
    first = ask(engine, "what is w5?")
    later = f"{DOCS}\n\nQuestion: what is w5?\nAnswer: {first.text.strip()}\n\nQuestion: and w9?"
    second = engine.generate(later, compression=POLICY, question="and w9?", keep_context=True, max_new_tokens=6, chat=False)
    assert second.stats.context_reuse == "extended"
    assert second.stats.prefilled_prompt_tokens < 40  # the first answer and the new question, not the documents
    assert len(engine.kept_contexts) == 1  # the longer context took the shorter one's place
    third = engine.generate(later + "\nAnswer: no\n\nQuestion: w10?", compression=POLICY, question="w10?", keep_context=True, max_new_tokens=6, chat=False)
    assert third.stats.context_reuse == "extended" and third.stats.reused_prompt_tokens > second.stats.reused_prompt_tokens


@pytest.mark.parametrize("kept", ["expected:budget=128,window=8", "kvzip:budget=128,repeat_chunk=96"])
def test_a_question_aware_cut_of_a_kept_question_agnostic_context(engine, kept):
    engine.kept_contexts.clear()
    cut = "snapkv:budget=72,window=question"

    def two_stage(question):
        prompt = f"{DOCS}\n\nQuestion: {question}"
        return engine.generate(prompt, compression=cut, keep_context=kept, question=question, max_new_tokens=6, chat=False)

    first, follow = two_stage("what is w5?"), two_stage("and what about w7?")
    assert (first.stats.context_reuse, follow.stats.context_reuse) == ("stored", "reused")
    assert max(follow.stats.kept_tokens_per_layer) == 72  # the question's cut of the 128 kept
    assert follow.stats.compression["kept_context"].startswith(kept.split(":")[0])
    engine.kept_contexts.clear()
    assert two_stage("and what about w7?").token_ids == follow.token_ids
    with pytest.raises(InvalidCompressionError, match="give it as keep_context"):
        engine.generate(f"{DOCS}\n\nQuestion: q?", compression="kvzip:budget=64", keep_context=kept, question="q?", chat=False)
