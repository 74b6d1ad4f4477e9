"""Which selection keeps the answers (issue 30): SnapKV's options against the full cache on RAG prompts.

The 40 sample questions over examples/sample_corpus (or questions over the generated corpus of
120 site reports, ``--corpus generated``), retrieval-ranked chunks stuffed into a
fixed number of LLM tokens, answered (32 new tokens, greedy, the engine's default dtype) with
the full cache and with SnapKV (question window) at 4x and 8x, as the paper's token-level
selection and with the options: span-aware keep (``chunk=N``, ChunkKV), per-layer budgets
(``layers=pyramid``, PyramidKV) and both; ``labels`` (not a SnapKV option) also keeps every
document's ``[n] title`` line (``keep_texts``). Each question's full prompt K/V is computed once and
reused by the compressed runs (the prefix cache; selection is then exactly as after a full
prefill). Accuracy = the gold answer string appears in the answer; "lost" = right with the full
cache, wrong compressed; "identical" = the same answer text as the full cache.

    .venv/bin/python -m eval selection_accuracy [--corpus sample|generated] [--size 2K] [--questions N] [--options "" chunk=8 layers=pyramid]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from eval.common.corpora import CORPORA, load_corpus
from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct
from snapkv_rag.rag import DocumentQA, DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"

SIZES = {"1K": 1000, "1.5K": 1500, "2K": 2000, "4K": 4000}
# budgets at 4x and 8x of the median prompt at each size; at 1.5K, document QA's default budget (about 1.5x)
BUDGETS: dict[str, dict[float, int]] = {"1K": {4: 256, 8: 128}, "1.5K": {1.5: 1024}, "2K": {4: 512, 8: 256}, "4K": {4: 1024, 8: 512}}
DEFAULT_OPTIONS = ["", "chunk=8", "layers=pyramid", "chunk=8,layers=pyramid"]


LABELS = "labels"  # not a SnapKV option: the run keeps each document's "[n] title" line (keep_texts)


def method_spec(budget: int, options: str) -> str:
    """The method's name in the records: the SnapKV settings, with ``+labels`` when its options include ``labels``."""
    parts = [o for o in options.split(",") if o]
    name = ",".join([f"snapkv:budget={budget}", "window=question", *(o for o in parts if o != LABELS)])
    return name + ("+labels" if LABELS in parts else "")


def method_policy(budget: int, options: str):
    """The policy a method runs: SnapKV with the question's window at ``budget``, with ``options``."""
    from snapkv_rag.compression import SnapKV
    from snapkv_rag.compression.parsing import settings_from_text

    settings = settings_from_text(",".join(o for o in options.split(",") if o and o != LABELS))
    return SnapKV(max_capacity_prompt=budget, window_size="question").with_settings(**settings)


def summary_lines(records: list[dict], size: str, options: list[str]) -> list[str]:
    full = {r["question"]: r for r in records if r["method"] == "full"}
    right = sum(r["correct"] for r in full.values())
    lines = [
        "| selection | ratio | budget | accuracy | lost vs full | gained | identical answers |",
        "|---|---|---|---|---|---|---|",
        f"| full cache | 1x | - | {right}/{len(full)} | - | - | - |",
    ]
    for ratio, budget in BUDGETS[size].items():
        for opts in options:
            rows = [r for r in records if r["method"] == method_spec(budget, opts)]
            lost = sum(full[r["question"]]["correct"] and not r["correct"] for r in rows)
            gained = sum(r["correct"] and not full[r["question"]]["correct"] for r in rows)
            same = sum(r["answer"].strip() == full[r["question"]]["answer"].strip() for r in rows)
            label = opts or "token-level (paper)"
            lines.append(f"| {label} | {ratio:g}x | {budget} | {sum(r['correct'] for r in rows)}/{len(rows)} | {lost} | {gained} | {same}/{len(rows)} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval selection_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=CORPORA, default="sample")
    ap.add_argument("--size", choices=sorted(SIZES), default="2K")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--options", nargs="*", default=DEFAULT_OPTIONS, help='SnapKV options per variant ("" = the paper\'s)')
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    suffix = "" if args.corpus == "sample" else f"_{args.corpus}"
    out = Path(args.out or RESULTS / f"selection_accuracy_{args.size}{suffix}")
    engine = Engine.default()
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-selection-") as tmp:
        corpus, questions = load_corpus(args.corpus, Path(tmp), args.questions)
        store = DocumentStore("selection-accuracy", path=Path(tmp) / "store")
        store.ingest([corpus])
        qa = DocumentQA(engine, store, compression=None, context_tokens=SIZES[args.size], max_new_tokens=32, kv_reuse="prefix")
        methods = [(None, None)] + [(method_spec(b, o), method_policy(b, o)) for b in BUDGETS[args.size].values() for o in args.options]
        for q in questions:
            context = qa.retrieve(q.question)
            for method, policy in methods:
                keep = {"keep_texts": context.labels()} if method and method.endswith("+labels") else {}
                answer = qa.answer_context(context, compression=policy, **keep)
                stats = answer.result.stats
                records.append(
                    {
                        "size": args.size,
                        "method": method or "full",
                        "question": q.question,
                        "prompt_tokens": answer.result.usage.prompt_tokens,
                        "kept_tokens_per_layer": stats.kept_tokens_per_layer,
                        "answer": answer.text,
                        "correct": answer_correct(answer.text, q.answer),
                    }
                )
                print(json.dumps(records[-1]), flush=True)
    write_records(out, records)
    prompt = statistics.median(r["prompt_tokens"] for r in records if r["method"] == "full")
    lines = [
        f"{len(questions)} questions, {args.size} stuffed (median prompt {prompt:.0f} tokens), model {engine.info().name}, dtype {engine.info().dtype}",
        "",
    ]
    write_table(out, lines + summary_lines(records, args.size, args.options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
