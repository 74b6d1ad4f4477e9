"""SnapKVEmbeddings: the toolkit's offline embedder (all-MiniLM-L6-v2) as LangChain ``Embeddings``.

Use it with any LangChain vector store (``langchain_chroma.Chroma(embedding_function=...)``)
so the store never loads or downloads Chroma's default embedder.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.embeddings import Embeddings

from snapkv_rag.integrations import Embedder


class SnapKVEmbeddings(Embeddings):
    """Wraps :class:`snapkv_rag.rag.Embedder` (normalized vectors, cosine = dot product).

    ``SnapKVEmbeddings()`` loads the embedded all-MiniLM-L6-v2 offline on first use;
    ``SnapKVEmbeddings(model="path/to/sentence-transformers-model")`` another one;
    ``SnapKVEmbeddings(embedder=store.embedder)`` shares a store's.
    """

    def __init__(self, model: str | None = None, *, embedder: Embedder | None = None, **options: Any):
        if embedder is not None and (model is not None or options):
            raise ValueError("pass either embedder= or model=/options, not both")
        self.embedder = embedder or (Embedder(model, **options) if model else Embedder(**options))

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(list(texts)) if texts else []

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text)

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        return await asyncio.to_thread(self.embed_query, text)
