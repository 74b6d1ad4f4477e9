"""Skim, then read: rank a long stuffed context's documents by the model's own attention, then
answer from the best of them re-read in full at a length the model reads well.

A small model answers worse the more it is given, yet while it reads a long context compressed
(SnapKV with the question as its observation window, rolled past the window) the question's
queries already say which positions matter: that is what SnapKV keeps. The skim records that
vote (:func:`~snapkv_rag.compression.runtime.recording_window_votes`): each position's
attention mass from the question, in the forward that read it, summed per stuffed document,
over the heads :mod:`.skim_heads` chose for the model (its retrieval heads; else every head of
the middle layers). This is in-context re-ranking (ICR, Chen et al. 2024, arXiv:2410.02642:
the attention of the query to each document ranks it; a 2026 layer-wise study,
arXiv:2602.22591, finds the signal strongest in the middle layers). Documents are then
re-stuffed best first into the read's own budget and answered as any ask is.

``fusion="attention"`` ranks by the skim alone; ``"rrf"`` fuses it with the retriever's rank
(reciprocal-rank fusion, k=60), which keeps what the embedding ranked high where the attention
is unsure. The skim costs one compressed prefill of the long context, through the layers up to
the deepest one its heads are in (an early exit: 18 of the embedded model's 30); its time is in
:class:`SkimResult` and the answer's context settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..compression.runtime import WindowVotes, recording_window_votes
from .kept import document_spans
from .store import StoredChunk
from .stuffing import StuffedContext, build_messages, chunk_segment, format_document

FUSIONS = ("attention", "rrf")
# The skim reads in rolled chunks of this many tokens, each with the question right after it, even
# where the whole context would fit the window: on the look-alike corpus at 8K the retrieval heads
# ranked the gold document 5th, 41st and 19th of ~53 in one whole read, and 4th, 2nd and 1st rolled
# in 2,048-token chunks (3 questions, eval/rag/RESULTS.md "Long reads"), in a third of the time.
SKIM_ROLLING = 2048
RRF_K = 60
CONTENT_FREE_QUESTION = "N/A"  # ICR's content-free query (Chen et al. 2024, arXiv:2410.02642)
DEFAULT_LAYERS = (0.25, 0.75)  # the middle half of the compressed layers


@dataclass(frozen=True)
class SkimResult:
    context: StuffedContext  # the long context that was skimmed
    scores: list[float]  # per document of ``context``: the question's attention mass on it
    seconds: float  # the skim's prefill, wall clock
    prompt_tokens: int
    reused_tokens: int = 0  # tokens whose K/V came from the chunk store (a skim from stored keys)
    stored_misses: int = 0  # chunks whose K/V that skim computed and stored (first skim of them)

    def ranking(self, fusion: str = "attention") -> list[StoredChunk]:
        """The skimmed context's chunks, best first (``fusion``: see the module's docstring)."""
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
        n = len(self.context.chunks)
        by_attention = sorted(range(n), key=lambda i: -self.scores[i])
        if fusion == "attention":
            return [self.context.chunks[i] for i in by_attention]
        # retrieval rank: the context's own order (score order) when it was stuffed by retrieval
        attention_rank = {i: r for r, i in enumerate(by_attention)}
        fused = sorted(range(n), key=lambda i: -(1 / (RRF_K + i + 1) + 1 / (RRF_K + attention_rank[i] + 1)))
        return [self.context.chunks[i] for i in fused]


def middle_layers(layers: list[int], band: tuple[float, float] = DEFAULT_LAYERS) -> list[int]:
    """The layers in the ``band`` (fractions of the depth) of the recorded ``layers``."""
    ordered = sorted(layers)
    lo, hi = band
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"the layer band must satisfy 0 <= lo < hi <= 1, got {band}")
    chosen = ordered[int(lo * len(ordered)) : max(int(lo * len(ordered)) + 1, int(round(hi * len(ordered))))]
    return chosen or ordered


def document_scores(
    tokenizer,
    context: StuffedContext,
    votes: WindowVotes,
    band: tuple[float, float] = DEFAULT_LAYERS,
    heads: Sequence[tuple[int, int]] | None = None,
) -> list[float]:
    """Per stuffed document of ``context``: its share of the question's attention mass on the
    documents, averaged over ``heads`` (``(layer, head)`` pairs; by default every head of the
    band's layers)."""
    if not votes.layers:
        raise ValueError("the skim recorded no votes: the policy needs an observation window (e.g. snapkv with window=question)")
    if heads is None:
        heads = [(layer, h) for layer in middle_layers(list(votes.layers), band) for h in range(votes.layers[layer].shape[0])]
    return combined_scores(head_masses(tokenizer, context, votes, heads))


def head_masses(tokenizer, context: StuffedContext, votes: WindowVotes, heads: Sequence[tuple[int, int]]) -> list[list[float]]:
    """Per ``(layer, head)``: each stuffed document's attention mass from the question's window."""
    missing = sorted({layer for layer, _ in heads} - set(votes.layers))
    if missing or not heads:
        raise ValueError(f"the skim's heads name layers the votes do not hold: {missing or 'none given'}")
    spans = document_spans(tokenizer, context)
    n = votes.prompt_length
    if spans and spans[-1][1] > n:
        raise ValueError(f"the votes cover {n} prompt positions, the documents reach {spans[-1][1]}")
    return [[float(votes.layers[layer][head, a:b].sum()) for a, b in spans] for layer, head in heads]


def combined_scores(per_head: Sequence[Sequence[float]]) -> list[float]:
    """Each document's share of a head's mass on all the documents, averaged over the heads (a
    head that attends more overall does not outvote the others)."""
    out = [0.0] * (len(per_head[0]) if per_head else 0)
    for scores in per_head:
        total = sum(scores) or 1.0
        for i, s in enumerate(scores):
            out[i] += s / total / len(per_head)
    return out


def skim_policy(policy, prompt_tokens: int, context_length: int | None):
    """``policy`` as the skim reads with it: always rolled, in :data:`SKIM_ROLLING`-token chunks unless
    it names its own ``rolling=`` (the one rule, :func:`~snapkv_rag.compression.fit_to_window`)."""
    from ..compression import as_policy, fit_to_window

    return fit_to_window(as_policy(policy), prompt_tokens, 1, context_length, chunk=SKIM_ROLLING, always=True)


def skim_heads_for(engine, band: tuple[float, float] = DEFAULT_LAYERS, heads: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The (layer, head) pairs a skim reads: ``heads``, or every head of the ``band``'s layers among
    those a policy compresses (not the sliding-window ones, which record no votes)."""
    if heads is not None:
        return list(heads)
    from ..compression.runtime import sliding_layers

    compressed = [i for i, slides in enumerate(sliding_layers(engine.config)) if not slides]
    return [(layer, h) for layer in middle_layers(compressed, band) for h in range(engine.info().num_query_heads)]


def skim(
    engine,
    context: StuffedContext,
    compression,
    *,
    band: tuple[float, float] = DEFAULT_LAYERS,
    heads: Sequence[tuple[int, int]] | None = None,
    early_exit: bool = True,
) -> SkimResult:
    """Read ``context`` once under ``compression`` (a policy with an observation window; rolled
    past the model's window by the caller where needed) and score its documents by ``heads``
    (None: every head of the ``band``'s layers; :mod:`.skim_heads` chooses them per model). The
    read generates nothing and is not stored in the prefix cache; with ``early_exit`` its forward
    stops after the deepest layer the heads are in (the layers past it cannot change their votes)."""
    chosen = skim_heads_for(engine, band, heads)
    deepest = max(layer for layer, _ in chosen) if early_exit and chosen else None
    start = time.perf_counter()
    with recording_window_votes() as recorded:
        read = engine.read_prompt(context.messages, compression=compression, question=context.question_text, exit_after_layer=deepest)
    seconds = time.perf_counter() - start
    if not recorded:
        raise ValueError("the skim's prefill recorded no votes: give a sparse policy with an observation window, not the full cache")
    return SkimResult(context, document_scores(engine.tokenizer, context, recorded[-1], band, chosen), seconds, read.prompt_tokens)


def skim_groups(engine, chunks: Sequence[StoredChunk], group_tokens: int = SKIM_ROLLING) -> list[list[int]]:
    """Indices of ``chunks`` in consecutive groups of about ``group_tokens`` of the model's tokens
    (a chunk longer than that is a group of its own): what one rolled chunk of the skim reads."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, chunk in enumerate(chunks):
        cost = engine.count_tokens(format_document(len(groups[-1]) + 1, chunk)) + 2
        if groups[-1] and used + cost > group_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += cost
    return [g for g in groups if g]


def skim_stored(
    engine,
    context: StuffedContext,
    compression,
    kv_store,
    *,
    band: tuple[float, float] = DEFAULT_LAYERS,
    heads: Sequence[tuple[int, int]] | None = None,
    group_tokens: int = SKIM_ROLLING,
    early_exit: bool = True,
    recompute: float = 0.0,
    cache_salt: str | None = None,
    calibrate: bool = False,
    titles: bool = True,
) -> SkimResult:
    """:func:`skim` from stored keys: ``context``'s documents in groups of about ``group_tokens``
    tokens (as the rolled skim groups them), each group read as a prompt of its own (the system
    prompt, the group's documents, the question) whose documents' K/V are placed from ``kv_store``
    at their positions (a :class:`~snapkv_rag.reuse.segment_store.SegmentKVStore`; computed and
    stored the first time a chunk is seen), so only the prompt's own tokens and the question run
    through the model, and only up to the deepest layer the heads are in. ``compression``: a
    policy with an observation window (its ``rolling=``, if any, is dropped: a group fits the window). Each head's attention
    mass on each document is taken from the group that read it; the scores are those masses'
    shares per head, averaged, as :func:`combined_scores` does for one read. ``recompute``: the share of
    stored tokens computed again (1.0: every token, as a full prefill of each group); ``cache_salt``:
    only K/V stored under the same salt are reused (a tenant's own). ``calibrate``: subtract each
    document's score under a content-free question (ICR's calibration; a second read of every group,
    the documents' K/V already placed). ``titles``: each document's label carries its title, as in the
    rolled skim (False: ``[n]`` alone, fewer tokens to compute a group, but a chunk encoded apart
    then has no name for what it is about)."""
    from ..compression import as_policy

    policy = as_policy(compression)
    policy = policy.with_rolling(None) if policy is not None else None  # each group is read in one window
    chosen = skim_heads_for(engine, band, heads)
    deepest = max(layer for layer, _ in chosen) if early_exit and chosen else None
    reads = dict(compression=policy, exit_after_layer=deepest, segment_store=kv_store, recompute=recompute, cache_salt=cache_salt)
    start = time.perf_counter()
    groups = skim_groups(engine, context.chunks, group_tokens)
    masses, prompt_tokens, reused, misses = _group_masses(engine, context.question, context.chunks, groups, chosen, reads, titles)
    scores = combined_scores(masses)
    if calibrate:  # ICR: what a content-free question draws to each document is position and form, not relevance
        empty, *_ = _group_masses(engine, CONTENT_FREE_QUESTION, context.chunks, groups, chosen, reads, titles)
        scores = [s - c for s, c in zip(scores, combined_scores(empty), strict=True)]
    seconds = time.perf_counter() - start
    return SkimResult(context, scores, seconds, prompt_tokens, reused_tokens=reused, stored_misses=misses)


def _group_masses(
    engine, question: str, all_chunks: Sequence[StoredChunk], groups: list[list[int]], heads: list[tuple[int, int]], reads: dict, titles: bool
) -> tuple[list[list[float]], int, int, int]:
    """Per head, each document's attention mass from ``question`` in the group that read it; and the
    tokens read, placed from the store, and the chunks computed."""
    masses: list[list[float]] = [[0.0] * len(all_chunks) for _ in heads]
    prompt_tokens = reused = misses = 0
    for group in groups:
        chunks = [all_chunks[i] if titles else dataclasses.replace(all_chunks[i], title="") for i in group]
        messages, question_text = build_messages(question, chunks)
        part = StuffedContext(question, question_text, chunks, messages, 0, 0, 0, len(chunks), 0, 0, "skim group")
        with recording_window_votes() as recorded:
            read = engine.read_prompt(messages, question=question_text, reuse_segments=[chunk_segment(c) for c in chunks], **reads)
        if not recorded:
            raise ValueError("the skim's read recorded no votes: give a sparse policy with an observation window, not the full cache")
        for h, per_document in enumerate(head_masses(engine.tokenizer, part, recorded[-1], heads)):
            for i, mass in zip(group, per_document, strict=True):
                masses[h][i] = mass
        prompt_tokens += read.prompt_tokens
        reused += read.reused_tokens
        misses += read.segment_misses
    return masses, prompt_tokens, reused, misses
