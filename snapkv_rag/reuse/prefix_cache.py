"""A byte-bounded LRU of *uncompressed* prompt K/V, keyed by token ids, for prefix reuse.

The engine stores every prompt's full K/V after its prefill (before any compression, so
the stored copy serves every policy and budget) and, for the next prompt, reuses the K/V
of the longest stored token prefix: only the rest is prefilled. Matching is exact on token
ids (no block rounding); a stored prompt that is a prefix of a newly stored one is dropped,
since the new entry serves everything it could.

How reuse stays exact (see :func:`reusable_tokens`): a policy's selection needs the
queries of its observation window, and a reused token has no queries. So the last
``max(1, policy.query_window)`` prompt tokens are always prefilled (recomputed) even when
they are stored; each layer's selection then runs over the reused keys plus the new keys
with the window's queries, exactly as in a full prefill. Policies that need *all* prompt
queries (``query_window is None``: H2O) never reuse; their prompts are still stored.

What is stored (``PrefixCache.admission``): a full-cache prefill's K/V always (it exists
anyway). A compressed prefill's full K/V is what layer-wise compression exists not to hold, so
with ``"repeat"`` (the default) a long one (over ``first_sight_bytes``, a sixteenth of the bound:
64 MiB on a CPU, about 2,800 tokens of the embedded model in bf16) is kept only when a prompt
seen before shares enough of its opening to be reused (:func:`reusable_tokens`'s rule; in the
invariant mode :func:`whole_chunks`'): a one-off long prompt then peaks as compressed; a repeated
one is stored on its second read and reused from its third. Shorter ones are stored at once (an
agent's first turns, a chat's first messages: reused by the next turn, for little memory); an
agent's history, each turn extending the last, is then stored at every turn. ``"always"`` stores
every prompt (the second read reuses; every compressed prefill peaks like a full one).
An entry larger than the whole bound is never collected.

Entries live in namespaces (a request's ``cache_salt``; the server adds its API key's tenant):
a prompt reuses, and subsumes, only entries stored under its own namespace, so one tenant's
reuse statistics and first-token times say nothing about another's prompts.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..compression.base import CompressionPolicy

#: Default byte bound on CPU (and the floor on GPU); see :func:`default_prefix_cache_bytes`.
CPU_DEFAULT_BYTES = 1 << 30


def default_prefix_cache_bytes(device: torch.device) -> int:
    """1 GiB on CPU; on CUDA a tenth of the device's memory, at least 1 GiB and at most 8 GiB."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(min(8 << 30, max(CPU_DEFAULT_BYTES, total // 10)))
    return CPU_DEFAULT_BYTES


@dataclass
class PrefixEntry:
    """One stored prompt: its token ids and per-layer ``[1, kv_heads, n, head_dim]`` K and V."""

    tokens: torch.Tensor  # 1-D long, CPU
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int = 0
    namespace: str = ""  # only prompts of the same namespace reuse it
    aligned: int = 0  # leading tokens computed in position-aligned chunks (the invariant mode); 0: none
    chunk: int = 0  # the tokens per chunk those were computed in: only prompts chunked alike reuse them

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class PrefixCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    lookups: int
    hits: int
    reused_tokens: int
    evictions: int


ADMISSIONS = ("repeat", "always")
SEEN_PROMPTS = 256  # prompts remembered (token ids only) for the "repeat" admission ...
SEEN_TOKENS = 1 << 20  # ... and at most this many of their tokens (8 MiB)


