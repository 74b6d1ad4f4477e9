"""Which attention heads a skim reads: chosen once per model on generated look-alike reads.

Most heads of a small model attend from the question to the prompt's first token, to the
question itself or to whatever came last; a few match the question's words to the same words in
a document (retrieval heads: Wu et al. 2024, arXiv:2404.15574; query-focused retrieval heads,
QRHead, Zhang et al. 2025, arXiv:2506.09944). The skim reads those. :func:`choose_heads` finds them:
it reads generated look-alike contexts (dozens of documents of one kind written from the same
sentences, one question naming its entity by a fact only the gold document states), scores every
document by each (layer, head)'s attention mass from the question, and keeps the heads whose
ranking puts the gold document highest (mean reciprocal rank).

The calibration reads (:mod:`snapkv_rag.harness.skim_head_reads`) come from the tuning world's
*training* domains, with cue wordings of their own, so the look-alike corpus the skim is measured
on (held-out domains and cue wordings, :mod:`snapkv_rag.harness.lookalike_corpus`) stays unseen.
The heads chosen for the embedded model ship as package data (``skim_heads/<model>.json``,
written by ``python -m eval skim_heads``); a model without them reads every head of the middle
layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..compression.runtime import recording_window_votes
from .kept import document_spans
from .skim import DEFAULT_LAYERS, combined_scores, middle_layers
from .store import StoredChunk
from .stuffing import StuffedContext, build_messages

SHIPPED = Path(__file__).resolve().parent / "skim_heads"
TOP_HEADS = 8  # at most
HEAD_COUNTS = (1, 2, 4, 8)  # the numbers of best heads tried together


@dataclass(frozen=True)
class CalibrationRead:
    question: str
    chunks: list[StoredChunk]
    gold: int  # index of the gold document in ``chunks``


@dataclass(frozen=True)
class SkimHeads:
    """The heads a skim reads for one model, and how they ranked on the calibration reads."""

    model: str  # :func:`model_key`: the model's name and any adapter merged into it
    heads: list[tuple[int, int]]  # (layer, query head)
    mrr: float  # the chosen heads together, mean reciprocal rank of the gold document
    band_mrr: float  # every head of the middle layers, on the same reads
    position_mrr: float  # the documents in prompt order, last first (what recency alone gives)
    reads: int
    tokens: int  # document tokens of each read, about

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "heads": [list(h) for h in self.heads]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SkimHeads:
        data = json.loads(text)
        return cls(**{**data, "heads": [tuple(h) for h in data["heads"]]})


def reciprocal_rank(scores: Sequence[float], gold: int) -> float:
    better = sum(s > scores[gold] for s in scores)
    return 1.0 / (better + 1)


def choose_heads(engine, reads: Sequence[CalibrationRead], compression, *, top: int = TOP_HEADS, progress: Callable[[str], None] | None = None) -> SkimHeads:
    """The heads whose attention ranks the gold document highest over ``reads`` (each read once
    under ``compression``, a policy with an observation window): the best 1, 2, 4 or 8 (at most
    ``top``), whichever together rank it best."""
    per_head: dict[tuple[int, int], list[float]] = {}
    document_sums: list[dict[tuple[int, int], list[float]]] = []  # per read: each head's score of each document
    band_rr, position_rr, tokens = [], [], []
    for n, read in enumerate(reads, start=1):
        messages, question_text = build_messages(read.question, read.chunks)
        prompt_tokens = engine.count_tokens(messages)
        n_chunks = len(read.chunks)
        context = StuffedContext(
            read.question, question_text, read.chunks, messages, prompt_tokens, prompt_tokens, prompt_tokens, n_chunks, 0, 0, "calibration"
        )
        with recording_window_votes() as recorded:
            engine.generate(messages, compression=compression, question=question_text, max_new_tokens=1, prefix_cache=False)
        if not recorded:
            raise ValueError("the calibration reads recorded no votes: give a sparse policy with an observation window")
        votes = recorded[-1]
        spans = document_spans(engine.tokenizer, context)
        tokens.append(spans[-1][1] - spans[0][0])
        for layer, mass in votes.layers.items():
            for head in range(mass.shape[0]):
                scores = [float(mass[head, a:b].sum()) for a, b in spans]
                per_head.setdefault((layer, head), []).append(reciprocal_rank(scores, read.gold))
        band = [(layer, h) for layer in middle_layers(list(votes.layers), DEFAULT_LAYERS) for h in range(votes.layers[layer].shape[0])]
        band_scores = combined_scores([[float(votes.layers[layer][h, a:b].sum()) for a, b in spans] for layer, h in band])
        band_rr.append(reciprocal_rank(band_scores, read.gold))
        position_rr.append(reciprocal_rank(list(range(len(spans))), read.gold))
        document_sums.append({key: [float(votes.layers[key[0]][key[1], a:b].sum()) for a, b in spans] for key in per_head})
        if progress:
            progress(f"calibration read {n}/{len(reads)}: {prompt_tokens} tokens")
    mean = {key: sum(v) / len(v) for key, v in per_head.items()}
    ranked = sorted(mean, key=lambda k: (-mean[k], k))

    def mrr_of(heads: list[tuple[int, int]]) -> float:
        return sum(reciprocal_rank(combined_scores([sums[k] for k in heads]), read.gold) for read, sums in zip(reads, document_sums)) / len(reads)

    # the best few heads together; more heads where they do as well (a choice less tied to these reads)
    sizes = [k for k in HEAD_COUNTS if k <= top] or [top]
    scored = {k: mrr_of(ranked[:k]) for k in sizes}
    best = max(scored.values())
    chosen = ranked[: max(k for k, m in scored.items() if m >= best - 0.01)]
    return SkimHeads(
        model=model_key(engine),
        heads=chosen,
        mrr=round(mrr_of(chosen), 4),
        band_mrr=round(sum(band_rr) / len(band_rr), 4),
        position_mrr=round(sum(position_rr) / len(position_rr), 4),
        reads=len(reads),
        tokens=int(sum(tokens) / len(tokens)),
    )


def model_key(engine) -> str:
    """The weights heads are chosen for: the engine's model name, and the adapter merged into it
    (by folder name) where there is one. The dtype and the weight layout do not change which heads
    retrieve, so the key leaves them out."""
    adapter = getattr(engine.model, "snapkv_adapter", None)
    return f"{engine.name}+{Path(str(adapter)).name}" if adapter else str(engine.name)


def shipped_heads(engine) -> SkimHeads | None:
    """The heads shipped for ``engine``'s weights (:func:`model_key`), else for its base model when an
    adapter is merged and none were chosen for it (a LoRA adapter moves the weights little; which heads
    retrieve is learned in pre-training); None where none were chosen."""
    shipped = {heads.model: heads for heads in (SkimHeads.from_json(path.read_text()) for path in sorted(SHIPPED.glob("*.json")))}
    return shipped.get(model_key(engine)) or shipped.get(str(engine.name))


def resolve_skim_heads(engine, heads: Any) -> list[tuple[int, int]] | None:
    """``heads`` as a skim reads them: ``"auto"``, those shipped for ``engine`` (None where none were
    chosen: every head of the middle layers); None; or (layer, head) pairs, checked."""
    if heads == "auto":
        shipped = shipped_heads(engine)
        return None if shipped is None else list(shipped.heads)
    if heads is None:
        return None
    try:
        pairs = [(int(layer), int(head)) for layer, head in heads]
    except (TypeError, ValueError):
        raise ValueError(f'skim_heads must be "auto", None or (layer, head) pairs, got {heads!r}') from None
    if not pairs:
        raise ValueError("skim_heads names no heads")
    return pairs
