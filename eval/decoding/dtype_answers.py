"""bf16 and int8 weights against fp32 on the RAG answers (the 40 sample questions at 1K tokens).

bf16 and int8 weights against fp32 on the RAG answers: the 40 sample questions, 1000 stuffed
tokens, full cache and the default SnapKV (question window, 1024), 32 new tokens, greedy. Accuracy =
the gold answer string appears in the answer; also how many answers are identical to fp32's.

    .venv/bin/python -m eval dtype_answers [--candidates bfloat16/native,bfloat16/int8] [--out eval/decoding/results/dtype_answers]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, load_questions
from snapkv_rag.rag import DocumentQA, DocumentStore

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {"full": None, "snapkv 1024 (default)": "snapkv:budget=1024,window=question"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval dtype_answers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default="bfloat16/native,bfloat16/int8", help="dtype/weights pairs compared with fp32")
    ap.add_argument("--out", default=str(RESULTS / "dtype_answers"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    questions = load_questions(ROOT / "examples/sample_questions.jsonl")
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-dtype-") as tmp:
        store = DocumentStore("dtype-answers", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        reference = "float32/native"
        pairs = [reference, *args.candidates.split(",")]
        for pair in pairs:
            dtype, weights = pair.split("/")
            qa = DocumentQA(Engine.default(dtype=dtype, weights=weights), store, compression=None, context_tokens=1000, max_new_tokens=32, kv_reuse="prefix")
            for q in questions:
                context = qa.retrieve(q.question)
                for method, spec in METHODS.items():
                    answer = qa.answer_context(context, compression=spec)
                    records.append(
                        {"candidate": pair, "method": method, "question": q.question, "answer": answer.text, "correct": answer_correct(answer.text, q.answer)}
                    )
    write_records(out, records)
    lines = [
        "| candidate (dtype/weights) | cache | fp32 accuracy | candidate accuracy | identical answers | right in fp32 only | right in candidate only |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair in pairs[1:]:
        for method in METHODS:
            a = {r["question"]: r for r in records if r["method"] == method and r["candidate"] == reference}
            b = {r["question"]: r for r in records if r["method"] == method and r["candidate"] == pair}
            n = len(a)
            lines.append(
                f"| {pair} | {method} | {sum(r['correct'] for r in a.values())}/{n} | {sum(r['correct'] for r in b.values())}/{n} | "
                f"{sum(a[k]['answer'] == b[k]['answer'] for k in a)}/{n} | {sum(a[k]['correct'] and not b[k]['correct'] for k in a)} | "
                f"{sum(b[k]['correct'] and not a[k]['correct'] for k in a)} |"
            )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
