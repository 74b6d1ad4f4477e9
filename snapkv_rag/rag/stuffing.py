"""Pack as many retrieved chunks as fit a token budget of the *LLM's* tokenizer into one prompt.

The prompt numbers the chunks ``[1]..[N]`` with their titles, asks for bracketed citations,
and puts the question last, where SnapKV's observation window sees it. In whole-collection
mode every chunk goes in, in a stable order, so every question shares the same prefix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SnapKVRagError
from .ordering import StuffedOrders, orders_for, reuse_order
from .packing import MIN_ROOM, pack_greedy
from .store import DocumentStore, StoredChunk

SYSTEM_PROMPT = (
    "Answer the question using only the numbered documents. After each sentence, cite the "
    "documents that support it by number in brackets, like [2]. If the documents do not "
    "contain the answer, say so."
)
ORDERS = ("score", "source", "cache")


class EmptyCollectionError(SnapKVRagError, LookupError):
    """The collection holds no documents to answer from."""

    @classmethod
    def named(cls, name: str) -> EmptyCollectionError:
        return cls(f"collection {name!r} has no documents; add some first (snapkv-rag ingest PATH --collection {name})")


class ContextBudgetError(SnapKVRagError, ValueError):
    """The requested context budget cannot hold the prompt (or the whole collection)."""


@dataclass(frozen=True)
class StuffedContext:
    """What went into one prompt, and what did not."""

    question: str
    question_text: str  # the question exactly as it appears in the prompt (the aligned window starts here)
    chunks: list[StoredChunk]  # chunk i is document [i + 1]
    messages: list[dict[str, str]]
    budget_tokens: int  # for the numbered documents
    document_tokens: int  # used by them (LLM tokens)
    prompt_tokens: int  # the whole rendered prompt
    candidates: int
    left_out: int
    left_out_tokens: int  # LLM tokens the left-out candidates would have taken
    mode: str
    settings: dict[str, Any] = field(default_factory=dict)
    duplicates: int = 0  # candidates dropped because a better-ranked one has the same text

    @property
    def fill(self) -> float:
        return self.document_tokens / self.budget_tokens if self.budget_tokens else 0.0

    @property
    def segments(self) -> list[str]:
        """Each document's text as it appears in the prompt: the reusable segments (the "[n] title" labels change with position, so they stay out)."""
        return [chunk_segment(c) for c in self.chunks]

    def labels(self) -> list[str]:
        """Each stuffed document's opening line (``[n] title``), in prompt order."""
        return [document_label(i, c) for i, c in enumerate(self.chunks, start=1)]

    def chunk_for(self, number: int) -> StoredChunk | None:
        return self.chunks[number - 1] if 1 <= number <= len(self.chunks) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "chunks": len(self.chunks),
            "budget_tokens": self.budget_tokens,
            "document_tokens": self.document_tokens,
            "prompt_tokens": self.prompt_tokens,
            "fill": round(self.fill, 4),
            "candidates": self.candidates,
            "left_out": self.left_out,
            "left_out_tokens": self.left_out_tokens,
            "mode": self.mode,
            "duplicates": self.duplicates,
            **self.settings,
        }


# A line of document text that reads like a label ("[3] Official policy"): written "(3) ..." in
# the prompt, so a document cannot pose as another one that citations would then point to. A line
# starts after any break str.splitlines honours (a model reads "\r" or U+2028 as one too), not only "\n".
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_FORGED_LABEL = re.compile(rf"(?:^|(?<=[{_LINE_BREAKS}]))(\s*)\[(\s*\d+\s*)\]")
_MARKER_IN_TITLE = re.compile(r"\[(\s*\d+\s*)\]")


def chunk_segment(chunk: StoredChunk) -> str:
    """The chunk's text as the prompt holds it (lines opening with ``[n]`` rewritten ``(n)``)."""
    return _FORGED_LABEL.sub(r"\1(\2)", chunk.text.strip())


def document_label(number: int, chunk: StoredChunk) -> str:
    """The line that opens a stuffed document: its number and title (on one line, any ``[n]`` of
    its own rewritten ``(n)``)."""
    title = " ".join(chunk.title.split()) if chunk.title else ""
    title = _MARKER_IN_TITLE.sub(r"(\1)", title)
    return f"[{number}] {title}" if title else f"[{number}]"


def format_document(number: int, chunk: StoredChunk) -> str:
    return f"{document_label(number, chunk)}\n{chunk_segment(chunk)}"


def build_messages(question: str, chunks: Sequence[StoredChunk], system_prompt: str = SYSTEM_PROMPT) -> tuple[list[dict[str, str]], str]:
    """The chat messages for ``question`` over numbered ``chunks``, and the question's text."""
    question_text = f"Question: {question.strip()}"
    documents = "\n\n".join(format_document(i + 1, c) for i, c in enumerate(chunks))
    body = f"Documents:\n\n{documents}\n\n{question_text}" if chunks else f"Documents: none.\n\n{question_text}"
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": body}], question_text


