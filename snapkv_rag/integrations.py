"""What integrations build on: the one module the LangChain and LlamaIndex connectors, the app
and your own framework glue import (besides :mod:`snapkv_rag` and :mod:`snapkv_rag.errors`).

Everything here is public and kept stable; the subpackages behind it may move. Loaded on first
use, so importing this module imports no torch.

- **Engines**: :func:`shared_engine` (one engine per model and options, shared by every wrapper in
  the process), :func:`as_policy` (a spec string, a policy or None to a policy), :class:`LESS`,
  :func:`recording_kept_indices` (which prompt entries each layer kept).
- **Documents**: :class:`DocumentStore`, :class:`DocumentQA` and its :class:`Answer`,
  :class:`StuffingRetriever` and :class:`StuffedContext`, :func:`build_messages` and
  :data:`SYSTEM_PROMPT` (the stuffed prompt), :func:`pack_greedy` (fill a token budget),
  :class:`Embedder` and :func:`default_embedder_path`, :func:`make_client` (a Chroma client).
- **Citations**: :func:`parse_citations`, :func:`cite_with_support` over the routes in
  :data:`TEXT_ROUTES`, :class:`EvidenceAttributor`, :func:`citation_prf`,
  :func:`kept_per_document` (what compression kept of each cited document).
- **Chunk K/V reuse**: :func:`offer_segments` (mark stuffed chunks as reusable segments),
  :func:`check_kv_reuse`, :func:`resolve_kv_reuse`, :func:`reuse_kwargs`, :func:`segment_store_at`.
- **Agents**: :class:`AgentMemory` and :class:`RenderedHistory` (long tool logs kept on disk).
- **Intake** (what the app's upload and folder panels use): :data:`SUPPORTED_SUFFIXES`,
  :func:`save_uploads`, :func:`folder_files`, :func:`remove_skipped_uploads`, :class:`Upload`,
  :class:`IntakeError`, :class:`IngestReport`, :class:`Skipped`, :func:`validate_collection_name`,
  :func:`default_store_dir`, :func:`cache_root`.
- **Adapters**: :func:`adapter_option` and :data:`AUTO` (the ``--adapter`` value every command takes).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # engines and compression
    "shared_engine": "engine.shared",
    "as_policy": "compression",
    "LESS": "compression",
    "recording_kept_indices": "compression",
    # documents
    "DocumentStore": "rag.store",
    "StoredChunk": "rag.store",
    "IngestReport": "rag.store",
    "make_client": "rag.store",
    "default_store_dir": "rag.store",
    "validate_collection_name": "rag.store",
    "DocumentQA": "rag.qa",
    "Answer": "rag.qa",
    "TEXT_ROUTES": "rag.qa",
    "cite_with_support": "rag.qa",
    "small_model_note": "rag.qa",
    "rolls": "rag.qa",
    "StuffingRetriever": "rag.stuffing",
    "StuffedContext": "rag.stuffing",
    "ContextBudgetError": "rag.stuffing",
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
    "Skipped": "rag.loaders",
    "IntakeError": "rag.intake",
    "Upload": "rag.intake",
    "folder_files": "rag.intake",
    "remove_skipped_uploads": "rag.intake",
    "save_uploads": "rag.intake",
    "cache_root": "model.loading",
    # adapters
    "AUTO": "model.shipped_adapters",
    "adapter_option": "model.shipped_adapters",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapkv_rag.integrations' has no attribute {name!r}")
    # Looked up on every access, not cached here: the defining module stays the one place to patch.
    return getattr(importlib.import_module(f"snapkv_rag.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
