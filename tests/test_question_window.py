"""The question-aligned SnapKV observation window (``window_size="question"``)."""

from __future__ import annotations

import pytest

from snapkv_rag.compression import SnapKV, parse_compression
from snapkv_rag.engine.prompts import default_question, last_paragraph, question_tail_tokens, render_prompt
from snapkv_rag.errors import InvalidCompressionError

FILLER = "The quick brown fox jumps over the lazy dog. " * 20


def test_last_paragraph_and_default_question():
    assert last_paragraph("a\n\nb c\n \nQuestion: d?") == "Question: d?"
    assert last_paragraph("single line") == "single line"
    messages = [
        {"role": "user", "content": "first\n\nold question"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "docs\n\nnew question?"},
    ]
    assert default_question(messages) == "new question?"


def test_question_tail_counts_question_and_template_tail(tokenizer):
    prompt = f"{FILLER}\n\nQuestion: what is the capital of France?"
    ids = render_prompt(tokenizer, prompt)
    tail = question_tail_tokens(tokenizer, prompt)
    text = tokenizer.decode(ids[-tail:])
    assert text.startswith("Question: what is the capital of France?")
    assert text.endswith("<|assistant|>")
    # One token fewer would cut the question's first token.
    assert not tokenizer.decode(ids[-(tail - 1) :]).startswith("Question")
    raw = question_tail_tokens(tokenizer, prompt, chat=False)
    assert tokenizer.decode(render_prompt(tokenizer, prompt, chat=False)[-raw:]).strip() == "Question: what is the capital of France?"


def test_explicit_question_and_missing_question(tokenizer):
    prompt = f"{FILLER} Hello world, where is Paris? Then more text follows here."
    tail = question_tail_tokens(tokenizer, prompt, question="Hello world, where is Paris?")
    ids = render_prompt(tokenizer, prompt)
    assert tokenizer.decode(ids[-tail:]).lstrip().startswith("Hello world, where is Paris?")
    assert question_tail_tokens(tokenizer, prompt, question="not in the prompt") is None


def test_spec_and_validation():
    policy = parse_compression("snapkv:budget=256,window=question")
    assert policy.needs_question_span and policy.window_size == "question"
    assert policy.for_prompt(20).window_size == 20
    assert policy.for_prompt(3).window_size == 8  # clipped to min_window
    assert policy.for_prompt(500).window_size == 64  # clipped to max_window
    assert policy.for_prompt(None).window_size == 32
    assert not policy.for_prompt(20).needs_question_span
    with pytest.raises(InvalidCompressionError):
        SnapKV(window_size="question", max_capacity_prompt=64)  # max_window must fit the budget
    with pytest.raises(InvalidCompressionError):
        SnapKV(window_size="questions")
    with pytest.raises(InvalidCompressionError):
        SnapKV(window_size="question", min_window=10, max_window=5)
    with pytest.raises(InvalidCompressionError):
        _ = policy.query_window  # unresolved


def test_engine_resolves_window_per_row(engine, tokenizer):
    short_q = f"{FILLER}\n\nWhere is Paris?"
    long_q = f"{FILLER}\n\nQuestion: the quick brown fox jumps over which lazy animal in the story told above?"
    policy = SnapKV(window_size="question", max_capacity_prompt=128, kernel_size=5)
    singles = [engine.generate(p, compression=policy, max_new_tokens=6) for p in (short_q, long_q)]
    windows = [s.stats.compression["resolved_window_sizes"][0] for s in singles]
    assert windows == [question_tail_tokens(tokenizer, p) for p in (short_q, long_q)]
    assert windows[0] != windows[1]
    batch = engine.generate_batch([short_q, long_q], compression=policy, max_new_tokens=6)
    assert batch[0].stats.compression["resolved_window_sizes"] == windows
    assert [r.token_ids for r in batch] == [s.token_ids for s in singles]


def test_aligned_window_equals_the_same_fixed_window(engine, tokenizer):
    prompt = f"{FILLER}\n\nQuestion: where is Paris?"
    tail = question_tail_tokens(tokenizer, prompt)
    aligned = engine.score(prompt, [5, 6, 7], compression=SnapKV(window_size="question", max_capacity_prompt=128))
    fixed = engine.score(prompt, [5, 6, 7], compression=SnapKV(window_size=tail, max_capacity_prompt=128))
    other = engine.score(prompt, [5, 6, 7], compression=SnapKV(window_size=tail + 20, max_capacity_prompt=128))
    assert (aligned == fixed).all()
    assert not (aligned == other).all()
