"""Question answering over a document store: retrieve, stuff, generate through the engine, cite.

Every call goes through the engine's one generation path (``generate``/``stream`` and the
async forms). Citations come by three routes, each labelled: ``generated`` (the model's own
``[n]`` markers), ``attributed`` (evidence matching, :mod:`.attribution`) and ``attention``
(evidence matching plus the run's own attention over each stuffed chunk while it wrote each
sentence, :mod:`snapkv_rag.compression.span_attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..compression import DEFAULT_COMPRESSION, as_policy, can_roll, fit_to_window, parse_compression
from ..compression.less.collection_kernels import policy_for_collection
from ..compression.span_attention import sentence_attention
from ..engine.results import GenerationResult
from .attribution import EvidenceAttributor, SentenceSupport, answer_sentences
from .citations import parse_citations
from .kv_reuse import chunk_kv_store, precompute_chunk_kv, resolve_kv_reuse, reuse_kwargs
from .skim import DEFAULT_LAYERS, FUSIONS, skim, skim_policy, skim_stored
from .skim_heads import resolve_skim_heads
from .store import DocumentStore, StoredChunk
from .stuffing import SYSTEM_PROMPT, ContextBudgetError, StuffedContext, StuffingRetriever, build_messages, chunk_segment

ROUTES = ("generated", "attributed", "attention")
DEFAULT_LOOKUP_TOKENS = 4  # set by eval/decoding/lookup_bench.py (eval/decoding/RESULTS.md, "Prompt-lookup drafts")
TEXT_ROUTES = ("generated", "attributed")  # the routes computed from an answer's text alone
_DEFAULT = object()


@dataclass(frozen=True)
class Citation:
    number: int  # the document number in the prompt, [number]
    route: str  # "generated", "attributed" or "attention"
    chunk: StoredChunk
    score: float | None = None  # attribution score (attributed and attention routes)
    sentence: str | None = None  # the answer sentence it supports (attributed and attention routes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "route": self.route,
            "source": self.chunk.source,
            "title": self.chunk.title,
            "position": self.chunk.position,
            "chunk_id": self.chunk.id,
            "similarity": self.chunk.score,
            "score": self.score,
            "sentence": self.sentence,
            "text": self.chunk.text,
        }


@dataclass(frozen=True)
class Answer:
    question: str
    text: str
    citations: list[Citation]
    invalid_citations: list[int]  # [n] markers that refer to no stuffed document
    context: StuffedContext
    result: GenerationResult
    routes: tuple[str, ...] = field(default=TEXT_ROUTES)
    support: list[SentenceSupport] = field(default_factory=list)  # attributed route: each answer sentence

    @property
    def unsupported(self) -> list[SentenceSupport]:
        """Answer sentences whose numbers, names or dates appear in no stuffed chunk (nothing cited),
        and partly supported ones (cited where their other facts are; ``missing`` says what is not)."""
        return [s for s in self.support if s.missing]

    def cited(self, route: str) -> list[int]:
        """Distinct document numbers cited by ``route``, in order."""
        seen: list[int] = []
        for c in self.citations:
            if c.route == route and c.number not in seen:
                seen.append(c.number)
        return seen

    @property
    def sources(self) -> list[tuple[int, StoredChunk]]:
        """Every cited document once, by number."""
        numbers = sorted({c.number for c in self.citations})
        return [(n, self.context.chunks[n - 1]) for n in numbers]

    def to_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "answer": self.text,
            "citations": [c.to_dict() for c in self.citations],
            "cited": {route: self.cited(route) for route in self.routes},
            "invalid_citations": self.invalid_citations,
            "unsupported": [{"sentence": s.sentence, "missing": list(s.missing), "cited": list(s.numbers)} for s in self.unsupported],
            "context": self.context.to_dict(),
            "finish_reason": self.result.finish_reason,
            "usage": self.result.usage.to_dict(),
            "stats": self.result.stats.to_dict(),
        }


def cite(
    question: str,
    text: str,
    chunks: list[StoredChunk],
    attributor: EvidenceAttributor | None,
    routes: tuple[str, ...] = TEXT_ROUTES,
    attention: Sequence[Sequence[float]] | None = None,
) -> tuple[list[Citation], list[int]]:
    """Citations of an answer ``text`` over numbered ``chunks`` (chunk i is document [i + 1]).

    Returns (citations by each route in ``routes``, the invalid ``[n]`` markers). The
    ``attributed`` and ``attention`` routes need an ``attributor``; the ``attention`` route
    also takes ``attention``, per answer sentence the run's attention share of each chunk
    (without it, it scores by evidence alone and so equals ``attributed``). :class:`DocumentQA`
    and the connectors' chains over already-stuffed documents share this one function
    (through :func:`cite_with_support`, which also returns each sentence's support).
    """
    citations, invalid, _ = cite_with_support(question, text, chunks, attributor, routes, attention)
    return citations, invalid


def cite_with_support(
    question: str,
    text: str,
    chunks: list[StoredChunk],
    attributor: EvidenceAttributor | None,
    routes: tuple[str, ...] = TEXT_ROUTES,
    attention: Sequence[Sequence[float]] | None = None,
) -> tuple[list[Citation], list[int], list[SentenceSupport]]:
    """:func:`cite`, plus each answer sentence's support (by the attributed route, else the
    attention route; empty without either), which says which sentences no chunk supports."""
    unknown = set(routes) - set(ROUTES)
    if unknown:
        raise ValueError(f"unknown citation routes {sorted(unknown)}; choose from {ROUTES}")
    citations: list[Citation] = []
    invalid: list[int] = []
    supports: list[SentenceSupport] = []
    if "generated" in routes:
        valid, invalid = parse_citations(text, len(chunks))
        citations += [Citation(n, "generated", chunks[n - 1]) for n in valid]
    for route in ("attributed", "attention"):
        if route not in routes:
            continue
        if attributor is None:
            raise ValueError(f"the {route} citation route needs an attributor")
        texts = [c.text for c in chunks]
        found = attributor.attribute(question, text, texts, attention) if route == "attention" else attributor.attribute(question, text, texts)
        supports = supports or found
        for support in found:
            citations += [Citation(n, route, chunks[n - 1], score, support.sentence) for n, score in zip(support.numbers, support.scores)]
    return citations, invalid, supports


SMALL_MODEL_PARAMETERS = 1_000_000_000


def small_model_note(engine, remedy: str) -> str | None:
    """What to expect of a model under 1B parameters, said where its answer is read (the CLI,
    the app); ``remedy`` says how to use a larger one there. None for larger models."""
    parameters = engine.info().parameters
    if not parameters or parameters >= SMALL_MODEL_PARAMETERS:
        return None
    return (
        f"Answered by a {parameters / 1e6:.0f}M-parameter model: it is often wrong even with the full cache, may invent "
        'numbers or names the documents do not contain (marked "not supported"), and answers in English. ' + remedy
    )


class AnswerStream:
    """Iterate for answer text pieces; ``answer`` once exhausted."""

    def __init__(self, qa: DocumentQA, context: StuffedContext, stream):
        self._qa, self._context, self._stream = qa, context, stream
        self._answer: Answer | None = None

    @property
    def context(self) -> StuffedContext:
        return self._context

    def __iter__(self) -> Iterator[str]:
        yield from self._stream
        self._answer = self._qa.answer_from(self._context, self._stream.result)

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()

    @property
    def answer(self) -> Answer:
        if self._answer is None:
            raise RuntimeError("the answer stream has not finished yet; iterate it to the end first")
        return self._answer


class DocumentQA:
    """Answers with citations over a :class:`DocumentStore`, generated by ``engine``.

    ``compression``: the default policy of every ask (SnapKV with budget 1024, a question-aligned
    window and, for prompts of at least twice the budget, 16-token spans, unless given; None
    for the full cache). Retrieval options as in
    :class:`StuffingRetriever`. ``routes``: which citation routes to compute (by default
    ``generated`` and ``attributed``; add ``attention`` to record the run's attention over each
    chunk and cite by it too: measured below the attributed route on the embedded model, and
    such runs decode alone rather than in a shared batch, so it is not on by default).
    ``kv_reuse``: ``"chunks"`` (each chunk's K/V computed once, stored in ``kv_dir``, by default
    beside the Chroma store, bounded by ``kv_cache_bytes``, and reused by later questions at
    any position), ``"prefix"`` or ``"off"``; None (default): the engine's
    ``recommended_kv_reuse`` ("chunks", but "prefix" for the embedded 135M model, whose
    answers suffer from blended reuse); see :mod:`snapkv_rag.rag.kv_reuse`.
    ``recompute``: the share of reused chunk tokens recomputed (None: the engine's default).
    ``keep_labels``: every compressed layer keeps each document's opening line (``[n] title``,
    the engine's ``keep_texts``), so the numbers an answer cites are never evicted.
    ``prompt_lookup_num_tokens``: draft tokens looked up in the stuffed documents per decode
    forward for greedy answers (the engine's option; 0: off); the default follows eval/decoding/RESULTS.md,
    "Prompt-lookup drafts".
    ``skim_tokens``: skim, then read (:mod:`.skim`): retrieve this many tokens, read them once
    compressed under ``skim_compression`` (default: the default policy, rolled in 2,048-token chunks),
    rank the documents by the question's attention on them (``skim_fusion``: ``"attention"`` or
    ``"rrf"``, fused with the retrieval rank; ``skim_layers``: the band of layers, as fractions
    of the depth; ``skim_heads``: the (layer, head) pairs read instead, ``"auto"``: those shipped
    for the model, :mod:`.skim_heads`), and answer from the best of them stuffed into
    ``context_tokens``. None: off. ``skim_stored``: skim from stored keys instead
    (:func:`~.skim.skim_stored`): each chunk's K/V come from the chunk store (``kv_dir``; computed
    at ingest with ``snapkv-rag ingest --precompute-kv``, or the first time a chunk is skimmed) and
    only each group's prompt and question run, up to the heads' deepest layer; ``skim_calibrate``
    subtracts what a content-free question draws to each document (ICR's calibration, a second read).
    """

    def __init__(
        self,
        engine,
        store: DocumentStore,
        *,
        compression: Any = _DEFAULT,
        context_tokens: int | None = None,
        max_new_tokens: int = 256,
        top_k: int | None = None,
        min_score: float | None = None,
        where: dict[str, Any] | None = None,
        order: str = "score",
        whole_collection: bool = False,
        system_prompt: str = SYSTEM_PROMPT,
        routes: tuple[str, ...] = TEXT_ROUTES,
        attributor: EvidenceAttributor | None = None,
        kv_reuse: str | None = None,
        kv_dir: str | None = None,
        kv_cache_bytes: int | None = None,
        recompute: float | None = None,
        keep_labels: bool = False,
        prompt_lookup_num_tokens: int = DEFAULT_LOOKUP_TOKENS,
        skim_tokens: int | None = None,
        skim_compression: Any = _DEFAULT,
        skim_fusion: str = "attention",
        skim_layers: tuple[float, float] = DEFAULT_LAYERS,
        skim_heads: Any = "auto",
        skim_stored: bool = False,
        skim_calibrate: bool = False,
    ):
        unknown = set(routes) - set(ROUTES)
        if unknown:
            raise ValueError(f"unknown citation routes {sorted(unknown)}; choose from {ROUTES}")
        self.engine = engine
        self.store = store
        self.compression = DEFAULT_COMPRESSION if compression is _DEFAULT else compression
        self.max_new_tokens = max_new_tokens
        self.routes = tuple(routes)
        self.retriever = StuffingRetriever(
            store,
            engine,
            context_tokens=context_tokens,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            min_score=min_score,
            where=where,
            order=order,
            whole_collection=whole_collection,
            system_prompt=system_prompt,
            past_window=can_roll(as_policy(self.compression)),
        )
        self.attributor = attributor or EvidenceAttributor(store.embedder)
        self.kv_reuse = resolve_kv_reuse(kv_reuse, engine)
        self.kv_store = chunk_kv_store(store, kv_dir, kv_cache_bytes) if self.kv_reuse == "chunks" else None
        if not isinstance(skim_stored, bool):
            raise ValueError(f"skim_stored must be True or False, got {skim_stored!r}")
        self.skim_stored = skim_stored
        if skim_calibrate and not skim_stored:
            raise ValueError("skim_calibrate reads every group twice; it is offered for the skim from stored keys (skim_stored=True)")
        self.skim_calibrate = skim_calibrate
        self._skim_kv_store = (self.kv_store or chunk_kv_store(store, kv_dir, kv_cache_bytes)) if skim_stored else None
        self.recompute = recompute
        self.keep_labels = keep_labels
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.skim_retriever = self._skim_retriever(skim_tokens, skim_fusion, whole_collection)
        self.skim_compression = DEFAULT_COMPRESSION if skim_compression is _DEFAULT else skim_compression
        self.skim_fusion = skim_fusion
        self.skim_layers = skim_layers
        self.skim_heads = resolve_skim_heads(engine, skim_heads) if self.skim_retriever is not None else None

    def _skim_retriever(self, skim_tokens: int | None, fusion: str, whole_collection: bool) -> StuffingRetriever | None:
        if skim_tokens is None:
            return None
        if isinstance(skim_tokens, bool) or not isinstance(skim_tokens, int) or skim_tokens < 1:
            raise ContextBudgetError(f"skim_tokens must be a positive integer or None, got {skim_tokens!r}")
        if fusion not in FUSIONS:
            raise ValueError(f"skim_fusion must be one of {FUSIONS}, got {fusion!r}")
        if whole_collection:
            raise ContextBudgetError("skim_tokens re-ranks retrieved chunks; whole_collection=True stuffs every chunk in source order instead")
        r = self.retriever
        return StuffingRetriever(
            r.store,
            r.engine,
            context_tokens=skim_tokens,
            max_new_tokens=1,
            top_k=r.top_k,
            min_score=r.min_score,
            where=r.where,
            system_prompt=r.system_prompt,
            past_window=True,
        )

    def precompute_kv(self, *, progress: bool = False) -> tuple[int, int]:
        """Compute every stored chunk's K/V now (``kv_reuse="chunks"``); returns ``(computed, already stored)``."""
        if self.kv_store is None:
            raise ValueError('precompute_kv needs kv_reuse="chunks"')
        return precompute_chunk_kv(self.engine, self.store.all_chunks(), self.kv_store, progress=progress)

    def policy(self, compression: Any = _DEFAULT) -> Any:
        """The compression an ask uses: ``compression`` (default: this QA's), where a LESS policy
        without kernels of its own takes the collection's calibration (``snapkv-rag less
        calibrate``): its kernels, or its base policy where LESS measured worse than the base."""
        chosen = self.compression if compression is _DEFAULT else compression
        if isinstance(chosen, str) and chosen.strip().lower().startswith("less"):
            chosen = parse_compression(chosen)
        return policy_for_collection(chosen, self.store, self.engine.model)

    def retrieve(self, question: str) -> StuffedContext:
        """The stuffed context an ask answers from (with ``skim_tokens``: after the skim)."""
        if self.skim_retriever is None:
            return self.retriever.retrieve(question)
        wide = self.skim_retriever.retrieve(question)
        if self._skim_kv_store is not None:
            unrolled = as_policy(self.policy(self.skim_compression))
            unrolled = unrolled.with_rolling(None) if unrolled is not None else None
            skimmed = skim_stored(self.engine, wide, unrolled, self._skim_kv_store, band=self.skim_layers, heads=self.skim_heads, calibrate=self.skim_calibrate)
        else:
            policy = skim_policy(self.policy(self.skim_compression), wide.prompt_tokens, self.engine.context_length)
            skimmed = skim(self.engine, wide, policy, band=self.skim_layers, heads=self.skim_heads)
        context = self.retriever.retrieve(question, ranked=skimmed.ranking(self.skim_fusion))
        summary = {
            "skimmed_prompt_tokens": skimmed.prompt_tokens,
            "skimmed_documents": len(wide.chunks),
            "skim_seconds": round(skimmed.seconds, 3),
            "fusion": self.skim_fusion,
            "heads": "chosen" if self.skim_heads else "middle layers",
            "from": "stored keys" if self._skim_kv_store is not None else "prefill",
        }
        if self._skim_kv_store is not None:
            summary |= {"reused_tokens": skimmed.reused_tokens, "chunks_computed": skimmed.stored_misses}
        return dataclasses.replace(context, settings={**context.settings, "skim": summary})

    def generation_kwargs(self, context: StuffedContext, *, compression: Any = _DEFAULT, **sampling: Any) -> dict[str, Any]:
        """What :meth:`answer_context` passes to :meth:`Engine.generate` with ``context.messages``:
        the policy (rolled past the window where needed), the question, reuse and sampling options.
        Benchmarks call the engine with these (and their own overrides), then :meth:`answer_from`."""
        reuse = reuse_kwargs(self.kv_reuse, context.segments, self.kv_store)
        if self.recompute is not None and "reuse_segments" in reuse:
            reuse["recompute"] = self.recompute
        if "attention" in self.routes:
            sampling.setdefault("attend_to", [chunk_segment(c) for c in context.chunks])
        new_tokens = sampling.get("max_new_tokens", self.max_new_tokens)
        policy = fit_to_window(as_policy(self.policy(compression)), context.prompt_tokens, new_tokens, self.engine.context_length)
        if self.keep_labels and policy is not None and context.chunks:
            sampling.setdefault("keep_texts", context.labels())
        if self.prompt_lookup_num_tokens and sampling.get("temperature", 0) == 0:
            sampling.setdefault("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens)
        return {
            "compression": policy,
            "question": context.question_text,
            "max_new_tokens": sampling.pop("max_new_tokens", self.max_new_tokens),
            **reuse,
            **sampling,
        }

    def answer_from(self, context: StuffedContext, result: GenerationResult) -> Answer:
        """The cited :class:`Answer` for ``result``, generated over ``context``."""
        attention = None
        if "attention" in self.routes and result.span_attention:
            attention = sentence_attention(self.engine.tokenizer, result.token_ids, result.span_attention, answer_sentences(result.text))
        citations, invalid, support = cite_with_support(context.question, result.text, context.chunks, self.attributor, self.routes, attention)
        return Answer(context.question, result.text, citations, invalid, context, result, self.routes, support)

    def ask(self, question: str, *, compression: Any = _DEFAULT, **sampling: Any) -> Answer:
        """Retrieve, stuff, generate and cite. ``sampling`` as in :meth:`Engine.generate`."""
        return self.answer_context(self.retrieve(question), compression=compression, **sampling)

    def answer_context(self, context: StuffedContext, *, compression: Any = _DEFAULT, **sampling: Any) -> Answer:
        """Generate and cite over an already stuffed ``context`` (from :meth:`retrieve`), so
        several compression settings can answer from the very same prompt."""
        result = self.engine.generate(context.messages, **self.generation_kwargs(context, compression=compression, **sampling))
        return self.answer_from(context, result)

    def follow_up(self, question: str, previous: StuffedContext | Answer, *, compression: Any = _DEFAULT, keep_context: Any = True, **sampling: Any) -> Answer:
        """Ask ``question`` of the very documents an earlier answer read, compressed once for all such
        questions: the documents (the prompt before the question) are read under the policy without any
        question and kept (the engine's ``keep_context``, :mod:`snapkv_rag.reuse.kept_contexts`), so every
        follow-up after the first reads only its own question. ``keep_context``: a policy of its own for the
        kept documents (``"expected:budget=2048"``), each question then cut to ``compression`` with its own
        window. Citations by the ``attention`` route and chunk reuse are not used here (the kept context is
        read once for every question)."""
        earlier = previous.context if isinstance(previous, Answer) else previous
        messages, question_text = build_messages(question, earlier.chunks, self.retriever.system_prompt)
        context = dataclasses.replace(
            earlier, question=question, question_text=question_text, messages=messages, prompt_tokens=self.engine.count_tokens(messages), settings={}
        )
        kwargs = self.generation_kwargs(context, compression=compression, **sampling)
        for key in ("reuse_segments", "segment_store", "recompute", "attend_to", "keep_texts", "prefix_cache"):
            kwargs.pop(key, None)
        return self.answer_from(context, self.engine.generate(context.messages, keep_context=keep_context, **kwargs))

    def stream(self, question: str, *, compression: Any = _DEFAULT, **sampling: Any) -> AnswerStream:
        context = self.retrieve(question)
        return AnswerStream(self, context, self.engine.stream(context.messages, **self.generation_kwargs(context, compression=compression, **sampling)))

    async def aask(self, question: str, *, compression: Any = _DEFAULT, **sampling: Any) -> Answer:
        import asyncio

        context = await asyncio.to_thread(self.retrieve, question)
        result = await self.engine.agenerate(context.messages, **self.generation_kwargs(context, compression=compression, **sampling))
        return await asyncio.to_thread(self.answer_from, context, result)

    async def astream(self, question: str, *, compression: Any = _DEFAULT, **sampling: Any) -> AsyncIterator[str | Answer]:
        """Yield text pieces, then the :class:`Answer` last."""
        import asyncio

        context = await asyncio.to_thread(self.retrieve, question)
        stream = self.engine.astream(context.messages, **self.generation_kwargs(context, compression=compression, **sampling))
        async for piece in stream:
            yield piece
        yield await asyncio.to_thread(self.answer_from, context, stream.result)
