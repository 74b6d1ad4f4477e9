"""SnapKVAttentionReranker on a tiny random model: the order is attention_rerank's, the metadata
is the reranker's and stays out of the LLM's text, top_n then budget_tokens, errors, async, and a
VectorStoreIndex query engine with the local embedder whose source nodes carry the scores."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.llms.snapkv import SnapKVAttentionReranker, SnapKVLLM
from snapkv_root_conftest import tiny_engine

from snapkv_rag.integrations import attention_rerank

TOPICS = ("ferry", "library", "museum", "tram", "garden")
TEXTS = [" ".join(f"The {topic} record {k} says the code is {topic[:3].upper()}-{k}." for k in range(4)) for topic in TOPICS]
QUESTION = "What is the code of the museum record 3?"
KEYS = ("attention_score", "attention_rank", "retrieval_score")


@pytest.fixture(scope="module")
def llm(tokenizer):
    return SnapKVLLM(tiny_engine("llama", tokenizer, context=4096), max_new_tokens=4)


def nodes(texts=TEXTS, scores=True):
    return [
        NodeWithScore(node=TextNode(text=t, id_=f"n{i}", metadata={"topic": TOPICS[i]}), score=(0.9 - i / 10) if scores else None) for i, t in enumerate(texts)
    ]


def test_order_scores_and_metadata_are_attention_reranks(llm):
    reranker = SnapKVAttentionReranker(llm=llm)
    given = nodes()
    out = reranker.postprocess_nodes(given, query_str=QUESTION)
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in given]
    expected = attention_rerank(llm.engine, QUESTION, texts)
    assert [n.node.node_id for n in out] == [f"n{i}" for i in expected.order]
    assert [n.score for n in out] == pytest.approx([expected.scores[i] for i in expected.order])
    assert sum(n.score for n in out) == pytest.approx(1.0)
    for rank, (n, i) in enumerate(zip(out, expected.order, strict=True), start=1):
        meta = n.node.metadata
        assert meta["attention_rank"] == rank and meta["attention_score"] == pytest.approx(expected.scores[i])
        assert meta["retrieval_score"] == pytest.approx(0.9 - i / 10) and meta["topic"] == TOPICS[i]
        llm_text = n.node.get_content(metadata_mode=MetadataMode.LLM)
        assert "topic: " in llm_text and not any(k in llm_text for k in KEYS)  # the scores stay out of the prompt
        assert not any(k in n.node.get_content(metadata_mode=MetadataMode.EMBED) for k in KEYS)
    assert all(set(n.node.metadata) == {"topic"} and n.score == pytest.approx(0.9 - i / 10) for i, n in enumerate(given))  # inputs untouched
    assert reranker.last_rerank.order == expected.order and reranker.last_rerank.prompt_tokens > 0
    # the reranked nodes read as they did before (the new keys are excluded): a later step sees the same text
    assert [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in out] == [texts[i] for i in expected.order]


def test_top_n_then_budget_and_engine_and_fusion(llm):
    full = SnapKVAttentionReranker(engine=llm.engine).postprocess_nodes(nodes(scores=False), query_str=QUESTION)
    order = [n.node.node_id for n in full]
    assert "retrieval_score" not in full[0].node.metadata
    assert [n.node.node_id for n in SnapKVAttentionReranker(llm=llm, top_n=2).postprocess_nodes(nodes(), query_str=QUESTION)] == order[:2]
    one = llm.engine.count_tokens(f"[1]\n{full[0].node.get_content(metadata_mode=MetadataMode.LLM)}") + 2
    cut = SnapKVAttentionReranker(llm=llm, budget_tokens=one + 5).postprocess_nodes(nodes(), query_str=QUESTION)
    assert [n.node.node_id for n in cut] == order[:1]
    both = SnapKVAttentionReranker(llm=llm, top_n=3, budget_tokens=10 * one).postprocess_nodes(nodes(), query_str=QUESTION)
    assert [n.node.node_id for n in both] == order[:3]
    fused = SnapKVAttentionReranker(llm=llm, fusion="rrf").postprocess_nodes(nodes(), query_str=QUESTION)
    assert sorted(n.node.node_id for n in fused) == sorted(order)


def test_empty_missing_query_and_bad_settings(llm):
    reranker = SnapKVAttentionReranker(llm=llm)
    assert reranker.postprocess_nodes([], query_str=QUESTION) == []
    with pytest.raises(ValueError, match="query"):
        reranker.postprocess_nodes(nodes())
    with pytest.raises(ValueError, match="query"):
        reranker.postprocess_nodes(nodes(), query_bundle=QueryBundle(" "))
    with pytest.raises(ValueError, match="not both"):
        SnapKVAttentionReranker(llm=llm, engine=llm.engine)
    with pytest.raises(ValueError, match="observation window"):
        SnapKVAttentionReranker(llm=llm, compression=None)
    with pytest.raises(ValueError):
        SnapKVAttentionReranker(llm=llm, top_n=0)
    with pytest.raises(ValueError):
        SnapKVAttentionReranker(llm=llm, fusion="best")
    with pytest.raises(TypeError, match="SnapKVLLM"):
        SnapKVAttentionReranker(llm=object())


def test_async_equals_sync_and_the_callback_event(llm):
    debug = LlamaDebugHandler()
    reranker = SnapKVAttentionReranker(llm=llm, top_n=3, callback_manager=CallbackManager([debug]))
    sync = reranker.postprocess_nodes(nodes(), query_str=QUESTION)
    out = asyncio.run(reranker.apostprocess_nodes(nodes(), query_str=QUESTION))
    assert [(n.node.node_id, n.score, n.node.metadata) for n in out] == [(n.node.node_id, n.score, n.node.metadata) for n in sync]
    assert len(debug.get_event_pairs(CBEventType.RERANKING)) == 2


def test_in_a_vector_store_index_query_engine(llm):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.llms.snapkv import default_embed_model

    index = VectorStoreIndex.from_documents([Document(text=t, metadata={"topic": TOPICS[i]}) for i, t in enumerate(TEXTS)], embed_model=default_embed_model())
    reranker = SnapKVAttentionReranker(llm=llm, top_n=3)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=4, node_postprocessors=[reranker])
    response = query_engine.query(QUESTION)
    assert isinstance(response.response, str) and len(response.source_nodes) == 3
    ranks = [n.node.metadata["attention_rank"] for n in response.source_nodes]
    assert ranks == [1, 2, 3] and [n.score for n in response.source_nodes] == [n.node.metadata["attention_score"] for n in response.source_nodes]
    assert all(0 < n.node.metadata["retrieval_score"] <= 1 for n in response.source_nodes)  # the embedder's cosine similarities
    retrieved = index.as_retriever(similarity_top_k=4).retrieve(QUESTION)
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in retrieved]
    expected = attention_rerank(llm.engine, QUESTION, texts)
    assert [n.node.node_id for n in response.source_nodes] == [retrieved[i].node.node_id for i in expected.order[:3]]
    aresponse = asyncio.run(query_engine.aquery(QUESTION))
    assert [n.node.node_id for n in aresponse.source_nodes] == [n.node.node_id for n in response.source_nodes]


def test_stored_keys_skims_from_the_engines_segment_store(llm):
    llm.engine.segment_store.clear()
    out = SnapKVAttentionReranker(llm=llm, stored_keys=True).postprocess_nodes(nodes(), query_str=QUESTION)
    assert len(out) == len(TEXTS) and len(llm.engine.segment_store) == len(TEXTS)  # each node's K/V computed once and stored
