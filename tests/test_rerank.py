"""The attention reranker over any texts (snapkv_rag.rag.rerank): the skim's scores for passages
that came from no DocumentStore, a token budget, fusion with the input order, and bad input."""

from __future__ import annotations

import pytest
from conftest import tiny_engine

from snapkv_rag.compression import recording_window_votes
from snapkv_rag.compression.snapkv import SnapKV
from snapkv_rag.rag import StoredChunk, StuffedContext, attention_rerank, build_messages
from snapkv_rag.rag.skim import document_scores, skim_policy

TOPICS = ("ferry", "library", "museum", "tram", "garden")
TEXTS = [" ".join(f"The {topic} record {k} says the code is {topic[:3].upper()}-{k}." for k in range(12)) for topic in TOPICS]
QUESTION = "What is the code of the museum record 3?"
POLICY = SnapKV(window_size="question", max_capacity_prompt=96)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, context=4096)


def test_scores_are_the_skims_votes_over_the_stuffed_texts(engine):
    heads = [(0, 1), (1, 2)]
    reranked = attention_rerank(engine, QUESTION, TEXTS, compression=POLICY, heads=heads)
    chunks = [StoredChunk(id=str(i), text=t, source=f"text-{i}", title="", position=i, tokens=0) for i, t in enumerate(TEXTS)]
    messages, question_text = build_messages(QUESTION, chunks)
    tokens = engine.count_tokens(messages)
    context = StuffedContext(QUESTION, question_text, chunks, messages, 0, 0, tokens, len(chunks), 0, 0, "rerank")
    with recording_window_votes() as recorded:  # the whole forward, read directly
        engine.generate(messages, compression=skim_policy(POLICY, tokens, engine.context_length), question=question_text, max_new_tokens=1, prefix_cache=False)
    expected = document_scores(engine.tokenizer, context, recorded[-1], heads=heads)
    assert reranked.scores == pytest.approx(expected, rel=1e-5)
    assert reranked.order == sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    assert sorted(reranked.ranks) == list(range(1, len(TEXTS) + 1)) and reranked.ranks[reranked.order[0]] == 1
    assert reranked.kept == reranked.order and reranked.prompt_tokens == tokens
    assert sum(reranked.scores) == pytest.approx(1.0)


def test_a_budget_keeps_the_best_that_fit_and_rrf_leans_on_the_input_order(engine):
    full = attention_rerank(engine, QUESTION, TEXTS, compression=POLICY)
    one_text = engine.count_tokens(f"[1]\n{TEXTS[full.order[0]]}") + 2
    cut = attention_rerank(engine, QUESTION, TEXTS, compression=POLICY, budget_tokens=one_text + 10)
    assert cut.kept == [full.order[0]] and cut.order == full.order
    assert full.chosen(2) == full.order[:2] and cut.chosen(3) == cut.chosen() == [full.order[0]]
    fused = attention_rerank(engine, QUESTION, TEXTS, compression=POLICY, fusion="rrf")
    assert sorted(fused.order) == list(range(len(TEXTS))) and fused.scores == full.scores


def test_blank_texts_rank_last_and_bad_input_is_one_clear_error(engine):
    reranked = attention_rerank(engine, QUESTION, [TEXTS[0], "  ", TEXTS[2]], compression=POLICY)
    assert reranked.order[-1] == 1 and reranked.scores[1] == 0.0
    assert attention_rerank(engine, QUESTION, []).order == []
    with pytest.raises(ValueError, match="non-empty question"):
        attention_rerank(engine, " ", TEXTS)
    with pytest.raises(ValueError, match="fusion"):
        attention_rerank(engine, QUESTION, TEXTS, fusion="best")
    with pytest.raises(ValueError, match="one title per text"):
        attention_rerank(engine, QUESTION, TEXTS, titles=["a"])
    with pytest.raises(ValueError, match="budget_tokens"):
        attention_rerank(engine, QUESTION, TEXTS, budget_tokens=0)
    with pytest.raises(TypeError, match="item 1"):
        attention_rerank(engine, QUESTION, ["a", 3])
    with pytest.raises(ValueError, match="observation window"):
        attention_rerank(engine, QUESTION, TEXTS, compression=None)


def test_stored_keys_rank_from_the_store_and_read_a_text_once(engine):
    from snapkv_rag.reuse.segment_store import SegmentKVStore

    store = SegmentKVStore(max_bytes=1 << 26)
    first = attention_rerank(engine, QUESTION, TEXTS, compression=POLICY, stored_keys=store)
    again = attention_rerank(engine, "Which record names the tram?", TEXTS, compression=POLICY, stored_keys=store)
    assert sorted(first.order) == list(range(len(TEXTS))) and sum(first.scores) == pytest.approx(1.0)
    assert again.prompt_tokens > 0 and len(store) == len(TEXTS)  # each text computed and stored once, then placed
