"""SnapKVStuffingRetriever: as many relevant chunks as fit the LLM's token budget, as LangChain Documents.

Over the toolkit's own Chroma store (:class:`snapkv_rag.rag.DocumentStore`), or over any
LangChain vector store or retriever a user already has (``langchain_chroma.Chroma`` and the
rest): the packing itself is always :class:`snapkv_rag.rag.StuffingRetriever`'s, counted in
the LLM's tokens; this module only translates between Documents and stored chunks.
"""

from __future__ import annotations

import hashlib
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field

from snapkv_rag import Engine
from snapkv_rag.integrations import SYSTEM_PROMPT, DocumentStore, StoredChunk, StuffedContext, StuffingRetriever, as_policy, can_roll, offer_segments


def chunk_to_document(number: int, chunk: StoredChunk) -> Document:
    """Chunk ``number`` of a stuffed prompt as a Document; the metadata says where it came from."""
    metadata = {
        **chunk.metadata,
        "number": number,
        "chunk_id": chunk.id,
        "source": chunk.source,
        "title": chunk.title,
        "position": chunk.position,
        "score": chunk.score,
    }
    return Document(page_content=chunk.text, metadata=metadata, id=chunk.id)


def document_to_chunk(doc: Document, score: float | None = None) -> StoredChunk:
    """A Document (from any LangChain store) as a stored chunk; ids fall back to a content hash."""
    meta = dict(doc.metadata or {})
    cid = doc.id or meta.get("chunk_id") or hashlib.sha1(doc.page_content.encode()).hexdigest()[:20]
    source = str(meta.get("source", meta.get("file", "")))
    return StoredChunk(
        id=str(cid),
        text=doc.page_content,
        source=source,
        title=str(meta.get("title", "")),
        position=int(meta.get("position", 0) or 0),
        tokens=int(meta.get("tokens", 0) or 0),
        score=score if score is not None else meta.get("score"),
        metadata={**meta, "file": str(meta.get("file", source))},
    )


class LangChainChunkSource:
    """A LangChain vector store or retriever in the shape :class:`StuffingRetriever` reads.

    ``count()`` is unknown for a generic store and reported as 1, so an empty result is an
    empty list of Documents (LangChain's convention), not an "empty collection" error.
    """

    def __init__(self, source: VectorStore | BaseRetriever, name: str = "langchain"):
        if not isinstance(source, (VectorStore, BaseRetriever)):
            raise TypeError(f"expected a LangChain VectorStore or BaseRetriever, got {type(source).__name__}")
        self.source = source
        self.name = name

    def count(self) -> int:
        return 1

    def search(self, query: str, n: int, where: dict[str, Any] | None = None) -> list[StoredChunk]:
        if isinstance(self.source, VectorStore):
            extra = {"filter": where} if where else {}
            try:
                pairs = self.source.similarity_search_with_relevance_scores(query, k=n, **extra)
            except NotImplementedError:
                pairs = [(d, None) for d in self.source.similarity_search(query, k=n, **extra)]
            return [document_to_chunk(d, s) for d, s in pairs]
        if where:
            raise ValueError("a where= filter needs a vector store; configure the filter on the retriever instead")
        return [document_to_chunk(d) for d in self.source.invoke(query)[:n]]

    def all_chunks(self, where: dict[str, Any] | None = None) -> list[StoredChunk]:
        get = getattr(self.source, "get", None)  # langchain_chroma.Chroma.get
        if get is None:
            raise ValueError("whole_collection needs a vector store with get() (such as langchain_chroma.Chroma)")
        got = get(where=where, include=["documents", "metadatas"]) if where else get(include=["documents", "metadatas"])
        chunks = [document_to_chunk(Document(page_content=t, metadata=m or {}, id=i)) for i, t, m in zip(got["ids"], got["documents"], got["metadatas"])]
        return sorted(chunks, key=lambda c: (c.file, c.source, c.position))


class SnapKVStuffingRetriever(BaseRetriever):
    """Retrieve by similarity, then keep as many chunks as fit the LLM's token budget.

    ``store``: a :class:`snapkv_rag.rag.DocumentStore` (see :meth:`from_vectorstore` and
    :meth:`from_retriever` for LangChain stores). ``engine`` or ``llm`` (a ``ChatSnapKV``):
    whose tokenizer and context count. ``context_tokens``: tokens for the documents (default:
    the model's context minus ``max_new_tokens`` and the rest of the prompt). ``k``: at most
    this many chunks (also per call: ``invoke(q, k=3)``). ``min_score``, ``where``, ``order``
    and ``whole_collection`` as in :class:`snapkv_rag.rag.StuffingRetriever`. ``past_window``: see the field.

    Each Document's metadata carries ``number`` (its ``[n]`` in the stuffed prompt),
    ``chunk_id``, ``source``, ``title``, ``position``, ``score`` and the store's metadata.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: Any
    engine: Any = Field(default=None, exclude=True)
    llm: Any = Field(default=None, exclude=True)
    context_tokens: int | None = None
    max_new_tokens: int = 256
    k: int | None = None
    min_score: float | None = None
    where: dict[str, Any] | None = None
    order: str = "score"
    whole_collection: bool = False
    system_prompt: str = SYSTEM_PROMPT
    past_window: bool = False
    """``context_tokens`` may exceed the model's window: the chat model's compression reads the
    prompt with a rolling prefill (``rolling=``). On by itself when ``llm``'s compression can roll (a sparse policy)."""

    @classmethod
    def from_vectorstore(cls, vectorstore: VectorStore, **kwargs: Any) -> SnapKVStuffingRetriever:
        """Pack the results of any LangChain vector store (e.g. ``langchain_chroma.Chroma``)."""
        return cls(store=LangChainChunkSource(vectorstore), **kwargs)

    @classmethod
    def from_retriever(cls, retriever: BaseRetriever, **kwargs: Any) -> SnapKVStuffingRetriever:
        """Pack the Documents any LangChain retriever returns, in its order."""
        return cls(store=LangChainChunkSource(retriever), **kwargs)

    def _engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.llm is not None:
            return self.llm.client
        from snapkv_rag.integrations import shared_engine

        return shared_engine("default")

    def core(self, k: int | None = None) -> StuffingRetriever:
        """The core retriever with these settings (``k`` overrides the field)."""
        return StuffingRetriever(
            self.store,
            self._engine(),
            context_tokens=self.context_tokens,
            max_new_tokens=self.max_new_tokens,
            top_k=k if k is not None else self.k,
            min_score=self.min_score,
            where=self.where,
            order=self.order,
            whole_collection=self.whole_collection,
            system_prompt=self.system_prompt,
            past_window=self.past_window or (self.llm is not None and can_roll(as_policy(self.llm.compression))),
        )

    def stuff(self, query: str, *, k: int | None = None) -> StuffedContext:
        """The full packing result (chunks, token counts, what was left out, the messages)."""
        return self.core(k).retrieve(query)

    @property
    def embedder(self):
        """The snapkv_rag Embedder behind the store, when it has one (for attributed citations)."""
        if isinstance(self.store, DocumentStore):
            return self.store.embedder
        source = getattr(self.store, "source", None)
        embeddings = getattr(source, "embeddings", None) or getattr(getattr(source, "vectorstore", None), "embeddings", None)
        return getattr(embeddings, "embedder", None)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None) -> list[Document]:
        context = self.stuff(query, k=k)
        offer_segments(context.segments)  # ChatSnapKV(kv_reuse="chunks") reuses their K/V wherever they land in a prompt
        return [chunk_to_document(i + 1, c) for i, c in enumerate(context.chunks)]