@dataclass
class PrefixCache:
    """LRU of :class:`PrefixEntry` under ``max_bytes`` (K and V bytes of all layers).

    Thread-safe: every method that reads or changes the entries holds the cache's lock (the
    engine's worker stores and looks up while metrics read the statistics from another thread).
    """

    max_bytes: int
    admission: str = "repeat"  # which compressed prefills keep their full K/V (see the module doc)
    first_sight_bytes: int | None = None  # "repeat": stored at first sight up to this size (None: max_bytes // 16)
    _entries: OrderedDict = field(default_factory=OrderedDict)  # id -> PrefixEntry
    _seen: OrderedDict = field(default_factory=OrderedDict)  # (namespace, digest) -> token ids of a recent prompt
    _next_id: int = 0
    _bytes: int = 0
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        """Least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(len(self._entries), self._bytes, self.max_bytes, self.lookups, self.hits, self.reused_tokens, self.evictions)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._seen.clear()
            self._bytes = 0

    def admits(
        self, tokens: list[int], namespace: str, nbytes: int, policy: CompressionPolicy | None, dtype: torch.dtype, invariant_chunk: int | None = None
    ) -> bool:
        """Whether a prefill of ``tokens`` under ``policy`` should collect its full K/V
        (``nbytes``) for this cache; then remembers the prompt as seen. ``invariant_chunk``: the
        prefill runs in the invariant mode's chunks of that size, whose reuse rule then decides."""
        if self.admission not in ADMISSIONS:
            raise ValueError(f"prefix cache admission must be one of {ADMISSIONS}, got {self.admission!r}")
        with self._lock:
            query = torch.tensor(tokens, dtype=torch.long)
            admitted = 0 < nbytes <= self.max_bytes
            first_sight = self.max_bytes // 16 if self.first_sight_bytes is None else self.first_sight_bytes
            if admitted and policy is not None and self.admission == "repeat" and nbytes > first_sight:
                shared = max((self._common_prefix(seen, query) for (space, _), seen in self._seen.items() if space == namespace), default=0)
                admitted = self._would_reuse(shared, len(tokens), policy, dtype, invariant_chunk)
            key = (namespace, hashlib.sha1(query.numpy().tobytes()).digest())
            self._seen.pop(key, None)
            self._seen[key] = query
            while len(self._seen) > SEEN_PROMPTS or sum(t.numel() for t in self._seen.values()) > SEEN_TOKENS:
                self._seen.popitem(last=False)
            return admitted

    @staticmethod
    def _would_reuse(shared: int, prompt_length: int, policy: CompressionPolicy, dtype: torch.dtype, invariant_chunk: int | None) -> bool:
        """Whether a prompt sharing ``shared`` leading tokens with a stored one would reuse them."""
        if invariant_chunk is None:
            return reusable_tokens(shared, prompt_length, policy, dtype) > 0
        end = aligned_end(prompt_length, policy, invariant_chunk)
        return end is not None and whole_chunks(shared, prompt_length, end, invariant_chunk) > 0

    @staticmethod
    def _common_prefix(stored: torch.Tensor, query: torch.Tensor) -> int:
        m = min(stored.numel(), query.numel())
        if m == 0:
            return 0
        differs = (stored[:m] != query[:m]).nonzero()
        return int(differs[0, 0]) if differs.numel() else m

    def lookup(self, tokens: list[int], namespace: str = "", chunk: int | None = None) -> tuple[PrefixEntry | None, int]:
        """The entry of ``namespace`` sharing the longest token prefix with ``tokens`` and that
        length, or ``(None, 0)``; with ``chunk``, only among entries aligned in chunks of that size.
        Recency changes only when the entry is used (:meth:`record_reuse`)."""
        with self._lock:
            self.lookups += 1
            query = torch.tensor(tokens, dtype=torch.long)
            best, best_len = None, 0
            for entry in self._entries.values():
                if entry.namespace != namespace or (chunk is not None and (entry.chunk != chunk or not entry.aligned)):
                    continue
                n = self._common_prefix(entry.tokens, query)
                if n > best_len:
                    best, best_len = entry, n
            return best, best_len

    def record_reuse(self, entry: PrefixEntry | None, tokens: int) -> None:
        """``tokens`` of ``entry`` were reused: count them and mark it most recently used."""
        if entry is None or tokens <= 0:
            return
        with self._lock:
            self.hits += 1
            self.reused_tokens += tokens
            for key, stored in self._entries.items():
                if stored is entry:
                    self._entries.move_to_end(key)
                    break

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], namespace: str = "", aligned: int = 0, chunk: int = 0) -> bool:
        """Store a prompt's full K/V under ``namespace`` (its first ``aligned`` tokens computed in
        ``chunk``-token forwards); returns False when it alone exceeds the bound."""
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if self.max_bytes <= 0 or nbytes > self.max_bytes:
            return False
        with self._lock:
            ids = torch.tensor(tokens, dtype=torch.long)
            # Entries of the namespace that are a prefix of the new prompt (or equal to it) are subsumed by it.
            subsumed = [k for k, e in self._entries.items() if e.namespace == namespace and len(e) <= len(ids) and self._common_prefix(e.tokens, ids) == len(e)]
            for key in subsumed:
                self._bytes -= self._entries.pop(key).nbytes
            self._entries[self._next_id] = PrefixEntry(ids, keys, values, nbytes, namespace, aligned, chunk if aligned else 0)
            self._next_id += 1
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
            return True


