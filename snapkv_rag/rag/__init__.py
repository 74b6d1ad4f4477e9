"""Documents in Chroma, stuffed into one long prompt, answered with citations through the engine."""

from .attribution import EvidenceAttributor
from .chunking import Chunk, ChunkingError, chunk_document
from .embeddings import Embedder
from .loaders import Skipped, SourceText, load_file
from .qa import DEFAULT_COMPRESSION, Answer, AnswerStream, Citation, DocumentQA
from .store import DocumentStore, IngestReport, StoreError, StoreUnavailableError, StoredChunk
from .stuffing import ContextBudgetError, EmptyCollectionError, StuffedContext, StuffingRetriever, build_messages

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
    "Skipped",
    "SourceText",
    "StoreError",
    "StoreUnavailableError",
    "StoredChunk",
    "StuffedContext",
    "StuffingRetriever",
    "build_messages",
    "chunk_document",
    "load_file",
]
