"""Answer accuracy against stuffed tokens on the embedded model (issue 30: defaults a user can trust).

The 40 sample questions over examples/sample_corpus, retrieval-ranked chunks stuffed into 1K,
2K, 4K and "fill" (everything that fits the 8K context) LLM tokens, answered with the full
cache and with DocumentQA's default policy (SnapKV 1024, question window), 32 new tokens,
greedy, the engine's default dtype. Accuracy = the gold answer string appears in the answer.
"16K" stuffs past the window (the whole ~16K-token sample corpus): only the default policy
runs there, read by a rolling prefill (issue 46); the full cache cannot take it.

    .venv/bin/python -m eval stuffing_accuracy [--out eval/rag/results/stuffing_accuracy] [--questions N] [--sizes 1K 2K 4K fill]
    .venv/bin/python -m eval stuffing_accuracy --sizes 16K --compression snapkv:window_size=question,max_capacity_prompt=512,chunk_size=16,chunk_min_ratio=2 --out eval/rag/results/stuffing_accuracy_rolled_512

``--compression`` replaces the default policy (the full cache still runs where it fits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file, load_questions
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.qa import DEFAULT_COMPRESSION

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

SIZES = {"1K": 1000, "2K": 2000, "4K": 4000, "fill": None, "16K": 16000}
PAST_WINDOW = {"16K"}  # sizes over the embedded model's 8K window: rolled, the default policy only
DEFAULT_LABEL = "snapkv 1024 (default)"  # the method name of DocumentQA's policy in the records


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval stuffing_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "stuffing_accuracy"))
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--sizes", nargs="*", choices=list(SIZES), default=[s for s in SIZES if s not in PAST_WINDOW])
    ap.add_argument("--compression", default=DEFAULT_COMPRESSION, help="the compressed policy (default: DocumentQA's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    compressed = DEFAULT_LABEL if args.compression == DEFAULT_COMPRESSION else args.compression
    methods_all = {"full": None, compressed: args.compression}
    sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
    out = Path(args.out)
    questions = load_questions(ROOT / "examples/sample_questions.jsonl", args.questions)
    engine = Engine.default()
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-stuffing-") as tmp:
        store = DocumentStore("stuffing-accuracy", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        for size, tokens in sizes.items():
            rolled = size in PAST_WINDOW
            qa = DocumentQA(engine, store, compression=args.compression if rolled else None, context_tokens=tokens, max_new_tokens=32, kv_reuse="prefix")
            methods = {k: v for k, v in methods_all.items() if v is not None} if rolled else methods_all
            for q in questions:
                context = qa.retrieve(q.question)
                gold_in = any(is_gold_file(c.file, q.gold) for c in context.chunks)
                for method, policy in methods.items():
                    answer = qa.answer_context(context, compression=policy)
                    records.append(
                        {
                            "size": size,
                            "method": method,
                            "question": q.question,
                            "prompt_tokens": answer.result.usage.prompt_tokens,
                            "chunks": len(context.chunks),
                            "gold_stuffed": gold_in,
                            "answer": answer.text,
                            "correct": answer_correct(answer.text, q.answer),
                            "prefill_seconds": answer.result.stats.prefill_seconds,
                            "rolled_chunks": answer.result.stats.policy_stats.get("rolled_chunks", 0),
                        }
                    )
                    print(json.dumps(records[-1]), flush=True)
    write_records(out, records)
    header = "SnapKV 1024 (default)" if compressed == DEFAULT_LABEL else f"`{compressed}`"
    lines = [f"| stuffed | questions | median prompt tokens | gold file stuffed | full cache accuracy | {header} accuracy |", "|---|---|---|---|---|---|"]
    for size in sizes:
        rows = {m: [r for r in records if r["size"] == size and r["method"] == m] for m in methods_all}
        full, snap = rows["full"], rows[compressed]
        any_rows = full or snap
        full_cell = f"{sum(r['correct'] for r in full)}/{len(full)}" if full else "does not fit"
        rolled = f" (rolled, {statistics.median(r['rolled_chunks'] for r in snap):.0f} chunks)" if size in PAST_WINDOW else ""
        lines.append(
            f"| {size} | {len(any_rows)} | {statistics.median(r['prompt_tokens'] for r in any_rows):.0f} | {sum(r['gold_stuffed'] for r in any_rows)}/{len(any_rows)} | "
            f"{full_cell} | {sum(r['correct'] for r in snap)}/{len(snap)}{rolled} |"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
