"""How document QA reuses prompt K/V: per chunk (blended prefill), by exact prefix, or not at all.

``"chunks"`` (the default, except for models whose measured answers suffer: the embedded
135M model recommends ``"prefix"``, see ``Engine.recommended_kv_reuse``) hands every stuffed chunk's text to the engine as a reusable
segment; its K/V are stored beside the Chroma store (``<store>/kv-segments``; under the
cache directory for a Chroma server), shared by every process that opens the same store,
so a new question over chunks seen before (in any order) prefills only its question, the
chunk labels and the recomputed share. ``"prefix"`` reuses only an identical leading run of
tokens (the engine's in-memory prefix cache); ``"off"`` prefills every prompt whole.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..reuse.offered import KV_REUSE_MODES, check_kv_reuse, resolve_kv_reuse, reuse_kwargs, segment_store_at  # noqa: F401 (re-exported)
from ..reuse.segment_store import SegmentKVStore
from .store import DocumentStore, StoredChunk
from .stuffing import build_messages, chunk_segment

SEGMENT_DIR = "kv-segments"


def default_kv_dir(store: DocumentStore) -> Path:
    """``<embedded store>/kv-segments``; for a Chroma server, the cache directory (per server and collection)."""
    from ..model.loading import cache_root

    location = str(store.location)
    if "://" in location or not Path(location).is_dir():
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in location)
        return cache_root() / SEGMENT_DIR / safe
    return Path(location) / SEGMENT_DIR


def chunk_kv_store(store: DocumentStore, directory: str | Path | None = None, max_bytes: int | None = None) -> SegmentKVStore:
    return segment_store_at(directory or default_kv_dir(store), max_bytes)


def precompute_chunk_kv(engine, chunks: list[StoredChunk], kv_store: SegmentKVStore, *, progress: bool = False) -> tuple[int, int]:
    """Compute and store the K/V of every chunk not stored yet; returns ``(computed, already stored)``.

    Each chunk's tokens are taken as they appear in a real prompt (rendered with the same
    template and numbering), so the entries are the ones a question will look up.
    """
    from ..engine.prompts import render_prompt, segment_spans
    from ..reuse.blending import segment_anchor, stored_or_computed

    engine.rope_shift()  # refuse models that cannot reuse moved K/V before computing anything
    computed = stored = 0
    iterator = chunks
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(chunks, desc="chunk K/V", unit="chunk")
    for chunk in iterator:
        messages, _ = build_messages("?", [chunk])
        row = render_prompt(engine.tokenizer, messages)
        spans = segment_spans(engine.tokenizer, messages, [chunk_segment(chunk)], len(row))
        if not spans:
            continue
        tokens, anchor = row[spans[0][0] : spans[0][1]], segment_anchor(row)
        _, hit = engine.run_on_model(partial(stored_or_computed, engine.model, kv_store, engine.signature, tokens, anchor))
        stored += hit
        computed += not hit
    return computed, stored


def kv_reuse_note(engine, chosen: str | None) -> str | None:
    """A line for a caller who chose ``kv_reuse`` against the model's recommendation (None: nothing to say)."""
    recommended = getattr(engine, "recommended_kv_reuse", "chunks")
    if chosen is None or chosen == recommended or chosen == "off":
        return None
    if chosen == "chunks":
        return (
            f"this model's recommended --kv-reuse is {recommended}: chunks computed apart and reused cost answers on it "
            "(docs/chunk-reuse.md: with the default recompute share the embedded 135M model lost 13 of its 19 right answers at 2K)"
        )
    return f"this model's recommended --kv-reuse is {recommended} (chunks reused at any position); {chosen} reuses less"