def reuse_tail(policy: CompressionPolicy | None) -> int | None:
    """Trailing prompt tokens that must be prefilled for ``policy`` to select exactly as after a
    full prefill, or None when it needs every prompt query (no reuse)."""
    if policy is None:
        return 1  # the last token's logits
    window = policy.query_window
    if window is None:
        return None
    return max(1, int(window))


#: A stored prefix is reused only when it covers at least this share of the prompt. The rest
#: of the prompt attends to it through compression.runtime.cached_prefix_attention, at a causal
#: prefill's cost per token, so reuse pays from small shares: on the embedded model 1.02-1.07x
#: at 5-10% in fp32 (2.4K and 8K tokens) and 1.03x at 10% in bf16, but 0.88x at 5% in bf16 (2K),
#: where the fixed cost of reusing outweighs 98 tokens (eval/reuse/RESULTS.md, "Exact prefix reuse at
#: any share"). It was 0.5 while the rest went through an explicit mask (0.6-0.9x below half).
MIN_REUSE_SHARE = 0.1
#: The same in bf16/fp16, where reuse is not bit-exact (attention computed in two pieces rounds
#: otherwise): below half it gained at most 1.17x and changed the greedy continuation on 2 of the
#: 3 prompts measured there, so half the prompt stays the bar, as before.
MIN_REUSE_SHARE_LOW_PRECISION = 0.5


def reusable_tokens(prefix_length: int, prompt_length: int, policy: CompressionPolicy | None, dtype: torch.dtype = torch.float32) -> int:
    """How many leading tokens of a prompt may come from a stored prefix of ``prefix_length``
    (0 when that is less than :data:`MIN_REUSE_SHARE` of the prompt, or
    :data:`MIN_REUSE_SHARE_LOW_PRECISION` for K/V in ``dtype`` below fp32)."""
    tail = reuse_tail(policy)
    if tail is None:
        return 0
    take = max(0, min(prefix_length, prompt_length - tail))
    least = MIN_REUSE_SHARE if dtype == torch.float32 else MIN_REUSE_SHARE_LOW_PRECISION
    return take if take >= least * prompt_length else 0


# ------------------------------------------------------------------ a batch's layout
ReusePlan = list[tuple["PrefixEntry | None", int]]  # per row: the stored entry and how many leading tokens to take


def plan_reuse(cache: PrefixCache, rows: list[list[int]], policies: list[CompressionPolicy | None], namespace: str = "") -> ReusePlan:
    """Per row: the stored entry to reuse and how many leading tokens to take from it.

    In a batch every row that reuses anything prefills the same number ``T`` of new
    tokens (the most any row needs), so each row's tokens stay contiguous and
    left-padded: SnapKV's pooling over neighbouring positions must not see a padding gap
    between reused and new tokens. A row may therefore reuse less than it could.
    """
    plan: ReusePlan = []
    for row, policy in zip(rows, policies):
        entry, common = cache.lookup(row, namespace)
        plan.append((entry, reusable_tokens(common, len(row), policy, entry.keys[0].dtype) if entry is not None else 0))
    new_tokens = max(len(row) - take for row, (_, take) in zip(rows, plan))
    return [(entry, max(0, len(row) - new_tokens) if take else 0) for row, (entry, take) in zip(rows, plan)]


