"""Which replica should run a request: the one most likely to hold its prompt's K/V.

A replica reuses a prompt's prefix from its prefix cache, and the K/V of ``reuse_segments``
chunks from its segment store, only if it ran them before. :func:`affinity_keys` turns a
request into keys: one per 1 KiB block of the prompt's text, each hashing everything up to
the block's end (so a longer shared prefix matches more keys, as vLLM's block hashes do),
then one per reused chunk. Every key is keyed by the request's cache namespace (its API key's
tenant and ``cache_salt``, as the prefix cache is), so a tenant's guess of another tenant's
prompt matches nothing and is routed as any new prompt. :class:`AffinityTable` remembers which
replica last ran each key. Both are plain Python, free of Ray, so the routing is tested without
a cluster.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

BLOCK_CHARS = 1024


def prompt_text(prompt: Any) -> str:
    """A chat prompt's messages (roles, contents, tool calls) or a completion prompt, as one string."""
    if isinstance(prompt, str):
        return prompt
    return "".join(json.dumps(message, sort_keys=True, ensure_ascii=False, default=str) + "\n" for message in prompt)


def _hasher(namespace: str | None) -> Any:
    """A hash keyed by ``namespace`` (unkeyed in the shared namespace, None): digests of one text
    in two namespaces are unrelated."""
    key = b"" if namespace is None else hashlib.blake2b(namespace.encode("utf-8"), digest_size=32).digest()
    return hashlib.blake2b(digest_size=16, key=key)


def affinity_keys(prompt: Any, segments: Iterable[str] = (), namespace: str | None = None) -> tuple[list[bytes], list[bytes]]:
    """``(prefix_keys, segment_keys)`` in ``namespace`` (the request's ``cache_salt`` as the
    server sets it): prefix keys longest first, one per whole block of the prompt's text plus one
    for the whole text; a key per reused chunk."""
    text = prompt_text(prompt).encode("utf-8")
    running = _hasher(namespace)
    prefix_keys = []
    for start in range(0, len(text), BLOCK_CHARS):
        running.update(text[start : start + BLOCK_CHARS])
        prefix_keys.append(running.digest())
    prefix_keys.reverse()
    segment_keys = [b"segment:" + _digest(namespace, s) for s in segments]
    return prefix_keys, segment_keys


def _digest(namespace: str | None, text: str) -> bytes:
    hasher = _hasher(namespace)
    hasher.update(text.encode("utf-8"))
    return hasher.digest()


def replica_tag(replica: str, namespace: str | None) -> str:
    """What a response says of the replica that ran it (``X-SnapKV-Replica``): in the shared
    namespace, whose clients share one cache anyway, the replica's id; in a tenant's or salt's
    namespace a digest of both, stable for the tenant (its follow-ups show the same tag) and
    unrelated to the tags another tenant sees."""
    return replica if namespace is None else _digest(namespace, replica).hex()[:16]


class AffinityTable:
    """Key -> the replica that last ran a request with that key; least recently used keys
    are forgotten beyond ``max_keys`` (a 40K-token prompt is about 160 keys)."""

    def __init__(self, max_keys: int = 200_000):
        self.max_keys = max_keys
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()
        self._started: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def started(self, replica: Hashable) -> int:
        """Prompts that shared nothing with earlier ones and ran on ``replica`` (conversations
        it started): among equally loaded replicas, a new prompt goes to the one with fewest."""
        return self._started[replica]

    def best(self, prefix_keys: list[bytes], segment_keys: list[bytes], live: set) -> tuple[Hashable | None, float]:
        """The live replica holding the longest prefix, else the most chunks; and the share
        of the request's keys it matched (0.0 when none)."""
        for i, key in enumerate(prefix_keys):
            owner = self._owner.get(key)
            if owner in live:
                return owner, (len(prefix_keys) - i) / len(prefix_keys)
        votes: dict[Hashable, int] = {}
        for key in segment_keys:
            owner = self._owner.get(key)
            if owner in live:
                votes[owner] = votes.get(owner, 0) + 1
        if not votes:
            return None, 0.0
        owner = max(votes, key=lambda o: votes[o])
        return owner, votes[owner] / len(segment_keys)

    def record(self, keys: Iterable[bytes], replica: Hashable) -> None:
        keys = list(keys)
        if not any(key in self._owner for key in keys):
            self._started[replica] += 1
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]
        del self._started[replica]
