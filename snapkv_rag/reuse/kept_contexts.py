"""Compressed contexts kept for follow-up questions: compress once, ask many.

A prompt asked with ``keep_context=True`` is read in two parts: its context (everything before the
question) is prefilled and compressed *without* the question, then the question and the chat
template's tail are read over the compressed cache. The compressed context is kept here, so the next
prompt with the same context tokens, the same policy and the same namespace reads only its own
question (a context that extends a kept one, as a conversation's next turn does, reads only what
it adds, kept whole, and is kept in its place): no documents are prefilled again, and the memory held is the compressed cache's, not the
full K/V the prefix cache would keep.

Entries are byte-bounded (least recently used first out), keyed by namespace (a request's
``cache_salt``; the server adds the tenant), the policy's spec and the context's token ids (compared
exactly on a hit, not only by hash). A stored entry is never handed out itself: each reader gets its
own copy of the cache layers and the policy's decode state, which decoding then extends.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

#: Default byte bound: a compressed context of the embedded model at budget 1,024 takes about 24 MB in bf16.
DEFAULT_KEPT_CONTEXT_BYTES = 256 << 20


@dataclass
class KeptContext:
    """One compressed context: what a run holds after its prefill, enough to decode from it again."""

    tokens: torch.Tensor  # 1-D long, CPU: the context's token ids
    layers: list[Any]  # the cache's layers after compression
    last_position: torch.Tensor  # [1, 1]: the position the context's last token was read at
    policy_state: Any = None  # the policy's decode-time state after the prefill (LESS, decode-time cuts)
    rolling: Any = None  # a rolled read's RollingStats (None: read in one window)
    nbytes: int = 0  # the cache's bytes, as the engine counts them

    def copy(self) -> tuple[list[Any], Any]:
        """Fresh copies of the cache layers and the policy state, for one reader to extend."""
        return [copy.deepcopy(layer) for layer in self.layers], copy.deepcopy(self.policy_state)


@dataclass
class KeptContextStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int


class KeptContexts:
    """A byte-bounded LRU of :class:`KeptContext`, namespaced; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_KEPT_CONTEXT_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str, str], KeptContext] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    @staticmethod
    def _key(tokens: list[int], spec: str, namespace: str) -> tuple[str, str, str]:
        digest = hashlib.sha256(torch.tensor(tokens, dtype=torch.long).numpy().tobytes()).hexdigest()
        return namespace, spec, digest

    def get(self, tokens: list[int], spec: str, namespace: str = "") -> KeptContext | None:
        """The entry kept for exactly ``tokens``, else the longest one kept for a prefix of them (a
        conversation's earlier context: the reader reads the rest after it), else None."""
        key = self._key(tokens, spec, namespace)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tokens.tolist() != list(tokens):
                entry, key = self._longest_prefix(tokens, spec, namespace)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def _longest_prefix(self, tokens: list[int], spec: str, namespace: str) -> tuple[KeptContext | None, Any]:
        best: tuple[KeptContext | None, Any] = (None, None)
        wanted = torch.tensor(tokens, dtype=torch.long)
        for key, entry in self._entries.items():
            if key[:2] != (namespace, spec) or len(entry.tokens) >= len(tokens):
                continue
            if (best[0] is None or len(entry.tokens) > len(best[0].tokens)) and torch.equal(entry.tokens, wanted[: len(entry.tokens)]):
                best = (entry, key)
        return best

    def put(self, tokens: list[int], spec: str, entry: KeptContext, namespace: str = "") -> bool:
        """Keep ``entry`` (its layers are copied, so the run that made it may go on extending its own);
        False when it is larger than the whole bound."""
        if entry.nbytes > self.max_bytes:
            return False
        entry.layers, entry.policy_state = entry.copy()
        key = self._key(tokens, spec, namespace)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            shorter, shorter_key = self._longest_prefix(tokens, spec, namespace)
            if shorter is not None:  # what it kept is the start of this one: this one serves its readers
                del self._entries[shorter_key]
                self._bytes -= shorter.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> KeptContextStats:
        with self._lock:
            return KeptContextStats(len(self._entries), self._bytes, self.max_bytes, self.hits, self.misses, self.evictions)
