"""Prompt-lookup drafts on document-QA answers: decode speed and identical texts at K = 2, 4, 8.

Prompt-lookup drafts (``prompt_lookup_num_tokens``) on document-QA answers: the 40 sample
questions stuffed to 1K and 2K tokens, DocumentQA's default compression and the full cache,
K = 2, 4, 8 against no drafts, greedy, 48 new tokens at most.

Per question and setting: decode ms per generated token (the decode forwards' time over the
tokens after the first), tokens per forward, and whether the text equals the undrafted one.
Each question's prompt is prefilled once (K = 0 first) and reused exactly from the prefix
cache by the drafted runs, so the prefill is paid once per question and dtype; in bf16 that
reuse is not bit-exact, so bf16 also counts answers changed by the reuse alone (K = 0 again;
``--control`` runs it in fp32 too: the first K = 0 run follows a whole prefill, the drafted
ones a reused one, and the again row shows what that order alone does to decode speed).

    .venv/bin/python -m eval lookup_bench [--dtypes float32,bfloat16] [--sizes 1000,2000] [--ks 2,4,8] [--limit N] [--control]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, load_questions
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.qa import DEFAULT_COMPRESSION

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {"default snapkv": DEFAULT_COMPRESSION, "full": None}
MAX_NEW_TOKENS = 48


def decode_ms_per_token(result) -> float | None:
    """Every decode forward's time over the tokens they produced (the first token comes from the prefill)."""
    tokens = result.usage.completion_tokens - 1
    return (result.stats.total_seconds - result.stats.prefill_seconds) / tokens * 1000 if tokens > 0 else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval lookup_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sizes", default="1000,2000", help="stuffed prompt tokens")
    ap.add_argument("--ks", default="2,4,8", help="prompt_lookup_num_tokens values compared with 0")
    ap.add_argument("--limit", type=int, default=None, help="the first N questions only (a smoke run)")
    ap.add_argument("--control", action="store_true", help="fp32 too: K = 0 once more after the drafted runs (bf16 always)")
    ap.add_argument("--out", default=str(RESULTS / "lookup_bench"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    questions = load_questions(ROOT / "examples/sample_questions.jsonl")[: args.limit]
    ks = [int(k) for k in args.ks.split(",")]
    records = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="snapkv-lookup-") as tmp:
        store = DocumentStore("lookup-bench", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        for dtype in args.dtypes.split(","):
            engine = Engine.default(dtype=dtype)
            for size in (int(s) for s in args.sizes.split(",")):
                qa = DocumentQA(engine, store, context_tokens=size, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="prefix", prompt_lookup_num_tokens=0)
                for qi, q in enumerate(questions):
                    context = qa.retrieve(q.question)
                    for method, spec in METHODS.items():
                        runs = [0, *ks] + ([0] if dtype != "float32" or args.control else [])
                        for i, k in enumerate(runs):
                            answer = qa.answer_context(context, compression=spec, prompt_lookup_num_tokens=k)
                            r = answer.result
                            drafts = r.stats.drafts or {}
                            records.append(
                                {
                                    "dtype": dtype,
                                    "stuffed": size,
                                    "method": method,
                                    "question": qi,
                                    "k": k,
                                    "again": i > 0 and k == 0,
                                    "prompt_tokens": r.usage.prompt_tokens,
                                    "tokens": r.usage.completion_tokens,
                                    "forwards": r.stats.decode_steps,
                                    "decode_ms_per_token": decode_ms_per_token(r),
                                    "accepted": drafts.get("accepted_draft_tokens", 0),
                                    "drafted": drafts.get("drafted_tokens", 0),
                                    "text": answer.text,
                                    "correct": answer_correct(answer.text, q.answer),
                                }
                            )
                    print(f"{dtype} {size} q{qi} done ({time.perf_counter() - started:.0f} s)", flush=True)
                write_records(out, records)
            del engine
    write_records(out, records)
    write_table(out, table(records, ks))
    return 0


def table(records: list[dict], ks: list[int]) -> list[str]:
    lines = [
        "| dtype | stuffed | cache | K | median decode ms/token (K=0 → K) | median speedup | mean speedup | tokens per forward | acceptance | identical texts | right (K=0 → K) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["dtype"], r["stuffed"], r["method"]) for r in records}, key=lambda x: (x[0] != "float32", x[1], x[2]))
    for dtype, size, method in keys:
        rows = [r for r in records if (r["dtype"], r["stuffed"], r["method"]) == (dtype, size, method)]
        base = {r["question"]: r for r in rows if r["k"] == 0 and not r["again"]}
        again = {r["question"]: r for r in rows if r["again"]}
        if again:
            same = sum(again[q]["text"] == base[q]["text"] for q in again)
            speeds = [
                (base[q]["decode_ms_per_token"], again[q]["decode_ms_per_token"])
                for q in again
                if base[q]["decode_ms_per_token"] and again[q]["decode_ms_per_token"]
            ]
            first, last = statistics.median(a for a, _ in speeds), statistics.median(b for _, b in speeds)
            lines.append(
                f"| {dtype} | {size} | {method} | 0 again, after a reused prefill | {first:.1f} → {last:.1f} | "
                f"{statistics.median(a / b for a, b in speeds):.2f}x | | | | {same}/{len(again)} | |"
            )
        for k in ks:
            drafted = {r["question"]: r for r in rows if r["k"] == k}
            pairs = [(base[q], drafted[q]) for q in drafted if base[q]["decode_ms_per_token"] and drafted[q]["decode_ms_per_token"]]
            speedups = [a["decode_ms_per_token"] / b["decode_ms_per_token"] for a, b in pairs]
            forwards = sum(b["forwards"] for _, b in pairs)
            per_forward = sum(b["tokens"] - 1 for _, b in pairs) / forwards if forwards else float("nan")
            drafted_tokens = sum(b["drafted"] for _, b in pairs)
            acceptance = sum(b["accepted"] for _, b in pairs) / drafted_tokens if drafted_tokens else float("nan")
            n = len(drafted)
            lines.append(
                f"| {dtype} | {size} | {method} | {k} | {statistics.median(a['decode_ms_per_token'] for a, _ in pairs):.1f} → "
                f"{statistics.median(b['decode_ms_per_token'] for _, b in pairs):.1f} | {statistics.median(speedups):.2f}x | "
                f"{statistics.mean(speedups):.2f}x | {per_forward:.2f} | {acceptance:.2f} | "
                f"{sum(drafted[q]['text'] == base[q]['text'] for q in drafted)}/{n} | "
                f"{sum(base[q]['correct'] for q in drafted)} → {sum(drafted[q]['correct'] for q in drafted)} |"
            )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
