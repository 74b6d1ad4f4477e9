"""Stuffing retriever (core store and LangChain Chroma), embeddings, the cited chain, chat history."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.retrievers import BaseRetriever

from langchain_snapkv import (
    ChatSnapKV,
    SnapKVChatMessageHistory,
    SnapKVEmbeddings,
    SnapKVStuffingRetriever,
    cited_prompt,
    create_cited_qa_chain,
)
from snapkv_rag.agents import AgentMemory
from snapkv_rag.rag import DocumentStore

TOPICS = ["ferry", "library", "museum", "tram", "garden", "bakery"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, embedder):
    folder = tmp_path_factory.mktemp("docs")
    for i, topic in enumerate(TOPICS):
        body = " ".join(f"The {topic} fact {k}: code {topic[:3].upper()}-{i}{k}." for k in range(6))
        (folder / f"{topic}.md").write_text(f"# The {topic}\n\n{body}\n")
    s = DocumentStore("lcdocs", path=tmp_path_factory.mktemp("chroma"), embedder=embedder)
    s.ingest([folder], chunk_tokens=40, overlap=0)
    return s


def test_retriever_packs_to_budget_with_source_metadata(store, tiny_engine):
    r = SnapKVStuffingRetriever(store=store, engine=tiny_engine, context_tokens=200, max_new_tokens=16)
    docs = r.invoke("ferry code")
    assert docs and all(isinstance(d, Document) for d in docs)
    assert [d.metadata["number"] for d in docs] == list(range(1, len(docs) + 1))
    assert docs[0].metadata["source"].endswith(".md") and docs[0].metadata["title"]
    assert docs[0].id == docs[0].metadata["chunk_id"]
    assert "ferry" in docs[0].page_content
    ctx = r.stuff("ferry code")
    assert ctx.document_tokens <= 200 and [c.id for c in ctx.chunks] == [d.id for d in docs]
    assert len(r.invoke("ferry code", k=2)) == 2
    assert len(SnapKVStuffingRetriever(store=store, engine=tiny_engine, k=1).invoke("tram")) == 1


async def test_retriever_async(store, tiny_engine):
    r = SnapKVStuffingRetriever(store=store, engine=tiny_engine, k=3)
    assert [d.id for d in await r.ainvoke("museum")] == [d.id for d in r.invoke("museum")]


def test_embeddings_wrap_the_core_embedder(embedder):
    emb = SnapKVEmbeddings(embedder=embedder)
    vecs = emb.embed_documents(["a ferry", "a tram"])
    assert len(vecs) == 2 and len(vecs[0]) == embedder.dimension
    assert emb.embed_query("a ferry") == pytest.approx(vecs[0], abs=1e-5)
    assert emb.embed_documents([]) == []


def test_langchain_chroma_interop(tmp_path, embedder, tiny_engine):
    from langchain_chroma import Chroma

    vs = Chroma("interop", embedding_function=SnapKVEmbeddings(embedder=embedder), persist_directory=str(tmp_path))
    vs.add_documents(
        [
            Document(page_content=f"The {t} opens at {7 + i} a.m.", metadata={"source": f"{t}.txt", "title": t.title()}, id=f"id-{t}")
            for i, t in enumerate(TOPICS)
        ]
    )
    r = SnapKVStuffingRetriever.from_vectorstore(vs, engine=tiny_engine, context_tokens=60, max_new_tokens=8)
    docs = r.invoke("When does the ferry open?")
    assert docs[0].id == "id-ferry" and docs[0].metadata["source"] == "ferry.txt"
    assert docs[0].metadata["score"] is not None
    assert 1 <= len(docs) < len(TOPICS)  # 60 LLM tokens hold only some of them
    assert r.embedder is embedder
    # Any retriever works too (its order is kept), and a whole Chroma collection in source order.
    r2 = SnapKVStuffingRetriever.from_retriever(vs.as_retriever(search_kwargs={"k": 2}), engine=tiny_engine)
    assert [d.id for d in r2.invoke("ferry")][:1] == ["id-ferry"]
    whole = SnapKVStuffingRetriever.from_vectorstore(vs, engine=tiny_engine, whole_collection=True, max_new_tokens=16).invoke("x")
    assert sorted(d.metadata["source"] for d in whole) == [d.metadata["source"] for d in whole]
    assert len(whole) == len(TOPICS)
    with pytest.raises(TypeError):
        SnapKVStuffingRetriever.from_vectorstore(object(), engine=tiny_engine)


class _Fixed(BaseRetriever):
    docs: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.docs


def test_cited_chain_maps_citations_to_documents(store, tiny_engine, embedder):
    docs = [
        Document(page_content="The ferry leaves at 6:40 on weekdays.", metadata={"source": "ferry.md", "title": "Ferry"}, id="f"),
        Document(page_content="The museum closes on Mondays.", metadata={"source": "museum.md", "title": "Museum"}, id="m"),
    ]
    prompt = cited_prompt({"question": "When does the ferry leave?", "documents": docs})
    assert isinstance(prompt[0], SystemMessage) and "[1] Ferry" in prompt[1].content
    assert prompt[1].content.rstrip().endswith("Question: When does the ferry leave?")

    class Canned(ChatSnapKV):
        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            from langchain_core.outputs import ChatGeneration, ChatResult

            assert messages[1].content == prompt[1].content
            return ChatResult(generations=[ChatGeneration(message=AIMessage("The ferry leaves at 6:40 on weekdays [1] [5]."))])

    chain = create_cited_qa_chain(Canned(engine=tiny_engine), _Fixed(docs=docs), embedder=embedder)
    out = chain.invoke("When does the ferry leave?")
    assert out["answer"].startswith("The ferry leaves") and out["documents"] == docs
    assert out["invalid_citations"] == [5]
    routes = {(c["route"], c["document"].id) for c in out["citations"]}
    assert ("generated", "f") in routes and ("attributed", "f") in routes
    assert all(c["document"] in docs for c in out["citations"])
    assert chain.invoke({"question": "When does the ferry leave?"})["answer"] == out["answer"]


def test_chat_model_reuses_the_documents_the_retriever_offered(store, root_helpers):
    engine = root_helpers.tiny_engine("llama", context=4096)
    retriever = SnapKVStuffingRetriever(store=store, engine=engine, context_tokens=300, max_new_tokens=4)
    chain = create_cited_qa_chain(ChatSnapKV(engine=engine, max_tokens=2, compression=None), retriever)
    first = chain.invoke("Which code has the bakery?")
    stored = engine.segment_store.stats.misses
    assert stored == len(first["documents"]) > 1 and engine.segment_store.stats.hits == 0
    chain.invoke("Which code has the garden?")  # overlapping documents, other order: the stored ones are hits
    assert engine.segment_store.stats.hits >= 1
    hits = engine.segment_store.stats.hits
    create_cited_qa_chain(ChatSnapKV(engine=engine, max_tokens=2, compression=None, kv_reuse="prefix"), retriever).invoke("Which code has the bakery?")
    assert engine.segment_store.stats.hits == hits
    with pytest.raises(ValueError, match="kv_reuse"):
        ChatSnapKV(engine=engine, kv_reuse="maybe")


def test_cited_chain_end_to_end_on_a_tiny_engine(store, tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=8, compression="snapkv:budget=128,window=question")
    retriever = SnapKVStuffingRetriever(store=store, engine=tiny_engine, context_tokens=200, max_new_tokens=8)
    out = create_cited_qa_chain(llm, retriever).invoke("Which code has the bakery?")
    assert out["documents"] and isinstance(out["message"], AIMessage)
    assert out["message"].response_metadata["compression"]["window_size"] == "question"
    assert all(1 <= c["number"] <= len(out["documents"]) for c in out["citations"])


def test_a_rolling_chat_model_lets_the_retriever_stuff_past_the_window(store, tiny_engine):
    """With ChatSnapKV's compression rolling, context_tokens may exceed the model's window; the
    chain then answers from a prompt longer than the window. Without it the budget is refused."""
    from snapkv_rag.rag.stuffing import ContextBudgetError

    llm = ChatSnapKV(engine=tiny_engine, max_tokens=4, compression="snapkv:budget=64,window=question,max_window=32,rolling=128")
    retriever = SnapKVStuffingRetriever(store=store, engine=tiny_engine, llm=llm, context_tokens=2000, max_new_tokens=4, whole_collection=True)
    ctx = retriever.stuff("ferry code")
    assert ctx.prompt_tokens > tiny_engine.context_length
    answer = create_cited_qa_chain(llm, retriever).invoke("Which code has the ferry?")
    assert answer["answer"] is not None
    reply = llm.invoke(ctx.messages)
    assert reply.response_metadata["snapkv_stats"]["policy_stats"]["rolled_chunks"] > 1
    with pytest.raises(ContextBudgetError, match="rolling="):
        SnapKVStuffingRetriever(store=store, engine=tiny_engine, context_tokens=2000, max_new_tokens=4).stuff("ferry code")


def test_chat_history_on_agent_memory(tmp_path, tiny_engine):
    history = SnapKVChatMessageHistory(str(tmp_path / "m.sqlite3"), "t1")
    msgs = [
        SystemMessage("sys"),
        HumanMessage("read the log"),
        AIMessage("", tool_calls=[{"name": "read_log", "args": {"part": 1}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("line " * 50, tool_call_id="c1", name="read_log"),
        AIMessage("done"),
    ]
    history.add_messages(msgs)
    again = SnapKVChatMessageHistory(AgentMemory(tmp_path / "m.sqlite3"), "t1").messages  # survives reopening
    assert [type(m) for m in again] == [type(m) for m in msgs]
    assert again[2].tool_calls[0]["args"] == {"part": 1} and again[3].content == msgs[3].content
    fitted = history.fitted_messages(tiny_engine, max_new_tokens=8)
    assert [m.content for m in fitted] == [m.content for m in again]
    history.clear()
    assert history.messages == []


def test_fitted_messages_of_a_new_thread(tmp_path, tiny_engine):
    history = SnapKVChatMessageHistory(str(tmp_path / "n.sqlite3"), "new")
    assert history.fitted_messages(tiny_engine) == []
    history.add_messages([SystemMessage("sys")])
    assert [m.content for m in history.fitted_messages(tiny_engine)] == ["sys"]
