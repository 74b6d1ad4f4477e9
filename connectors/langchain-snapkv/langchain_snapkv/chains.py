"""An LCEL chain for cited answers over stuffed documents.

::

    chain = create_cited_qa_chain(ChatSnapKV(), SnapKVStuffingRetriever(store=store))
    out = chain.invoke("When does the first ferry leave?")
    out["answer"], out["citations"], out["documents"]

The chain is ``retriever -> numbered prompt -> ChatSnapKV -> citations``: the prompt is the
RAG core's (:func:`snapkv_rag.rag.build_messages`: documents ``[1]..[N]``, the question
last, where SnapKV's observation window looks) and the citations come from
:func:`snapkv_rag.rag.cite` (the model's own ``[n]`` markers, route ``generated``, and
sentence-to-document evidence matching, route ``attributed``).
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from snapkv_rag.integrations import SYSTEM_PROMPT, TEXT_ROUTES, EvidenceAttributor, build_messages, cite_with_support

from .chat_models import from_engine_messages
from .retrievers import document_to_chunk


def _question(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"question": value}
    if isinstance(value, dict) and isinstance(value.get("question"), str):
        return dict(value)
    raise TypeError("the chain takes a question string or {'question': str}")


def cited_prompt(inputs: dict[str, Any], system_prompt: str = SYSTEM_PROMPT) -> list[BaseMessage]:
    """The numbered-documents prompt for ``inputs["question"]`` over ``inputs["documents"]`` (in order)."""
    chunks = [document_to_chunk(d) for d in inputs["documents"]]
    messages, _ = build_messages(inputs["question"], chunks, system_prompt)
    return from_engine_messages(messages)


def create_cited_qa_chain(
    llm: Runnable,
    retriever: Runnable,
    *,
    embedder: Any = None,
    routes: tuple[str, ...] = TEXT_ROUTES,
    system_prompt: str = SYSTEM_PROMPT,
) -> Runnable[Any, dict[str, Any]]:
    """A chain from a question to ``{"question", "answer", "citations", "documents", "message"}``.

    ``llm``: a ``ChatSnapKV`` (or one bound with per-call options, e.g.
    ``llm.bind(compression="snapkv:budget=512")``). ``retriever``: any retriever returning
    the Documents to stuff, in prompt order (``SnapKVStuffingRetriever`` packs them to the
    LLM's token budget). ``embedder``: a :class:`snapkv_rag.rag.Embedder` for the
    ``attributed`` route (default: the retriever's, else the embedded MiniLM).

    Each citation is ``{"number", "route", "document", "score", "sentence"}`` where
    ``document`` is the cited Document itself; ``invalid_citations`` lists ``[n]`` markers
    that point at no document; ``unsupported`` lists the answer sentences whose numbers, names
    or dates appear in no document (``missing``), cited nowhere or only where their other facts are.
    """
    attributor = None
    if "attributed" in routes:
        embedder = embedder or getattr(retriever, "embedder", None)
        if embedder is None:
            from snapkv_rag.integrations import Embedder

            embedder = Embedder()
        attributor = EvidenceAttributor(getattr(embedder, "embedder", embedder))

    def answer(inputs: dict[str, Any]) -> dict[str, Any]:
        documents: list[Document] = inputs["documents"]
        message = inputs["message"]
        text = message.content if isinstance(message.content, str) else message.text
        chunks = [document_to_chunk(d) for d in documents]
        citations, invalid, support = cite_with_support(inputs["question"], text, chunks, attributor, routes)
        return {
            "question": inputs["question"],
            "answer": text,
            "citations": [
                {"number": c.number, "route": c.route, "document": documents[c.number - 1], "score": c.score, "sentence": c.sentence} for c in citations
            ],
            "invalid_citations": invalid,
            # sentences whose numbers, names or dates no document contains (nothing cited), or only partly
            "unsupported": [{"sentence": s.sentence, "missing": list(s.missing), "cited": list(s.numbers)} for s in support if s.missing],
            "documents": documents,
            "message": message,
        }

    prompt = RunnableLambda(lambda inputs: cited_prompt(inputs, system_prompt), name="cited_prompt")
    return (
        RunnableLambda(_question, name="question")
        | RunnablePassthrough.assign(documents=(lambda x: x["question"]) | retriever)
        | RunnablePassthrough.assign(message=prompt | llm)
        | RunnableLambda(answer, name="cite")
    ).with_config(run_name="cited_qa")