class StuffingRetriever:
    """Rank chunks by similarity, then fill the LLM's token budget with them.

    ``engine``: the :class:`~snapkv_rag.Engine` whose tokenizer and context count.
    ``context_tokens``: tokens for the numbered documents; default: the engine's
    ``recommended_context_tokens`` when it has one (the embedded model: 1000, chosen by
    measurement), else the model's context minus ``max_new_tokens`` and the rest of the prompt
    (template, instructions, question). ``whole_collection`` always fills the context.
    ``top_k``: at most this many chunks; ``min_score``: drop chunks less similar (cosine);
    ``where``: a Chroma metadata filter (e.g. ``{"file": "/path/a.md"}``); ``order``:
    ``"score"`` (best first), ``"source"`` (file, then position) or ``"cache"`` (the same chunks
    as score order, but those that opened a recent prompt first, in that prompt's order, so the
    engine's prefix cache reuses their K/V: :mod:`.ordering`); ``orders``: the recent prompts'
    orders that ``"cache"`` follows (default: one per engine, shared by its retrievers); ``whole_collection``:
    every chunk, in source order, or :class:`ContextBudgetError` when they do not fit.
    ``past_window``: an explicit ``context_tokens`` may exceed the model's window (the caller's
    policy reads the prompt with a rolling prefill, ``rolling=``).
    """

    def __init__(
        self,
        store: DocumentStore,
        engine,
        *,
        context_tokens: int | None = None,
        max_new_tokens: int = 256,
        top_k: int | None = None,
        min_score: float | None = None,
        where: dict[str, Any] | None = None,
        order: str = "score",
        whole_collection: bool = False,
        system_prompt: str = SYSTEM_PROMPT,
        past_window: bool = False,
        orders: StuffedOrders | None = None,
    ):
        if order not in ORDERS:
            raise ContextBudgetError(f"order must be one of {ORDERS}, got {order!r}")
        for name, value in (("context_tokens", context_tokens), ("top_k", top_k)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ContextBudgetError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ContextBudgetError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.store = store
        self.engine = engine
        embedder = getattr(store, "embedder", None)  # a LangChain vector store as the source has none of ours
        if embedder is not None and getattr(embedder, "runner", False) is None and hasattr(engine, "run_on_model"):
            embedder.runner = engine.run_on_model  # keep the process's torch work on the engine's thread
            embedder.busy = lambda: bool(getattr(engine, "decoding", False))
        self.context_tokens = context_tokens
        self.max_new_tokens = max_new_tokens
        self.top_k = top_k
        self.min_score = min_score
        self.where = where
        self.order = order
        self.orders = orders if orders is not None else (orders_for(engine) if order == "cache" else None)
        self.whole_collection = whole_collection
        self.system_prompt = system_prompt
        # an explicit context_tokens may exceed the model's window: the prompt is read by a rolling prefill
        self.past_window = past_window

    def _count(self, text: str) -> int:
        return len(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _budget(self, question: str) -> tuple[int, int]:
        """(tokens for the documents, the hard cap on the whole prompt)."""
        context = self.engine.context_length
        empty, _ = build_messages(question, [], self.system_prompt)
        # The empty prompt says "Documents: none."; with documents it says "Documents:\n\n" + blocks.
        overhead = self.engine.count_tokens(empty)
        cap = context - self.max_new_tokens if context else None
        if cap is not None and overhead >= cap:
            raise ContextBudgetError(
                f"the question and instructions take {overhead} tokens; with max_new_tokens={self.max_new_tokens} "
                f"no room is left in the {context}-token context for documents"
            )
        room = cap - overhead if cap is not None else None
        recommended = None if self.whole_collection else getattr(self.engine, "recommended_context_tokens", None)
        if self.context_tokens is not None and self.past_window:
            return self.context_tokens, overhead + self.context_tokens
        if self.context_tokens is not None:
            if room is not None and self.context_tokens > room:
                raise ContextBudgetError(
                    f"context_tokens={self.context_tokens} does not fit: the model's context is {context} tokens, "
                    f"max_new_tokens={self.max_new_tokens} and the rest of the prompt takes {overhead}; use at most {room}, "
                    "or a sparse compression policy, whose prefill then reads past the window (rolling=)"
                )
            budget = self.context_tokens
        elif recommended is not None:  # a model that answers best from a shorter stuffing
            budget = recommended if room is None else min(recommended, room)
        elif room is None:
            raise ContextBudgetError("the model reports no context length; pass context_tokens")
        else:
            budget = room
        return budget, cap if cap is not None else overhead + budget

    def _candidates(self, question: str, budget: int) -> tuple[list[StoredChunk], int]:
        """(distinct candidates, best first; how many repeated a better-ranked chunk's text)."""
        if self.whole_collection:
            return self._drop_duplicate_texts(self.store.all_chunks(self.where))
        # Enough candidates to fill the budget with short chunks, without fetching a whole large collection.
        wanted = self.top_k or max(64, budget // 25)
        limit = wanted
        while True:
            fetched = self.store.search(question, limit, self.where)
            exhausted = len(fetched) < limit
            if self.min_score is not None:
                passing = [c for c in fetched if (c.score or 0.0) >= self.min_score]
                exhausted = exhausted or len(passing) < len(fetched)  # ranked by score: the rest score lower
                fetched = passing
            unique, duplicates = self._drop_duplicate_texts(fetched, wanted)
            # Duplicates take places in the ranking; fetch deeper so they do not cost distinct chunks.
            if len(unique) >= wanted or exhausted:
                return unique, duplicates
            limit *= 2

    @staticmethod
    def _drop_duplicate_texts(chunks: list[StoredChunk], wanted: int | None = None) -> tuple[list[StoredChunk], int]:
        """Keep the first (best-ranked) chunk of each text, up to ``wanted`` of them, and count the
        repeats met on the way: the same file ingested under two paths (two checkouts, a copy)
        would otherwise be stuffed twice and cited as two sources."""
        seen: set[str] = set()
        unique: list[StoredChunk] = []
        duplicates = 0
        for chunk in chunks:
            if wanted is not None and len(unique) == wanted:
                break
            if chunk.text in seen:
                duplicates += 1
            else:
                seen.add(chunk.text)
                unique.append(chunk)
        return unique, duplicates

    def retrieve(self, question: str, *, ranked: list[StoredChunk] | None = None) -> StuffedContext:
        """Stuff the best-ranked chunks for ``question`` into the budget; ``ranked``: these
        chunks, best first, instead of the store's similarity ranking (a skim's re-ranking)."""
        if not isinstance(question, str) or not question.strip():
            from ..errors import EmptyPromptError

            raise EmptyPromptError("the question is empty")
        budget, cap = self._budget(question)
        candidates, duplicates = self._candidates(question, budget) if ranked is None else (list(ranked), 0)
        if not candidates and self.store.count() == 0:
            raise EmptyCollectionError.named(self.store.name)
        # A separator of two newlines joins blocks; count it with the block.
        packing = pack_greedy(
            len(candidates),
            lambda i, slot: self._count("\n\n" + format_document(slot, candidates[i])),
            budget,
            min_room=0 if self.whole_collection else MIN_ROOM,
            stop_at_first_miss=self.whole_collection,
        )
        if self.whole_collection and not packing.complete:
            total = sum(self._count("\n\n" + format_document(i + 1, c)) for i, c in enumerate(candidates))
            raise ContextBudgetError(
                f"the whole collection ({len(candidates)} chunks, about {total} tokens) does not fit the "
                f"{budget}-token budget; use retrieval (whole_collection=False) or a model with a longer context"
            )
        packed = [candidates[i] for i in packing.kept]
        costs = {candidates[i].id: c for i, c in packing.costs.items()}
        reused_head = 0
        if self.order == "source" and not self.whole_collection:
            packed.sort(key=lambda c: (c.file, c.source, c.position))
        elif self.order == "cache" and self.orders is not None and not self.whole_collection:
            by_id = {c.id: c for c in packed}
            ids, reused_head = reuse_order([c.id for c in packed], self.orders, self.system_prompt, lambda i: costs.get(i, 0))
            packed = [by_id[i] for i in ids]
        messages, question_text = build_messages(question, packed, self.system_prompt)
        total = self.engine.count_tokens(messages)
        overhead = self.engine.count_tokens(build_messages(question, [], self.system_prompt)[0])
        # Token merges across block edges can differ from the per-block counts; re-check the real prompt.
        while packed and (total > cap or total - overhead > budget):
            if self.whole_collection:
                raise ContextBudgetError(f"the whole collection takes {total} prompt tokens, over the cap of {cap}")
            packed.pop()
            messages, question_text = build_messages(question, packed, self.system_prompt)
            total = self.engine.count_tokens(messages)
        if candidates and not packed:
            smallest = min(self._count("\n\n" + format_document(1, c)) for c in candidates)
            raise ContextBudgetError(
                f"a budget of {budget} document tokens holds none of the {len(candidates)} retrieved chunks "
                f"(the smallest takes {smallest}); raise context_tokens to at least {smallest}"
            )
        reused_head = min(reused_head, len(packed))
        if self.orders is not None:
            self.orders.record([c.id for c in packed], self.system_prompt)
        kept_ids = {c.id for c in packed}
        left = [c for c in candidates if c.id not in kept_ids]
        return StuffedContext(
            question=question,
            question_text=question_text,
            chunks=packed,
            messages=messages,
            budget_tokens=budget,
            document_tokens=max(0, total - overhead),
            prompt_tokens=total,
            candidates=len(candidates),
            left_out=len(left),
            left_out_tokens=sum(costs.get(c.id) or self._count("\n\n" + format_document(1, c)) for c in left),
            mode="whole_collection" if self.whole_collection else "retrieval",
            settings={"order": self.order, "reused_head": reused_head, "top_k": self.top_k, "min_score": self.min_score, "where": self.where},
            duplicates=duplicates,
        )