def reused_columns(plan: ReusePlan, rows: list[list[int]]) -> int:
    """``P``: the leading columns of the batch's left-padded layout that come from stored prefixes
    (row ``i``'s ``r_i`` reused tokens end at column ``P``; the rest is prefilled)."""
    width = max(len(row) for row in rows)
    return width - max(len(row) - take for row, (_, take) in zip(rows, plan))


def reused_layer(plan: ReusePlan, layer_idx: int, width_p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_idx``'s K and V ``[batch, kv_heads, P, d]`` for the reused columns (zeros where a row reuses less)."""
    out = []
    for name in ("keys", "values"):
        if len(plan) == 1:
            entry = plan[0][0]
            assert entry is not None
            out.append(getattr(entry, name)[layer_idx][:, :, :width_p])
            continue
        ref = getattr(next(e for e, take in plan if take > 0), name)[layer_idx]
        block = ref.new_zeros(len(plan), ref.shape[1], width_p, ref.shape[3])
        for i, (entry, take) in enumerate(plan):
            if take:
                block[i, :, width_p - take :] = getattr(entry, name)[layer_idx][0, :, :take]
        out.append(block)
    return out[0], out[1]


def store_prompts(
    cache: PrefixCache,
    rows: list[list[int]],
    full_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    namespace: str = "",
    keep: list[bool] | None = None,
    aligned: int = 0,
    chunk: int = 0,
) -> None:
    """Put each row's full (uncompressed) prompt K/V, from the batch's left-padded ``full_kv``
    (layer -> ``[batch, kv_heads, width, d]`` K and V), into ``cache`` under ``namespace``
    (only the rows ``keep`` marks, when given; the first ``aligned`` tokens computed in
    ``chunk``-token forwards)."""
    width = max(len(row) for row in rows)
    layers = sorted(full_kv)
    for i, row in enumerate(rows):
        if keep is not None and not keep[i]:
            continue
        keys, values = [], []
        for layer_idx in layers:
            k, v = full_kv[layer_idx]
            if len(rows) == 1 and k.shape[2] == len(row):
                keys.append(k)  # the prefill's own tensor: no copy
                values.append(v)
            else:
                keys.append(k[i : i + 1, :, width - len(row) :].clone())
                values.append(v[i : i + 1, :, width - len(row) :].clone())
        cache.insert(row, keys, values, namespace, aligned, chunk)


# ------------------------------------------------------------------ the invariant mode
def aligned_end(prompt_length: int, policy: CompressionPolicy | None, chunk: int) -> int | None:
    """Where the invariant mode's last prefill forward (the policy's window, with what follows the
    last whole chunk) starts: the tokens before it run in ``chunk``-token forwards at positions
    ``0, chunk, 2 chunk, ...``, so a prompt computed cold and one reusing a stored prefix run the
    same forwards on the same inputs and hold the same bytes. None: the policy needs every
    prompt query (H2O), so the prompt is prefilled whole and never reused."""
    tail = reuse_tail(policy)
    if tail is None:
        return None
    return max(0, prompt_length - tail) // chunk * chunk


def whole_chunks(shared: int, prompt_length: int, end: int, chunk: int) -> int:
    """The invariant mode's :func:`reusable_tokens`: the whole chunks of ``shared`` leading tokens
    up to ``end`` (:func:`aligned_end`), or 0 when they make less than :data:`MIN_REUSE_SHARE` of
    the prompt (reuse is bit-exact here, in every dtype, so the fp32 bar holds for all)."""
    take = min(shared, end) // chunk * chunk
    return take if take > 0 and take >= MIN_REUSE_SHARE * prompt_length else 0


def aligned_reuse(cache: PrefixCache, row: list[int], namespace: str, end: int, chunk: int) -> tuple[PrefixEntry | None, int]:
    """The invariant mode's reuse: :func:`whole_chunks` of a stored prompt's aligned part, from an
    entry aligned in chunks of the same size (another size's chunks are other forwards)."""
    entry, common = cache.lookup(row, namespace, chunk)
    if entry is None:
        return None, 0
    take = whole_chunks(min(common, entry.aligned), len(row), end, chunk)
    return (entry, take) if take else (None, 0)
