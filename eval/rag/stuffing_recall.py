"""How often the retriever's stuffing holds the gold document, at 1K to 16K stuffed tokens (issue 66).

For each question of a corpus, the retrieval-ranked chunks are stuffed as DocumentQA stuffs them
(score order, the LLM's tokens counted) into 1K, 2K, 4K, 8K and 16K tokens, and recall is the
share of questions with a chunk of a gold file among them. The look-alike corpus is built so
the gold document is outside the top 1,000 tokens for at least half its questions (stuffing
more must win there); the sample corpus holds most answers in the first 1,000. Also reported:
the gold chunk's rank and the stuffed tokens ahead of it (median). No LLM runs, only its
tokenizer and the embedder.

    .venv/bin/python -m eval stuffing_recall [--corpora sample lookalike]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from eval.common.corpora import load_corpus
from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import is_gold_file
from snapkv_rag.rag import DocumentStore
from snapkv_rag.rag.stuffing import StuffingRetriever

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {"1K": 1000, "2K": 2000, "4K": 4000, "8K": 8000, "16K": 16000}
WHOLE = 40000  # past any corpus here: every chunk, ranked


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval stuffing_recall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", nargs="*", choices=("sample", "lookalike"), default=["sample", "lookalike"])
    ap.add_argument("--out", type=Path, default=RESULTS / "stuffing_recall")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine.default()
    records = []
    for corpus in args.corpora:
        with tempfile.TemporaryDirectory(prefix="snapkv-recall-") as tmp:
            folder, questions = load_corpus(corpus, Path(tmp))
            store = DocumentStore("stuffing-recall", path=tmp)
            store.ingest([folder])
            total = sum(engine.count_tokens(c.text) for c in store.all_chunks())
            for q in questions:
                record = {"corpus": corpus, "question": q.question, "corpus_tokens": total}
                for size, tokens in {**SIZES, "whole": WHOLE}.items():
                    retriever = StuffingRetriever(store, engine, context_tokens=tokens, max_new_tokens=32, past_window=True)
                    context = retriever.retrieve(q.question)
                    gold = [i for i, c in enumerate(context.chunks) if is_gold_file(c.file, q.gold)]
                    record[size] = bool(gold)
                    if size == "whole":
                        ahead = sum(engine.count_tokens(c.text) for c in context.chunks[: gold[0]]) if gold else None
                        record |= {"gold_rank": gold[0] + 1 if gold else None, "tokens_ahead": ahead, "chunks": len(context.chunks)}
                records.append(record)
    write_records(args.out, records)
    lines = [
        "| corpus | corpus tokens | questions | " + " | ".join(f"recall {s}" for s in SIZES) + " | gold rank (median) | tokens ahead of gold (median) |",
        "|---|---|---|" + "---|" * len(SIZES) + "---|---|",
    ]
    for corpus in args.corpora:
        rows = [r for r in records if r["corpus"] == corpus]
        ranks = [r["gold_rank"] for r in rows if r["gold_rank"]]
        ahead = [r["tokens_ahead"] for r in rows if r["tokens_ahead"] is not None]
        cells = " | ".join(f"{sum(r[s] for r in rows)}/{len(rows)}" for s in SIZES)
        lines.append(
            f"| {corpus} | {rows[0]['corpus_tokens']:,} | {len(rows)} | {cells} | {statistics.median(ranks) if ranks else '-'} | "
            f"{int(statistics.median(ahead)) if ahead else '-'} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
