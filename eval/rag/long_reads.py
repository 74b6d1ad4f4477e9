"""Long reads against short ones (issue 66): answers right at each way of reading a corpus.

For each question of a corpus (``sample``: examples/sample_corpus, ``lookalike``: the look-alike
corpus, whose gold documents the retriever ranks low), the retrieval-ranked chunks are read in
one of these ways, greedy, 32 new tokens:

- ``full:1K`` / ``full:2K`` / ``full:4K``: stuffed into that many tokens, the full cache;
- ``snapkv:8K`` / ``snapkv:16K`` / ``snapkv:whole``: stuffed into that many (``whole``: every
  chunk, by score), read once under DocumentQA's default policy (SnapKV 1024, question window),
  rolled past the model's window;
- ``skim:8K>1K``, ``skim:16K>1K``, ``skim:whole>1K`` (and ``skim-rrf:...``): skim, then read
  (:mod:`snapkv_rag.rag.skim`): the long context read once compressed, its documents ranked by
  the question's attention (``skim-rrf``: fused with the retrieval rank), the best re-stuffed
  into 1K (``>0.5K``: 500 tokens, three or four documents) and answered with the full cache;
  ``skim-stored:...`` skims from each chunk's stored K/V (computed the first time a chunk is skimmed,
  beside the store) instead of a rolled prefill (``skim-stored-cal``: calibrated by a content-free
  question, ICR's calibration).

Records are appended as they are made and a rerun skips what is there (resumable); ``--adapter``
measures a tuned model (its records say which). The table gives answers right, the gold file
stuffed (for skims: in the re-read), the median prompt tokens and the seconds spent per question
(prefill; with the skim's own prefill for skims).

    .venv/bin/python -m eval long_reads --corpus lookalike --readings full:1K full:4K snapkv:8K skim:8K>1K
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from eval.common.corpora import load_corpus
from eval.common.results_io import append_record, read_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file
from snapkv_rag.rag import DocumentQA, DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {"0.5K": 500, "1K": 1000, "2K": 2000, "4K": 4000, "8K": 8000, "16K": 16000, "whole": 60000}
READINGS = (
    "full:1K",
    "full:2K",
    "full:4K",
    "snapkv:8K",
    "snapkv:16K",
    "snapkv:whole",
    "skim:8K>1K",
    "skim:8K>0.5K",
    "skim:16K>1K",
    "skim:whole>1K",
    "skim-rrf:8K>1K",
    "skim-rrf:16K>1K",
    "skim-rrf:whole>1K",
    "skim-stored:8K>1K",
    "skim-stored:whole>1K",
    "skim-stored-cal:8K>1K",
)
MAX_NEW_TOKENS = 32


def reader(engine: Engine, store: DocumentStore, reading: str) -> DocumentQA:
    """The DocumentQA that reads ``reading``'s way."""
    kind, size = reading.split(":")
    if kind == "full":
        return DocumentQA(engine, store, compression=None, context_tokens=SIZES[size], max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
    if kind == "snapkv":
        return DocumentQA(engine, store, context_tokens=SIZES[size], max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
    wide, read = size.split(">")
    fusion = "rrf" if kind == "skim-rrf" else "attention"
    return DocumentQA(
        engine,
        store,
        compression=None,
        context_tokens=SIZES[read],
        max_new_tokens=MAX_NEW_TOKENS,
        kv_reuse="off",
        skim_tokens=SIZES[wide],
        skim_fusion=fusion,
        skim_stored=kind.startswith("skim-stored"),
        skim_calibrate=kind == "skim-stored-cal",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval long_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=("sample", "lookalike"), default="lookalike")
    ap.add_argument("--readings", nargs="*", choices=READINGS, default=["full:1K", "full:2K", "full:4K", "snapkv:8K", "skim:8K>1K"])
    ap.add_argument("--adapter", default=None, help="a LoRA adapter directory (default: the bare model)")
    ap.add_argument("--label", default=None, help="the model's name in the records (default: base, or the adapter's directory name)")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="default: eval/rag/results/long_reads_CORPUS")
    ap.add_argument("--table-only", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or RESULTS / f"long_reads_{args.corpus}"
    out.mkdir(parents=True, exist_ok=True)
    model = args.label or ("base" if args.adapter is None else Path(args.adapter).name)
    records = read_records(out, missing_ok=True)
    if not args.table_only:
        done = {(r["model"], r["reading"], r["question"]) for r in records}
        # the invariant mode refuses blended chunk reuse (an approximation by design): readings that skim from
        # stored keys run without it (their records say so)
        stored = any(r.startswith("skim-stored") for r in args.readings)
        engine = Engine.default(adapter=args.adapter, invariant=not stored)
        with tempfile.TemporaryDirectory(prefix="snapkv-long-reads-") as tmp:
            folder, questions = load_corpus(args.corpus, Path(tmp), args.questions)
            store = DocumentStore("long-reads", path=tmp)
            store.ingest([folder])
            with (out / "records.jsonl").open("a") as sink:
                for reading in args.readings:
                    qa = reader(engine, store, reading)
                    for q in questions:
                        if (model, reading, q.question) in done:
                            continue
                        context = qa.retrieve(q.question)
                        answer = qa.answer_context(context)
                        stats = answer.result.stats
                        skim = context.settings.get("skim", {})
                        record = {
                            "model": model,
                            "reading": reading,
                            "question": q.question,
                            "answer": answer.text,
                            "correct": bool(answer_correct(answer.text, q.answer)),
                            "gold_stuffed": any(is_gold_file(c.file, q.gold) for c in context.chunks),
                            # where the gold document stands in the read (by retrieval score, or by the skim)
                            "gold_position": next((i for i, c in enumerate(context.chunks, start=1) if is_gold_file(c.file, q.gold)), None),
                            "prompt_tokens": answer.result.usage.prompt_tokens,
                            "kept_tokens_per_layer": max(stats.kept_tokens_per_layer or [answer.result.usage.prompt_tokens]),
                            "skimmed_prompt_tokens": skim.get("skimmed_prompt_tokens"),
                            "seconds": round(stats.prefill_seconds + skim.get("skim_seconds", 0.0), 3),
                            "invariant": engine.invariant,
                        }
                        append_record(sink, records, record)
    lines = [
        "| model | reading | questions | right | gold document in the read | gold read first | median prompt tokens | median tokens skimmed | median s per question |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["model"], r["reading"]) for r in records):
        rows = [r for r in records if (r["model"], r["reading"]) == key]
        skimmed = [r["skimmed_prompt_tokens"] for r in rows if r["skimmed_prompt_tokens"]]
        lines.append(
            f"| {key[0]} | {key[1]} | {len(rows)} | {sum(r['correct'] for r in rows)} | {sum(r['gold_stuffed'] for r in rows)} | "
            f"{sum(r.get('gold_position') == 1 for r in rows) if all('gold_position' in r for r in rows) else '-'} | "
            f"{statistics.median(r['prompt_tokens'] for r in rows):.0f} | {f'{statistics.median(skimmed):.0f}' if skimmed else '-'} | "
            f"{statistics.median(r['seconds'] for r in rows):.1f} |"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
