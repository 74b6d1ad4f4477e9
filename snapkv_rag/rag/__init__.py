"""Documents in Chroma, stuffed into one long prompt, answered with citations through the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Loaded on first use, so building the CLI parser (``snapkv-rag --help``) imports no torch.
_LAZY = {
    "EvidenceAttributor": "attribution",
    "Chunk": "chunking",
    "ChunkingError": "chunking",
    "chunk_document": "chunking",
    "Embedder": "embeddings",
    "Skipped": "loaders",
    "SourceText": "loaders",
    "load_file": "loaders",
    "DEFAULT_COMPRESSION": "qa",
    "Answer": "qa",
    "AnswerStream": "qa",
    "Citation": "qa",
    "DocumentQA": "qa",
    "cite": "qa",
    "cite_with_support": "qa",
    "Reranked": "rerank",
    "attention_rerank": "rerank",
    "DocumentStore": "store",
    "IngestReport": "store",
    "StoreError": "store",
    "StoreUnavailableError": "store",
    "StoredChunk": "store",
    "ContextBudgetError": "stuffing",
    "EmptyCollectionError": "stuffing",
    "StuffedContext": "stuffing",
    "StuffingRetriever": "stuffing",
    "build_messages": "stuffing",
}

if TYPE_CHECKING:  # pragma: no cover
    from .attribution import EvidenceAttributor
    from .chunking import Chunk, ChunkingError, chunk_document
    from .embeddings import Embedder
    from .loaders import Skipped, SourceText, load_file
    from .qa import DEFAULT_COMPRESSION, Answer, AnswerStream, Citation, DocumentQA, cite, cite_with_support
    from .rerank import Reranked, attention_rerank
    from .store import DocumentStore, IngestReport, StoredChunk, StoreError, StoreUnavailableError
    from .stuffing import ContextBudgetError, EmptyCollectionError, StuffedContext, StuffingRetriever, build_messages


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapkv_rag.rag' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Answer",
    "AnswerStream",
    "Chunk",
    "ChunkingError",
    "Citation",
    "ContextBudgetError",
    "DEFAULT_COMPRESSION",
    "DocumentQA",
    "EmptyCollectionError",
    "DocumentStore",
    "Embedder",
    "EvidenceAttributor",
    "IngestReport",
    "Reranked",
    "Skipped",
    "SourceText",
    "StoreError",
    "StoreUnavailableError",
    "StoredChunk",
    "StuffedContext",
    "StuffingRetriever",
    "attention_rerank",
    "build_messages",
    "chunk_document",
    "cite",
    "cite_with_support",
    "load_file",
]
