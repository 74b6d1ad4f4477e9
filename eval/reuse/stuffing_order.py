"""Score order against the reuse order ("cache") for questions asked one after another (issue 48).

The questions of a corpus go, in their file order, through one DocumentQA whose engine keeps
its prefix cache between questions (``kv_reuse="prefix"``, the embedded model's default). Each
order starts from an empty prefix cache. Per question: prompt tokens, tokens whose K/V came
from the prefix cache, prefill seconds, whether the answer holds the gold string, and whether
the two orders wrote the same answer. Orders alternate question by question in two engines
(one per order, same weights) so that a slow moment of the machine hits both alike.

    .venv/bin/python -m eval stuffing_order [--corpus sample|generated] [--dtype float32] [--tokens 1000]
        [--compression default|none] [--out eval/reuse/results/stuffing_order/...] [--table-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from eval.common.corpora import CORPORA, load_corpus
from eval.common.results_io import read_records, write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file
from snapkv_rag.rag import DocumentQA, DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"

ORDERS = ("score", "cache")


def tokens_before_documents(engine: Engine, messages: list[dict]) -> int:
    """Prompt tokens before the first stuffed document's text (instructions, "Documents:", its label)."""
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = messages[-1]["content"]
    first = body.split("\n\n", 2)[1].split("\n", 1)[0]  # "[1] title"
    cut = text.index(first) + len(first)
    return len(engine.tokenizer(text[:cut], add_special_tokens=False)["input_ids"])


def first_gold(rows: list[dict]) -> str:
    if any("gold_positions" not in r for r in rows):
        return "-"
    return f"{sum(r['gold_positions'][:1] == [1] for r in rows)} (stuffed: {sum(bool(r['gold_positions']) for r in rows)})"


def table(out: Path, records: list[dict]) -> None:
    first = records[0]
    lines = [
        f"{first['corpus']} corpus, {first['tokens']} stuffed tokens, {first['dtype']}, compression {first['compression']}",
        "",
        "| order | questions | right | gold document first | mean prompt tokens | mean reused tokens | questions reusing stuffed documents | median prefill s | total prefill s | same answer in both orders |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for order in ORDERS:
        rows = [r for r in records if r["order"] == order]
        lines.append(
            f"| {order} | {len(rows)} | {sum(r['correct'] for r in rows)} | {first_gold(rows)} | {statistics.mean(r['prompt_tokens'] for r in rows):.0f} "
            f"| {statistics.mean(r['reused_tokens'] for r in rows):.0f} | {sum(r['reused_tokens'] > r['tokens_before_documents'] + 1 for r in rows)} "
            f"| {statistics.median(r['prefill_seconds'] for r in rows):.2f} | {sum(r['prefill_seconds'] for r in rows):.1f} "
            f"| {sum(r['same_answer'] for r in rows)} |"
        )
    write_table(out, lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval stuffing_order", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=CORPORA, default="sample")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: the host's)")
    ap.add_argument("--tokens", type=int, default=1000, help="stuffed document tokens")
    ap.add_argument("--compression", choices=("default", "none"), default="default", help="DocumentQA's default policy or the full cache")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table-only", action="store_true", help="rebuild the table from --out's records")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or RESULTS / f"stuffing_order/{args.corpus}_{args.dtype or 'default'}_{args.tokens}_{args.compression}")
    if args.table_only:
        table(out, read_records(out))
        return 0
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-order-") as tmp:
        folder, questions = load_corpus(args.corpus, Path(tmp), args.questions)
        store = DocumentStore("stuffing-order", path=str(Path(tmp) / "store"))
        store.ingest([folder])
        extra = {} if args.compression == "default" else {"compression": None}
        readers = {}
        for order in ORDERS:
            engine = Engine.default(dtype=args.dtype)
            readers[order] = DocumentQA(engine, store, context_tokens=args.tokens, max_new_tokens=args.max_new_tokens, kv_reuse="prefix", order=order, **extra)
        dtype = next(iter(readers.values())).engine.info().dtype
        for q in questions:
            answers = {}
            for order, qa in readers.items():
                answer = qa.ask(q.question)
                answers[order] = answer.text
                stats, usage = answer.result.stats, answer.result.usage
                records.append(
                    {
                        "corpus": args.corpus,
                        "dtype": dtype,
                        "tokens": args.tokens,
                        "compression": args.compression,
                        "order": order,
                        "question": q.question,
                        "prompt_tokens": usage.prompt_tokens,
                        "reused_tokens": stats.reused_prompt_tokens,
                        "tokens_before_documents": tokens_before_documents(qa.engine, answer.context.messages)
                        if answer.context.chunks
                        else usage.prompt_tokens,
                        "reused_head_chunks": answer.context.settings["reused_head"],
                        "chunks": len(answer.context.chunks),
                        "chunk_ids": [c.id for c in answer.context.chunks],
                        "gold_positions": [i for i, c in enumerate(answer.context.chunks, start=1) if is_gold_file(c.file, q.gold)],
                        "prefill_seconds": stats.prefill_seconds,
                        "answer": answer.text,
                        "correct": answer_correct(answer.text, q.answer),
                    }
                )
                print(json.dumps(records[-1]), flush=True)
            for r in records[-len(readers) :]:
                r["same_answer"] = len(set(answers.values())) == 1
    write_records(out, records)
    table(out, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
