"""What integrations build on: the one module the LangChain and LlamaIndex connectors, the app
and your own framework glue import (besides :mod:`snapkv_rag` and :mod:`snapkv_rag.errors`).

Everything here is public and kept stable; the modules that define these names (``rag.store``,
``reuse.offered``, ``engine.shared`` ...) are internal and may move. Users' own code may also use the
subpackages' facades (``snapkv_rag.rag``, ``.agents``, ``.compression``, ``.tools``: their ``__all__``);
the connectors and the app import only this module, :mod:`snapkv_rag` and :mod:`snapkv_rag.errors`.
Loaded on first use, so importing this module imports no torch.

- **Engines**: :func:`shared_engine` (one engine per model and options, shared by every wrapper in
  the process), :data:`DEFAULT_COMPRESSION` (the one default of every interface), :func:`as_policy` and
  :func:`parse_compression` (a spec string, a policy or None to a policy), :func:`can_roll`,
  :func:`reads_past_window` and :func:`fit_to_window` (the one rule for prompts past the window), :class:`LESS`,
  :func:`recording_kept_indices` (which prompt entries each layer kept), :func:`declared_context_length`
  (a model's window read from its config or GGUF header, without loading it).
- **Documents**: :class:`DocumentStore` (its errors :class:`StoreError`, :class:`StoreUnavailableError`,
  :class:`EmptyCollectionError`), :class:`DocumentQA` and its :class:`Answer`,
  :class:`StuffingRetriever` and :class:`StuffedContext`, :func:`build_messages` and
  :data:`SYSTEM_PROMPT` (the stuffed prompt), :func:`pack_greedy` (fill a token budget),
  :class:`Embedder` and :func:`default_embedder_path`, :func:`make_client` (a Chroma client),
  :func:`attention_rerank` and its :class:`Reranked` (rank any texts for a question by the model's attention).
- **Citations**: :func:`parse_citations`, :func:`cite_with_support` over the routes in
  :data:`TEXT_ROUTES`, :class:`EvidenceAttributor`, :func:`citation_prf`,
  :func:`kept_per_document` (what compression kept of each cited document).
- **Chunk K/V reuse**: :func:`offer_segments` (mark stuffed chunks as reusable segments),
  :func:`check_kv_reuse`, :func:`resolve_kv_reuse`, :func:`reuse_kwargs`, :func:`segment_store_at`.
- **Agents**: :class:`AgentMemory` and :class:`RenderedHistory` (long tool logs kept on disk).
- **Intake** (what the app's upload and folder panels use): :data:`SUPPORTED_SUFFIXES`,
  :func:`save_uploads`, :func:`folder_files`, :func:`remove_skipped_uploads`, :class:`Upload`, :data:`DEFAULT_MAX_FILE_BYTES` (the largest file read),
  :class:`IntakeError`, :class:`IngestReport`, :class:`Skipped`, :func:`validate_collection_name`,
  :func:`default_store_dir`, :func:`cache_root`.
- **Adapters**: :func:`adapter_option` and :data:`AUTO` (the ``--adapter`` value every command takes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    # engines and compression
    "shared_engine": "engine.shared",
    "as_policy": "compression",
    "parse_compression": "compression",
    "DEFAULT_COMPRESSION": "compression",
    "can_roll": "compression",
    "fit_to_window": "compression",
    "reads_past_window": "compression",
    "LESS": "compression",
    "recording_kept_indices": "compression",
    "declared_context_length": "model.loading",
    # documents
    "DocumentStore": "rag.store",
    "StoredChunk": "rag.store",
    "IngestReport": "rag.store",
    "StoreError": "rag.store",
    "StoreUnavailableError": "rag.store",
    "make_client": "rag.store",
    "default_store_dir": "rag.store",
    "validate_collection_name": "rag.store",
    "DocumentQA": "rag.qa",
    "Reranked": "rag.rerank",
    "attention_rerank": "rag.rerank",
    "Answer": "rag.qa",
    "TEXT_ROUTES": "rag.qa",
    "cite_with_support": "rag.qa",
    "small_model_note": "rag.qa",
    "StuffingRetriever": "rag.stuffing",
    "StuffedContext": "rag.stuffing",
    "ContextBudgetError": "rag.stuffing",
    "EmptyCollectionError": "rag.stuffing",
    "SYSTEM_PROMPT": "rag.stuffing",
    "build_messages": "rag.stuffing",
    "pack_greedy": "rag.packing",
    "Embedder": "rag.embeddings",
    "default_embedder_path": "rag.embeddings",
    # citations
    "parse_citations": "rag.citations",
    "EvidenceAttributor": "rag.attribution",
    "citation_prf": "harness.metrics",
    "kept_per_document": "rag.kept",
    "DocumentKept": "rag.kept",
    # chunk K/V reuse
    "offer_segments": "reuse.offered",
    "check_kv_reuse": "reuse.offered",
    "resolve_kv_reuse": "reuse.offered",
    "reuse_kwargs": "reuse.offered",
    "segment_store_at": "reuse.offered",
    # agents
    "AgentMemory": "agents",
    "RenderedHistory": "agents",
    # intake
    "SUPPORTED_SUFFIXES": "rag.loaders",
    "DEFAULT_MAX_FILE_BYTES": "rag.loaders",
    "Skipped": "rag.loaders",
    "IntakeError": "rag.intake",
    "Upload": "rag.intake",
    "folder_files": "rag.intake",
    "remove_skipped_uploads": "rag.intake",
    "save_uploads": "rag.intake",
    "cache_root": "model.loading",
    # adapters
    "AUTO": "model.adapter_rule",
    "AUTO_DOCUMENTS": "model.adapter_rule",
    "AUTOS": "model.adapter_rule",
    "adapter_option": "model.shipped_adapters",
}

if TYPE_CHECKING:  # the same names for type checkers (a test keeps these and _LAZY equal)
    from .agents import AgentMemory as AgentMemory
    from .agents import RenderedHistory as RenderedHistory
    from .compression import DEFAULT_COMPRESSION as DEFAULT_COMPRESSION
    from .compression import LESS as LESS
    from .compression import as_policy as as_policy
    from .compression import can_roll as can_roll
    from .compression import fit_to_window as fit_to_window
    from .compression import parse_compression as parse_compression
    from .compression import reads_past_window as reads_past_window
    from .compression import recording_kept_indices as recording_kept_indices
    from .engine.shared import shared_engine as shared_engine
    from .harness.metrics import citation_prf as citation_prf
    from .model.adapter_rule import AUTO as AUTO
    from .model.adapter_rule import AUTO_DOCUMENTS as AUTO_DOCUMENTS
    from .model.adapter_rule import AUTOS as AUTOS
    from .model.loading import cache_root as cache_root
    from .model.loading import declared_context_length as declared_context_length
    from .model.shipped_adapters import adapter_option as adapter_option
    from .rag.attribution import EvidenceAttributor as EvidenceAttributor
    from .rag.citations import parse_citations as parse_citations
    from .rag.embeddings import Embedder as Embedder
    from .rag.embeddings import default_embedder_path as default_embedder_path
    from .rag.intake import IntakeError as IntakeError
    from .rag.intake import Upload as Upload
    from .rag.intake import folder_files as folder_files
    from .rag.intake import remove_skipped_uploads as remove_skipped_uploads
    from .rag.intake import save_uploads as save_uploads
    from .rag.kept import DocumentKept as DocumentKept
    from .rag.kept import kept_per_document as kept_per_document
    from .rag.loaders import DEFAULT_MAX_FILE_BYTES as DEFAULT_MAX_FILE_BYTES
    from .rag.loaders import SUPPORTED_SUFFIXES as SUPPORTED_SUFFIXES
    from .rag.loaders import Skipped as Skipped
    from .rag.packing import pack_greedy as pack_greedy
    from .rag.qa import TEXT_ROUTES as TEXT_ROUTES
    from .rag.qa import Answer as Answer
    from .rag.qa import DocumentQA as DocumentQA
    from .rag.qa import cite_with_support as cite_with_support
    from .rag.qa import small_model_note as small_model_note
    from .rag.rerank import Reranked as Reranked
    from .rag.rerank import attention_rerank as attention_rerank
    from .rag.store import DocumentStore as DocumentStore
    from .rag.store import IngestReport as IngestReport
    from .rag.store import StoredChunk as StoredChunk
    from .rag.store import StoreError as StoreError
    from .rag.store import StoreUnavailableError as StoreUnavailableError
    from .rag.store import default_store_dir as default_store_dir
    from .rag.store import make_client as make_client
    from .rag.store import validate_collection_name as validate_collection_name
    from .rag.stuffing import SYSTEM_PROMPT as SYSTEM_PROMPT
    from .rag.stuffing import ContextBudgetError as ContextBudgetError
    from .rag.stuffing import EmptyCollectionError as EmptyCollectionError
    from .rag.stuffing import StuffedContext as StuffedContext
    from .rag.stuffing import StuffingRetriever as StuffingRetriever
    from .rag.stuffing import build_messages as build_messages
    from .reuse.offered import check_kv_reuse as check_kv_reuse
    from .reuse.offered import offer_segments as offer_segments
    from .reuse.offered import resolve_kv_reuse as resolve_kv_reuse
    from .reuse.offered import reuse_kwargs as reuse_kwargs
    from .reuse.offered import segment_store_at as segment_store_at

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapkv_rag.integrations' has no attribute {name!r}")
    # Looked up on every access, not cached here: the defining module stays the one place to patch.
    return getattr(importlib.import_module(f"snapkv_rag.{module}"), name)


def __dir__() -> list[str]:
    return list(__all__)
