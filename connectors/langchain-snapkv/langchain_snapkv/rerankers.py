"""SnapKVAttentionReranker: rerank retrieved Documents by the model's own attention.

A LangChain document compressor (``ContextualCompressionRetriever(base_compressor=...)``, or a
step of an LCEL chain). The ranking is :func:`snapkv_rag.integrations.attention_rerank`: the
documents are stuffed as numbered documents after the query, read once (a prefill that stops
after the deepest layer the scoring heads are in, no token generated) and each is scored by its
share of the query's attention on the documents. This module only translates Documents.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.callbacks import Callbacks
from langchain_core.documents import Document
from langchain_core.documents.compressor import BaseDocumentCompressor
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from snapkv_rag.integrations import Reranked, as_policy, attention_rerank, shared_engine


class SnapKVAttentionReranker(BaseDocumentCompressor):
    """Reorder Documents by the share of the query's attention each gets from the model (best first).

    ``llm``: a :class:`~langchain_snapkv.ChatSnapKV` whose engine (``llm.client``) reads the
    documents, or ``engine``: a :class:`snapkv_rag.Engine` (neither: the embedded model's shared
    engine). ``top_n``: keep the best this many (None: all). ``budget_tokens``: then keep the best
    that fit this many of the model's tokens, each document counted as it would be stuffed (its
    ``[n]`` label included). ``fusion``: ``"attention"`` alone, or ``"rrf"`` (reciprocal-rank
    fusion with the input order). ``heads``: ``"auto"`` (the heads shipped for the model, else every
    head of the middle layers), None (every head of the middle layers) or (layer, head) pairs.
    ``compression``: the policy of the read (default: the toolkit's default); it needs an
    observation window, so ``None``/``"full"`` is an error. ``stored_keys``: skim from the engine's
    stored keys (its ``segment_store``): a text seen for an earlier query is placed from its stored
    K/V instead of read again (the first time it is computed and stored).

    Returns copies of the Documents (ids kept) whose metadata gains ``attention_score`` (its share;
    the shares of all input documents sum to 1) and ``attention_rank`` (1-based among all of them).
    ``last_rerank`` is the latest :class:`snapkv_rag.integrations.Reranked` (``seconds``, ``prompt_tokens``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    llm: Any = Field(default=None, exclude=True)
    """A ChatSnapKV whose engine reads the documents."""
    engine: Any = Field(default=None, exclude=True)
    """A snapkv_rag.Engine (instead of ``llm``)."""
    top_n: int | None = Field(default=None, gt=0)
    """Keep the best this many documents (None: all)."""
    budget_tokens: int | None = Field(default=None, gt=0)
    """Then keep the best that fit this many of the model's tokens."""
    fusion: Literal["attention", "rrf"] = "attention"
    """``"attention"`` alone or ``"rrf"`` fused with the input order."""
    heads: Any = "auto"
    """``"auto"``, None (the middle layers' heads) or (layer, head) pairs."""
    compression: Any = "default"
    """Policy or spec string of the read (default: the toolkit's default); needs an observation window."""
    stored_keys: bool = False
    """Skim from the engine's stored K/V: a text seen for an earlier query is not read again."""

    _last: Reranked | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> SnapKVAttentionReranker:
        if self.llm is not None and self.engine is not None:
            raise ValueError("give llm= or engine=, not both")
        if self.llm is not None and not hasattr(type(self.llm), "client"):  # the class: .client loads the engine
            raise TypeError(f"llm must be a ChatSnapKV (a chat model with an engine as .client), got {type(self.llm).__name__}")
        if as_policy(self.compression) is None:  # an invalid spec fails here, not at the first query
            raise ValueError("the reranker reads with a compression policy that has an observation window; compression=None/'full' has none")
        return self

    @property
    def last_rerank(self) -> Reranked | None:
        return self._last

    def _engine(self) -> Any:
        if self.engine is not None:
            return self.engine
        if self.llm is not None:
            return self.llm.client
        return shared_engine("default")

    def rerank(self, documents: Sequence[Document], query: str) -> Reranked:
        """The full ranking of ``documents`` for ``query`` (all of them, and what the budget keeps)."""
        return attention_rerank(
            self._engine(),
            query,
            [d.page_content for d in documents],
            budget_tokens=self.budget_tokens,
            compression=self.compression,
            heads=self.heads,
            fusion=self.fusion,
            stored_keys=True if self.stored_keys else None,
        )

    def compress_documents(self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The documents best first, cut to ``top_n`` and then to ``budget_tokens``."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("SnapKVAttentionReranker ranks documents for a query: the query is empty")
        if not documents:
            return []
        reranked = self.rerank(documents, query)
        self._last = reranked
        chosen = reranked.chosen(self.top_n)
        ranks = reranked.ranks
        return [
            documents[i].model_copy(update={"metadata": {**documents[i].metadata, "attention_score": reranked.scores[i], "attention_rank": ranks[i]}})
            for i in chosen
        ]

    async def acompress_documents(self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None) -> Sequence[Document]:
        """:meth:`compress_documents` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.compress_documents, documents, query, callbacks)
