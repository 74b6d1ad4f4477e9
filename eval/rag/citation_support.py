"""Does the attributed route cite unsupported answers? The key-fact gate against similarity alone.

Two sets of answers from the embedded model, uncompressed, 1000 stuffed tokens, 32 new tokens:

- the 40 answerable sample questions: the answers stored by the attribution run
  (eval/rag/results/attribution/citation.jsonl), re-attributed over the very same stuffed chunks
  (retrieval is re-run and checked against the stored sources): gold precision/recall/F1;
- questions the sample corpus cannot answer (examples/unanswerable_questions.jsonl), answered
  now: the share of answer sentences that get a citation (every one of them is unsupported,
  since no document holds the answer) and of answers citing anything.

Both attributors see the same answers, so the difference is the gate alone. The top-2
retrieval baseline cites two chunks for every answer, right or invented.

    .venv/bin/python -m eval citation_support [--out eval/rag/results/citation_support]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.metrics import citation_prf
from snapkv_rag.harness.rag_citation import is_gold_file, load_questions
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.attribution import EvidenceAttributor

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

CONTEXT_TOKENS = 1000
MAX_NEW_TOKENS = 32


def cited(attributor: EvidenceAttributor, question: str, answer: str, chunks) -> tuple[list[int], int, int]:
    """(distinct chunk numbers cited, sentences, sentences with a citation)."""
    supports = attributor.attribute(question, answer, [c.text for c in chunks])
    numbers = sorted({n for s in supports for n in s.numbers})
    return numbers, len(supports), sum(1 for s in supports if s.numbers)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval citation_support", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "citation_support"))
    ap.add_argument("--stored", default=str(RESULTS / "attribution" / "citation.jsonl"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)

    engine = Engine.default()
    stored = [json.loads(line) for line in Path(args.stored).read_text().splitlines() if line.strip()]
    stored = [r for r in stored if r["method"] == "full" and r["route"] == "attributed"]
    answerable = {q.question: q for q in load_questions(ROOT / "examples/sample_questions.jsonl")}
    unanswerable = load_questions(ROOT / "examples/unanswerable_questions.jsonl")
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-support-") as tmp:
        store = DocumentStore("support", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        qa = DocumentQA(engine, store, compression=None, context_tokens=CONTEXT_TOKENS, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="prefix")
        attributors = {"similarity only": EvidenceAttributor(store.embedder, fact_check=False), "key-fact gate": EvidenceAttributor(store.embedder)}
        for r in stored:
            context = qa.retrieve(r["question"])
            sources = [c.source for c in context.chunks]
            same = [Path(s).name for s in sources] == [Path(s).name for s in r["stuffed_sources"]]
            gold = [i + 1 for i, c in enumerate(context.chunks) if is_gold_file(c.file, answerable[r["question"]].gold)]
            row = {
                "set": "answerable",
                "question": r["question"],
                "answer": r["output"],
                "same_chunks_as_stored": same,
                "gold": gold,
                "answer_correct": r["answer_correct"],
            }
            for name, attributor in attributors.items():
                numbers, sentences, with_citation = cited(attributor, r["question"], r["output"], context.chunks)
                row[name] = {"cited": numbers, "prf": citation_prf(numbers, gold), "sentences": sentences, "cited_sentences": with_citation}
            row["top-2 retrieval"] = {"cited": [1, 2][: len(context.chunks)], "prf": citation_prf([1, 2][: len(context.chunks)], gold)}
            records.append(row)
        for q in unanswerable:
            answer = qa.ask(q.question, temperature=0.0)
            row = {"set": "unanswerable", "question": q.question, "answer": answer.text}
            for name, attributor in attributors.items():
                numbers, sentences, with_citation = cited(attributor, q.question, answer.text, answer.context.chunks)
                row[name] = {"cited": numbers, "sentences": sentences, "cited_sentences": with_citation}
            row["top-2 retrieval"] = {"cited": [1, 2][: len(answer.context.chunks)]}
            records.append(row)
    write_records(out, records)

    lines = [
        "| attribution | gold precision | gold recall | gold F1 (macro) | gold F1, right answers | answerable: sentences cited | "
        "unanswerable: sentences cited | unanswerable: answers citing anything |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ans = [r for r in records if r["set"] == "answerable"]
    una = [r for r in records if r["set"] == "unanswerable"]
    for name in ("similarity only", "key-fact gate", "top-2 retrieval"):
        p = statistics.mean(r[name]["prf"][0] for r in ans)
        rcl = statistics.mean(r[name]["prf"][1] for r in ans)
        f1 = statistics.mean(r[name]["prf"][2] for r in ans)
        f1_right = statistics.mean(r[name]["prf"][2] for r in ans if r["answer_correct"])
        if name == "top-2 retrieval":
            a_cited, u_cited = "all", f"all ({sum(1 for r in una)} answers)"
            u_any = f"{sum(1 for r in una if r[name]['cited'])}/{len(una)}"
        else:
            a_cited = f"{sum(r[name]['cited_sentences'] for r in ans)}/{sum(r[name]['sentences'] for r in ans)}"
            u_cited = f"{sum(r[name]['cited_sentences'] for r in una)}/{sum(r[name]['sentences'] for r in una)}"
            u_any = f"{sum(1 for r in una if r[name]['cited'])}/{len(una)}"
        lines.append(f"| {name} | {p:.3f} | {rcl:.3f} | {f1:.3f} | {f1_right:.3f} | {a_cited} | {u_cited} | {u_any} |")
    same = sum(r["same_chunks_as_stored"] for r in ans)
    lines.append("")
    lines.append(f"Answerable questions: {len(ans)} (stuffed chunks identical to the stored run's for {same}); unanswerable: {len(una)}.")
    correct = [r for r in ans if r["answer_correct"]]
    wrong = [r for r in ans if r["answer_correct"] is False]
    for name in ("similarity only", "key-fact gate"):
        lines.append(
            f"{name}: answers cited, right {sum(1 for r in correct if r[name]['cited'])}/{len(correct)}, "
            f"wrong {sum(1 for r in wrong if r[name]['cited'])}/{len(wrong)}"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
