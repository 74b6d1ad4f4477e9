"""Same request, same answer (issue 65): the 40 sample questions answered cold and again through prefix reuse, mode off and on.

The 40 sample questions over examples/sample_corpus, 2K stuffed tokens (DocumentQA's retrieval),
answered by the embedded model at its default dtype in batches of 4 (``generate_batch``), 32 new
tokens, greedy, with the full cache and with SnapKV 4x (budget 512, question window). Each set is
answered twice: first cold (the prefix cache cleared; every prompt stored, admission ``always``),
then again right after (batch by batch, so the 40 prompts' K/V need not all fit the prefix cache's
1 GiB), when each prompt reuses its stored K/V. The figure is how many of the 40 second
answers are the same text as the first, with the invariant mode off and on, and how many prompt
tokens the second pass reused.

    .venv/bin/python -m eval invariant_answers --out eval/decoding/results/invariant_answers
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eval.common.results_io import write_records, write_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
SPECS = {"full": None, "snapkv 4x": "snapkv:budget=512,window=question"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval invariant_answers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS / "invariant_answers")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from snapkv_rag import Engine
    from snapkv_rag.harness.rag_citation import load_questions
    from snapkv_rag.rag import DocumentQA, DocumentStore

    questions = load_questions(ROOT / "examples/sample_questions.jsonl", args.questions)
    engine = Engine.default()
    engine.prefix_cache.admission = "always"  # the first pass stores every prompt, the second reuses it
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-invariant-") as tmp:
        store = DocumentStore("invariant-answers", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        qa = DocumentQA(engine, store, context_tokens=args.context_tokens, max_new_tokens=32)
        contexts = [qa.retrieve(q.question) for q in questions]
    for mode in (False, True):
        engine.invariant = mode
        for label, spec in SPECS.items():
            engine.prefix_cache.clear()
            first, second, first_s, second_s = [], [], 0.0, 0.0
            for start in range(0, len(contexts), 4):  # each batch twice in a row: its prompts are still stored for the second
                batch = contexts[start : start + 4]
                for answers, clock in ((first, "first"), (second, "second")):
                    started = time.perf_counter()
                    answers += engine.generate_batch(
                        [c.messages for c in batch], compression=spec, questions=[c.question_text for c in batch], max_new_tokens=32
                    )
                    if clock == "first":
                        first_s += time.perf_counter() - started
                    else:
                        second_s += time.perf_counter() - started
            same = sum(a.text == b.text for a, b in zip(first, second))
            record = {
                "invariant": mode,
                "compression": label,
                "questions": len(contexts),
                "identical": same,
                "reused_tokens_median": sorted(r.stats.reused_prompt_tokens for r in second)[len(second) // 2],
                "prompt_tokens_median": sorted(r.usage.prompt_tokens for r in second)[len(second) // 2],
                "first_pass_s": round(first_s, 1),
                "second_pass_s": round(second_s, 1),
                "changed": [[a.text, b.text] for a, b in zip(first, second) if a.text != b.text],
                "dtype": engine.info().dtype,
            }
            records.append(record)
            print(f"invariant={mode} {label}: {same}/{len(contexts)} identical, reused {record['reused_tokens_median']} tokens", flush=True)
    write_records(args.out, records)
    lines = [
        f"Embedded model, {records[0]['dtype']}; 40 sample questions, {args.context_tokens} stuffed tokens, batches of 4, 32 tokens, greedy.",
        "",
        "| invariant mode | compression | second answer identical to the first | median prompt tokens reused (second pass) | first pass s | second pass s |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {'on' if r['invariant'] else 'off'} | {r['compression']} | {r['identical']}/{r['questions']} | {r['reused_tokens_median']} of {r['prompt_tokens_median']} | "
            f"{r['first_pass_s']} | {r['second_pass_s']} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
