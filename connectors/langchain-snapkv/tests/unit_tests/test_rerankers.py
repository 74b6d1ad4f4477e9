"""SnapKVAttentionReranker on a tiny random model: the order is attention_rerank's, the metadata,
top_n then budget_tokens, errors, async, and a retrieval chain (an InMemoryVectorStore with the
connector's embeddings, reranked, into prompt | ChatSnapKV | StrOutputParser)."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.documents.compressor import BaseDocumentCompressor
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_snapkv import ChatSnapKV, SnapKVAttentionReranker, SnapKVEmbeddings
from snapkv_rag.integrations import attention_rerank

TOPICS = ("ferry", "library", "museum", "tram", "garden")
TEXTS = [" ".join(f"The {topic} record {k} says the code is {topic[:3].upper()}-{k}." for k in range(4)) for topic in TOPICS]
QUESTION = "What is the code of the museum record 3?"


@pytest.fixture(scope="module")
def engine(root_helpers):
    return root_helpers.tiny_engine("llama", context=4096)


@pytest.fixture(scope="module")
def llm(engine):
    return ChatSnapKV(engine=engine, max_tokens=4)


def documents():
    return [Document(page_content=t, metadata={"topic": TOPICS[i]}, id=f"d{i}") for i, t in enumerate(TEXTS)]


def test_order_and_metadata_are_attention_reranks(llm, engine):
    reranker = SnapKVAttentionReranker(llm=llm)
    assert isinstance(reranker, BaseDocumentCompressor)
    given = documents()
    out = reranker.compress_documents(given, QUESTION)
    expected = attention_rerank(engine, QUESTION, TEXTS)
    assert [d.id for d in out] == [f"d{i}" for i in expected.order]
    for rank, (doc, i) in enumerate(zip(out, expected.order, strict=True), start=1):
        assert doc.page_content == TEXTS[i] and doc.metadata["topic"] == TOPICS[i]
        assert doc.metadata["attention_rank"] == rank and doc.metadata["attention_score"] == pytest.approx(expected.scores[i])
    assert sum(d.metadata["attention_score"] for d in out) == pytest.approx(1.0)
    assert all(set(d.metadata) == {"topic"} for d in given)  # copies: the inputs are untouched
    assert reranker.last_rerank.order == expected.order and reranker.last_rerank.prompt_tokens > 0


def test_top_n_then_budget_engine_and_fusion(llm, engine):
    order = [d.id for d in SnapKVAttentionReranker(engine=engine).compress_documents(documents(), QUESTION)]
    assert [d.id for d in SnapKVAttentionReranker(llm=llm, top_n=2).compress_documents(documents(), QUESTION)] == order[:2]
    one = engine.count_tokens(f"[1]\n{TEXTS[int(order[0][1:])]}") + 2
    assert [d.id for d in SnapKVAttentionReranker(llm=llm, budget_tokens=one + 5).compress_documents(documents(), QUESTION)] == order[:1]
    both = SnapKVAttentionReranker(llm=llm, top_n=3, budget_tokens=10 * one).compress_documents(documents(), QUESTION)
    assert [d.id for d in both] == order[:3]
    fused = SnapKVAttentionReranker(llm=llm, fusion="rrf").compress_documents(documents(), QUESTION)
    assert sorted(d.id for d in fused) == sorted(order)


def test_empty_missing_query_and_bad_settings(llm, engine):
    reranker = SnapKVAttentionReranker(llm=llm)
    assert reranker.compress_documents([], QUESTION) == []
    with pytest.raises(ValueError, match="query"):
        reranker.compress_documents(documents(), " ")
    with pytest.raises(ValueError, match="not both"):
        SnapKVAttentionReranker(llm=llm, engine=engine)
    with pytest.raises(ValueError, match="observation window"):
        SnapKVAttentionReranker(llm=llm, compression="full")
    with pytest.raises(ValueError):
        SnapKVAttentionReranker(llm=llm, budget_tokens=0)
    with pytest.raises(ValueError):
        SnapKVAttentionReranker(llm=llm, fusion="best")
    with pytest.raises(TypeError, match="ChatSnapKV"):
        SnapKVAttentionReranker(llm=object())


async def test_async_equals_sync(llm):
    reranker = SnapKVAttentionReranker(llm=llm, top_n=3)
    sync = reranker.compress_documents(documents(), QUESTION)
    out = await reranker.acompress_documents(documents(), QUESTION)
    assert [(d.id, d.metadata) for d in out] == [(d.id, d.metadata) for d in sync]


def _numbered(docs: list[Document]) -> str:
    return "\n\n".join(f"[{n}] {d.page_content}" for n, d in enumerate(docs, start=1))


async def test_in_a_retrieval_chain(llm, engine, embedder):
    # langchain's ContextualCompressionRetriever is not installed here (langchain 1.x moved it to
    # langchain-classic): the same composition in LCEL, retriever then compressor
    store = InMemoryVectorStore(SnapKVEmbeddings(embedder=embedder))
    store.add_documents(documents())
    retriever = store.as_retriever(search_kwargs={"k": 4})
    reranker = SnapKVAttentionReranker(llm=llm, top_n=3)
    reranked = RunnableLambda(lambda q: reranker.compress_documents(retriever.invoke(q), q)).with_config(run_name="rerank")
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the documents.\n\n{context}"), ("human", "{question}")])
    chain = RunnableParallel(documents=reranked, question=RunnablePassthrough()).assign(
        answer=RunnableLambda(lambda x: {"context": _numbered(x["documents"]), "question": x["question"]}) | prompt | llm | StrOutputParser()
    )
    out = chain.invoke(QUESTION)
    assert isinstance(out["answer"], str) and out["question"] == QUESTION
    assert [d.metadata["attention_rank"] for d in out["documents"]] == [1, 2, 3]
    retrieved = retriever.invoke(QUESTION)
    expected = attention_rerank(engine, QUESTION, [d.page_content for d in retrieved])
    assert [d.id for d in out["documents"]] == [retrieved[i].id for i in expected.order[:3]]
    areranked = RunnableLambda(lambda q: reranker.compress_documents(retriever.invoke(q), q), afunc=lambda q: _arerank(reranker, retriever, q))
    achain = RunnableParallel(documents=areranked, question=RunnablePassthrough())
    assert [d.id for d in (await achain.ainvoke(QUESTION))["documents"]] == [d.id for d in out["documents"]]


async def _arerank(reranker, retriever, query):
    return await reranker.acompress_documents(await retriever.ainvoke(query), query)


def test_stored_keys_skims_from_the_engines_segment_store(llm, engine):
    engine.segment_store.clear()
    out = SnapKVAttentionReranker(llm=llm, stored_keys=True).compress_documents(documents(), QUESTION)
    assert len(out) == len(TEXTS) and len(engine.segment_store) == len(TEXTS)  # each document's K/V computed once and stored
