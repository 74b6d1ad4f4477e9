"""Citation F1 on the RAG pipeline: real ingest, retrieval, stuffing and DocumentQA answers.

One run ingests a corpus into a Chroma collection (a temporary one unless a store is
named), stuffs each question's retrieved chunks into one prompt (``context_tokens`` LLM
tokens of documents), and answers that very prompt with the uncompressed model, the
uncompressed model again with another thread count (the noise floor) and every method x
budget. Both citation routes are scored: ``generated`` (the model's ``[n]`` markers) and
``attributed`` (evidence matching, :mod:`snapkv_rag.rag.attribution`).

Gold documents of a question are the stuffed chunks that come from one of its gold files;
retrieval recall is the share of questions with a gold file among the stuffed chunks.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EvalInputError
from ..rag.attribution import DEFAULT_THRESHOLDS, EvidenceAttributor, sweep
from ..rag.qa import ROUTES, DocumentQA
from ..rag.store import DocumentStore
from .metrics import citation_prf
from .runner import FULL, Method, Record, _progress, _with_threads, common_fields, resolved_window

NOISE = Method("full (noise floor)", None, None)
# (method, threshold, margin) settings compared on the uncompressed answers.
ATTRIBUTION_GRID: tuple[tuple[str, float, float], ...] = tuple(
    [("hybrid", t, m) for t in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0) for m in (0.0, 0.1, 0.2)]
    + [("embedding", t, m) for t in (0.2, 0.3, 0.4, 0.5, 0.6) for m in (0.0, 0.05, 0.1)]
    + [("lexical", t, m) for t in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7) for m in (0.0, 0.1, 0.2)]
)


def _repo_examples() -> Path:
    here = Path(__file__).resolve().parents[2] / "examples"
    return here if here.is_dir() else Path("examples")


DEFAULT_CORPUS = _repo_examples() / "sample_corpus"
DEFAULT_QUESTIONS = _repo_examples() / "sample_questions.jsonl"


@dataclass(frozen=True)
class RagQuestion:
    question: str
    answer: str | None  # a short answer string; accuracy = it appears in the output (case-insensitive)
    gold: tuple[str, ...]  # gold files, relative to the corpus folder (or bare file names)


def load_questions(path: str | Path, limit: int | None = None) -> list[RagQuestion]:
    """JSON lines with ``question``, optional ``answer`` and ``gold`` (a file name or a list)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise EvalInputError(f"cannot read questions file {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            gold = item.get("gold", [])
            gold = (gold,) if isinstance(gold, str) else tuple(gold)
            out.append(RagQuestion(str(item["question"]), item.get("answer"), gold))
        except (ValueError, KeyError, TypeError) as exc:
            raise EvalInputError(f"{path}:{n}: a question line needs a 'question' field and optional 'answer', 'gold': {exc}") from None
    if not out:
        raise EvalInputError(f"{path} holds no questions")
    return out[:limit] if limit else out


def is_gold_file(file: str, gold: Sequence[str]) -> bool:
    path = Path(file).as_posix()
    return any(path == g or path.endswith("/" + g.lstrip("/")) for g in (Path(g).as_posix() for g in gold))


def answer_correct(output: str, answer: str | None) -> bool | None:
    return None if not answer else answer.lower() in output.lower()


def run_rag_citation(
    engine,
    methods: Sequence[Method],
    *,
    corpus: str | Path = DEFAULT_CORPUS,
    questions: str | Path | Sequence[RagQuestion] = DEFAULT_QUESTIONS,
    n_questions: int | None = None,
    context_tokens: int = 2500,
    max_new_tokens: int = 48,
    store: str | Path | None = None,
    collection: str = "snapkv-eval",
    embedder: Any = None,
    chunk_tokens: int = 200,
    overlap: int = 40,
    attributor: EvidenceAttributor | None = None,
    attribution_grid: Sequence[tuple[str, float, float]] = ATTRIBUTION_GRID,
    noise_threads: int | None = 1,
    progress: bool = True,
) -> list[Record]:
    """One record per (method, question, route); the uncompressed records of the attributed
    route also carry ``attribution_sweep`` (cited numbers under each setting of the grid).
    ``noise_threads``: the thread count of the noise-floor rerun (None or 0: no rerun)."""
    qs = list(questions) if not isinstance(questions, (str, Path)) else load_questions(questions)
    qs = qs[:n_questions] if n_questions else qs
    corpus = Path(corpus)
    if not corpus.exists():
        raise EvalInputError(f"corpus {corpus} does not exist")
    with tempfile.TemporaryDirectory(prefix="snapkv-eval-") as tmp:
        docs = DocumentStore(collection, path=store or tmp, embedder=embedder)
        ingest = docs.ingest([corpus], chunk_tokens=chunk_tokens, overlap=overlap)
        qa = DocumentQA(
            engine,
            docs,
            compression=None,
            context_tokens=context_tokens,
            max_new_tokens=max_new_tokens,
            attributor=attributor,
            kv_reuse="prefix",
            routes=ROUTES,
        )
        shared = {
            "corpus": str(corpus),
            "collection": collection,
            "store": str(store) if store else "temporary",
            "corpus_files": ingest.files,
            "corpus_chunks": docs.count(),
            "embedder": docs.embedder.model_name,
            "chunk_tokens": chunk_tokens,
            "chunk_overlap": overlap,
            "context_tokens": context_tokens,
            "max_new_tokens": max_new_tokens,
            "attribution": qa.attributor.settings(),
        }
        records: list[Record] = []
        bar = _progress(len(qs) * (len(methods) + 1 + bool(noise_threads)), "citation", progress)
        for qi, q in enumerate(qs):
            context = qa.retrieve(q.question)
            gold = [i + 1 for i, c in enumerate(context.chunks) if is_gold_file(c.file, q.gold)]
            full = qa.answer_context(context)
            bar.update()
            runs = [(FULL, full)]
            if noise_threads:
                runs.append((NOISE, _with_threads(noise_threads, qa.answer_context, context)))
                bar.update()
            for method in methods:
                runs.append((method, qa.answer_context(context, compression=method.policy)))
                bar.update()
            grid = sweep(docs.embedder, context.question, full.text, [c.text for c in context.chunks], attribution_grid) if attribution_grid else None
            for method, answer in runs:
                for route in ROUTES:
                    records.append(_record(engine, method, qi, q, context, gold, answer, full, route, shared))
                    if method is FULL and route == "attributed" and grid is not None:
                        records[-1]["attribution_sweep"] = grid
        bar.close()
    return records


def _record(engine, method, qi, q, context, gold, answer, full, route, shared) -> Record:
    cited, full_cited = answer.cited(route), full.cited(route)
    agree = citation_prf(cited, full_cited)
    gold_prf = citation_prf(cited, gold)
    stats = answer.result.stats
    record = common_fields(engine, "citation", method, answer.result.usage.prompt_tokens)
    record["threads"] = stats.threads
    record.update(
        shared,
        route=route,
        question_index=qi,
        question=q.question,
        gold_answer=q.answer,
        gold_files=list(q.gold),
        gold=gold,
        gold_retrieved=bool(gold),
        stuffed_chunks=len(context.chunks),
        stuffed_sources=[c.source for c in context.chunks],
        document_tokens=context.document_tokens,
        output=answer.text,
        full_output=full.text,
        cited=cited,
        full_cited=full_cited,
        invalid_citations=answer.invalid_citations if route == "generated" else [],
        agreement_precision=agree[0],
        agreement_recall=agree[1],
        agreement_f1=agree[2],
        gold_precision=gold_prf[0],
        gold_recall=gold_prf[1],
        gold_f1=gold_prf[2],
        answer_correct=answer_correct(answer.text, q.answer),
        identical_text=answer.text == full.text,
        kept_tokens=max(stats.kept_tokens_per_layer) if stats.kept_tokens_per_layer else None,
        resolved_window=resolved_window(answer.result),
        prompt_kv_bytes_kept=stats.prompt_kv_bytes_kept,
        prefill_seconds=stats.prefill_seconds,
    )
    return record


__all__ = ["ATTRIBUTION_GRID", "DEFAULT_THRESHOLDS", "EvalInputError", "RagQuestion", "load_questions", "run_rag_citation", "is_gold_file"]
