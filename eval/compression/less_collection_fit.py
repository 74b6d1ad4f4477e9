"""LESS calibrated on a collection's documents (issue 30): does it beat its base on that collection's RAG prompts?

Ingests examples/sample_corpus (or the generated corpus of 120 site reports) into a temporary store, runs ``snapkv-rag less calibrate``'s
function on it (budget 256 over 2,048-token windows of the corpus text: 8x), then, for the
sample questions, builds document QA's stuffed prompt (``--size`` tokens of retrieval-ranked
chunks), lets the full cache answer greedily (``--new-tokens``) and teacher-forces that answer
through SnapKV alone, LESS with the shipped kernels and LESS with the calibrated kernels. KL is
the mean KL(full || method) over the answer's tokens; "gap closed" is ``1 - KL_less / KL_base``.

    .venv/bin/python -m eval less_collection_fit [--corpus sample|generated] [--size 2K] [--questions 40] [--budget 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from eval.common.corpora import CORPORA, load_corpus
from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.less_training.collection_fit import CalibrationConfig, calibrate, describe_calibration
from snapkv_rag.rag import DocumentQA, DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"

SIZES = {"1K": 1000, "2K": 2000, "4K": 4000}


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p = full.float().log_softmax(-1)
    q = other.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval less_collection_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=CORPORA, default="sample")
    ap.add_argument("--size", choices=sorted(SIZES), default="2K")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    suffix = "" if args.corpus == "sample" else f"_{args.corpus}"
    out = Path(args.out or RESULTS / f"less_calibration_{args.size}{suffix}")
    engine = Engine.default()
    base = SnapKV(max_capacity_prompt=args.budget)  # the shipped kernels' base: SnapKV with its fixed window of 32
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-less-calibration-") as tmp:
        corpus, questions = load_corpus(args.corpus, Path(tmp), args.questions)
        store = DocumentStore("less-calibration", path=Path(tmp) / "store")
        store.ingest([corpus])
        summary = calibrate(engine, store, CalibrationConfig(budget=args.budget, windows=args.windows, epochs=args.epochs), progress=True)
        print(describe_calibration(summary), flush=True)
        methods = {"snapkv": base, "less (shipped)": LESS(base=base), "less (calibrated)": LESS(base=base, kernels=summary["kernels"])}
        qa = DocumentQA(engine, store, compression=None, context_tokens=SIZES[args.size], max_new_tokens=args.new_tokens)
        for q in questions:
            context = qa.retrieve(q.question)
            answer = engine.generate(context.messages, max_new_tokens=args.new_tokens, question=context.question_text)
            if len(answer.token_ids) < 2:
                continue
            full = engine.score(context.messages, answer.token_ids, question=context.question_text)
            record = {"question": q.question, "prompt_tokens": answer.usage.prompt_tokens, "answer_tokens": len(answer.token_ids)}
            for name, policy in methods.items():
                record[name] = kl(full, engine.score(context.messages, answer.token_ids, compression=policy, question=context.question_text))
            records.append(record)
            print(json.dumps(record), flush=True)
    write_records(out, records)
    means = {name: statistics.mean(r[name] for r in records) for name in methods}
    lines = [
        f"{len(records)} questions, {args.size} stuffed (median prompt {statistics.median(r['prompt_tokens'] for r in records):.0f} tokens), "
        f"budget {args.budget}, the full cache's greedy answer ({args.new_tokens} tokens at most) teacher-forced, model {engine.info().name}, dtype {engine.info().dtype}",
        "",
        describe_calibration(summary),
        "",
        "| method | mean KL vs full | gap closed | prompts better than SnapKV |",
        "|---|---|---|---|",
    ]
    for name in methods:
        better = sum(r[name] < r["snapkv"] for r in records)
        closed = "-" if name == "snapkv" else f"{1 - means[name] / means['snapkv']:.1%}"
        lines.append(f"| {name} | {means[name]:.4f} | {closed} | {'-' if name == 'snapkv' else f'{better}/{len(records)}'} |")
    write_table(out, lines)
    (out / "calibration.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
