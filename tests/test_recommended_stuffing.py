"""A model's recommended stuffing is the default budget (issue 30): the embedded 135M model
answers worse the more it reads, so DocumentQA, ask and the connectors stuff 1000 tokens for it
unless told otherwise; other models fill their context."""

from __future__ import annotations

from conftest import tiny_engine

from snapkv_rag.model.loading import DEFAULT_MODEL, RECOMMENDED_CONTEXT_TOKENS
from snapkv_rag.rag.stuffing import StuffingRetriever


def budget(engine, **kwargs) -> int:
    return StuffingRetriever(None, engine, max_new_tokens=64, **kwargs)._budget("When does the ferry leave?")[0]


def test_the_embedded_model_has_a_recommended_budget_and_others_fill(tokenizer):
    assert RECOMMENDED_CONTEXT_TOKENS[DEFAULT_MODEL] == 1000
    engine = tiny_engine("llama", tokenizer, context=4096)
    assert engine.recommended_context_tokens is None
    fill = budget(engine)
    assert fill > 3000  # the whole context less max_new_tokens and the prompt's own tokens
    engine.recommended_context_tokens = 1500
    assert budget(engine) == 1500
    assert budget(engine, context_tokens=2500) == 2500  # an explicit budget wins
    assert budget(engine, whole_collection=True) == fill  # the whole collection always fills
    engine.recommended_context_tokens = 10_000  # more than fits: capped by the context
    assert budget(engine) == fill
