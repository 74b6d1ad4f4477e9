"""Texts offered for segment reuse by whatever put them into a prompt (retrievers, postprocessors, agent memory).

Framework pipelines pass prompts to the LLM as plain messages: a LangChain chain runs its
retriever in another branch (even another thread) than its chat model, and a LlamaIndex
synthesizer formats the retrieved nodes itself. So the pieces that pick documents (the
stuffing retriever, the token-budget postprocessor, agent memory's tool logs) *offer* their
texts here, and the LLM wrappers call the engine with ``reuse_segments="offered"``: every
offered text found verbatim in the rendered prompt becomes a reusable segment, the rest of
the prompt is computed as usual. The registry is process-wide and bounded (most recently
offered texts first); offering a text costs nothing until a prompt contains it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

#: Texts shorter than this are not worth a stored entry.
MIN_SEGMENT_CHARS = 64
MAX_OFFERED = 4096


class OfferedSegments:
    def __init__(self, max_texts: int = MAX_OFFERED):
        self.max_texts = max_texts
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, texts: Iterable[str]) -> None:
        with self._lock:
            for text in texts:
                text = text.strip() if isinstance(text, str) else ""
                if len(text) < MIN_SEGMENT_CHARS:
                    continue
                self._texts.pop(text, None)
                self._texts[text] = None
            while len(self._texts) > self.max_texts:
                self._texts.popitem(last=False)

    def found_in(self, prompt_text: str) -> list[str]:
        """The offered texts that occur in ``prompt_text``."""
        with self._lock:
            texts = list(self._texts)
        return [t for t in texts if t in prompt_text]

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()

    def __len__(self) -> int:
        return len(self._texts)


OFFERED = OfferedSegments()


def offer_segments(texts: Iterable[str]) -> None:
    """Offer ``texts`` (documents about to be stuffed, tool outputs) for reuse by later prompts."""
    OFFERED.offer(texts)


KV_REUSE_MODES = ("chunks", "prefix", "off")
_STORES: dict[str, object] = {}
_STORES_LOCK = threading.Lock()


def check_kv_reuse(mode: str | None) -> str | None:
    """``mode`` when valid; None stands for the engine's ``recommended_kv_reuse``."""
    if mode is not None and mode not in KV_REUSE_MODES:
        raise ValueError(f"kv_reuse must be one of {KV_REUSE_MODES} or None (the model's recommendation), got {mode!r}")
    return mode


def resolve_kv_reuse(mode: str | None, engine) -> str:
    return check_kv_reuse(mode) or str(getattr(engine, "recommended_kv_reuse", "chunks"))


def segment_store_at(directory: str | os.PathLike | None, max_bytes: int | None = None):
    """One :class:`~snapkv_rag.reuse.segment_store.SegmentKVStore` per directory and bound in this
    process (None: no directory, the engine's own store), so its hit counts add up."""
    from .segment_store import DEFAULT_MAX_BYTES, SegmentKVStore

    if directory is None:
        return None
    key = f"{os.fspath(directory)}|{max_bytes}"
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = SegmentKVStore(directory, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        return _STORES[key]


def reuse_kwargs(mode: str, segments="offered", store=None) -> dict:
    """Engine keywords for ``kv_reuse`` ``mode``: ``"chunks"`` reuses ``segments`` (a list of texts,
    or the offered ones) from ``store``; ``"prefix"`` only the prefix cache; ``"off"`` neither."""
    check_kv_reuse(mode)
    if mode == "off":
        return {"prefix_cache": False}
    if mode == "chunks" and segments:
        return {"reuse_segments": segments, **({"segment_store": store} if store is not None else {})}
    return {}
