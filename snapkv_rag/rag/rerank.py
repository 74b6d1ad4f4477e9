"""Rank any texts for a question by the model's attention: the skim (:mod:`.skim`) over passages
that did not come from a :class:`~snapkv_rag.rag.store.DocumentStore`, such as another retriever's
nodes or documents. The connectors' rerankers (a LlamaIndex node postprocessor, a LangChain
document compressor) call :func:`attention_rerank`.

The texts are stuffed as numbered documents after the question's system prompt, read once under the
skim's policy (rolled in 2,048-token chunks, stopping after the deepest layer the heads read), and
each is scored by its share of the question's attention (ICR, arXiv:2410.02642). ``budget_tokens``
then keeps the best that fit, counted in the model's tokens as they would be stuffed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..compression import DEFAULT_COMPRESSION, as_policy
from .packing import pack_greedy
from .skim import DEFAULT_LAYERS, FUSIONS, skim, skim_policy, skim_stored
from .skim_heads import resolve_skim_heads
from .store import StoredChunk
from .stuffing import StuffedContext, build_messages, format_document


@dataclass(frozen=True)
class Reranked:
    """The texts' order by attention and what it cost."""

    order: list[int]  # indices of the input texts, best first (all of them)
    scores: list[float]  # per input text: its share of the heads' attention on the texts
    kept: list[int]  # ``order`` cut to the token budget (all of ``order`` without one)
    seconds: float  # the skim's read, wall clock
    prompt_tokens: int  # tokens read

    def chosen(self, top_n: int | None = None) -> list[int]:
        """What to keep, best first: ``kept`` (the budget's picks) among the ``top_n`` best (None: all).
        The budget packs in rank order, so its picks among the top n are what packing the top n keeps."""
        if top_n is None:
            return list(self.kept)
        best = set(self.order[:top_n])
        return [i for i in self.kept if i in best]

    @property
    def ranks(self) -> list[int]:
        """Per input text: its 1-based rank."""
        rank = [0] * len(self.order)
        for r, i in enumerate(self.order, start=1):
            rank[i] = r
        return rank


def attention_rerank(
    engine,
    question: str,
    texts: Sequence[str],
    *,
    titles: Sequence[str] | None = None,
    budget_tokens: int | None = None,
    compression: Any = DEFAULT_COMPRESSION,
    heads: Any = "auto",
    band: tuple[float, float] = DEFAULT_LAYERS,
    fusion: str = "attention",
    early_exit: bool = True,
    stored_keys: Any = None,
    cache_salt: str | None = None,
) -> Reranked:
    """Rank ``texts`` for ``question`` by ``engine``'s attention (see the module's doc).

    ``titles``: one per text, shown in its document label. ``fusion``: ``"attention"`` alone, or
    ``"rrf"`` fused with the input order (the retriever's rank). ``heads``: ``"auto"`` (those shipped
    for the model, else every head of ``band``'s layers), None (the band) or (layer, head) pairs.
    ``budget_tokens``: keep the best texts whose stuffed form fits this many of the model's tokens.
    ``stored_keys``: skim from stored keys (:func:`~.skim.skim_stored`) in this
    :class:`~snapkv_rag.reuse.segment_store.SegmentKVStore`, or ``True`` for the engine's own (in
    memory, bounded): a text seen before is placed from its stored K/V instead of read again, which
    pays when the same passages come back for other questions; ``cache_salt``: reuse only K/V
    stored under the same salt."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the reranker needs a non-empty question")
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    if titles is not None and len(titles) != len(texts):
        raise ValueError(f"give one title per text: {len(titles)} titles for {len(texts)} texts")
    if budget_tokens is not None and (isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1):
        raise ValueError(f"budget_tokens must be a positive integer or None, got {budget_tokens!r}")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise TypeError(f"texts must be strings; item {bad[0]} is {type(texts[bad[0]]).__name__}")
    titled = titles if titles is not None else [""] * len(texts)
    chunks = [StoredChunk(id=str(i), text=text, source=f"text-{i}", title=titled[i], position=i, tokens=0) for i, text in enumerate(texts)]
    readable = [c for c in chunks if c.text.strip()]
    if not readable:
        everything = list(range(len(texts)))
        return Reranked(order=everything, scores=[0.0] * len(texts), kept=[] if budget_tokens else everything, seconds=0.0, prompt_tokens=0)
    messages, question_text = build_messages(question, readable)
    prompt_tokens = engine.count_tokens(messages)
    context = StuffedContext(question, question_text, readable, messages, 0, 0, prompt_tokens, len(readable), 0, 0, "rerank")
    chosen_heads = resolve_skim_heads(engine, heads)
    if stored_keys is not None and stored_keys is not False:
        store = engine.segment_store if stored_keys is True else stored_keys
        policy = as_policy(compression)
        unrolled = policy.with_rolling(None) if policy is not None else None
        skimmed = skim_stored(engine, context, unrolled, store, band=band, heads=chosen_heads, early_exit=early_exit, cache_salt=cache_salt)
    else:
        policy = skim_policy(as_policy(compression), prompt_tokens, engine.context_length)
        skimmed = skim(engine, context, policy, band=band, heads=chosen_heads, early_exit=early_exit)
    scores = [0.0] * len(texts)
    for chunk, score in zip(readable, skimmed.scores, strict=True):
        scores[int(chunk.id)] = score
    ranked = [int(c.id) for c in skimmed.ranking(fusion)]
    order = ranked + [c.position for c in chunks if not c.text.strip()]  # blank texts last
    kept = order
    if budget_tokens is not None:
        packing = pack_greedy(len(ranked), lambda index, slot: engine.count_tokens(format_document(slot, chunks[ranked[index]])) + 2, budget_tokens)
        kept = [ranked[i] for i in packing.kept]
    return Reranked(order=order, scores=scores, kept=kept, seconds=skimmed.seconds, prompt_tokens=skimmed.prompt_tokens)
