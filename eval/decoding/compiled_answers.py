"""The compiled decode step against the eager one on the RAG answers (the 40 sample questions at 1K tokens).

The 40 sample questions, 1000 stuffed tokens, the full cache and the default SnapKV (question
window, 1024), 32 new tokens, greedy, each dtype/weights pair run by an eager engine and by a
compiled one (``compile_decode=True``) over the same contexts: how many answers are identical
token for token, the accuracy of each (the gold answer string appears in the answer), and how the
compiled engine's steps ran (``stats.decode_step``).

    .venv/bin/python -m eval compiled_answers [--pairs float32/native,bfloat16/native] [--out eval/decoding/results/compiled_answers]
"""

from __future__ import annotations

import argparse
import collections
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
    ap = argparse.ArgumentParser(prog="python -m eval compiled_answers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="float32/native,bfloat16/native", help="dtype/weights pairs, each run eager and compiled")
    ap.add_argument("--questions", type=int, default=40, help="the first N sample questions")
    ap.add_argument("--out", default=str(RESULTS / "compiled_answers"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    questions = load_questions(ROOT / "examples/sample_questions.jsonl")[: args.questions]
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-compiled-") as tmp:
        store = DocumentStore("compiled-answers", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        contexts = None
        for pair in args.pairs.split(","):
            dtype, weights = pair.split("/")
            for compiled in (False, True):
                engine = Engine.default(dtype=dtype, weights=weights, compile_decode=compiled)
                qa = DocumentQA(engine, store, compression=None, context_tokens=1000, max_new_tokens=32, kv_reuse="prefix")
                if contexts is None:
                    contexts = [qa.retrieve(q.question) for q in questions]
                for q, context in zip(questions, contexts):
                    for method, spec in METHODS.items():
                        answer = qa.answer_context(context, compression=spec)
                        records.append(
                            {
                                "pair": pair,
                                "step": "compiled" if compiled else "eager",
                                "method": method,
                                "question": q.question,
                                "answer": answer.text,
                                "correct": answer_correct(answer.text, q.answer),
                                "decode_step": answer.result.stats.decode_step,
                            }
                        )
                del qa, engine
    write_records(out, records)
    n = len(questions)
    lines = [
        f"The first {n} sample questions, 1000 stuffed tokens, 32 new tokens, greedy; eager and compiled engines over the same contexts.",
        "",
        "| dtype/weights | cache | eager accuracy | compiled accuracy | identical answers | how the compiled engine's answers decoded |",
        "|---|---|---|---|---|---|",
    ]
    for pair in args.pairs.split(","):
        for method in METHODS:
            eager = {r["question"]: r for r in records if r["pair"] == pair and r["method"] == method and r["step"] == "eager"}
            compiled = {r["question"]: r for r in records if r["pair"] == pair and r["method"] == method and r["step"] == "compiled"}
            ran = collections.Counter("compiled" if r["decode_step"] == "compiled" else "some steps eager: " + r["decode_step"] for r in compiled.values())
            lines.append(
                f"| {pair} | {method} | {sum(r['correct'] for r in eager.values())}/{n} | {sum(r['correct'] for r in compiled.values())}/{n} | "
                f"{sum(eager[k]['answer'] == compiled[k]['answer'] for k in eager)}/{n} | {', '.join(f'{k}: {v}' for k, v in ran.items())} |"
            )
    lines += ["", f"Command: `.venv/bin/python -m eval compiled_answers --pairs {args.pairs} --questions {args.questions}`"]
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
