"""Chunk-level K/V reuse (issue 24): prefill time and answer quality against a full prefill.

For each corpus and stuffed size, every question's retrieved chunks are stuffed once
(DocumentQA's retrieval, ranked order) and that very prompt is answered by:

- ``off``: a full prefill, the reference (prefix cache off);
- ``prefix``: the engine's exact-prefix cache (a new question shares only the system prompt);
- ``chunks r=R``: blended prefill from the chunk K/V store, recomputing the share R of reused
  tokens (0, 0.05, 0.15, 0.30, 0.50). Every chunk's K/V is precomputed first (``ingest
  --precompute-kv``; its time is reported), so each question is one "whose chunks were all
  seen before"; one cold question (nothing stored) is timed as well.

With ``--snapkv-8x`` the off and default-recompute runs at the largest size are repeated under
SnapKV (question window) at 1/8 of the prompt (compression composed with reuse). Quality: answer accuracy
(gold string in the answer), answers lost against ``off`` (off right, this wrong), identical
answers, and citation agreement F1 (attributed citations against off's). Greedy, 32 new
tokens, the engine's default dtype; time to first token is measured on the stream.

    .venv/bin/python -m eval chunk_reuse --corpus sample --sizes 2000,8000 --snapkv-8x
    .venv/bin/python -m eval chunk_reuse --corpus generated --sizes 8000 --questions 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from eval.common.corpora import CORPORA, load_corpus
from eval.common.results_io import read_records, write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import SnapKV
from snapkv_rag.harness.metrics import citation_prf
from snapkv_rag.harness.rag_citation import answer_correct
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.kv_reuse import precompute_chunk_kv

RESULTS = Path(__file__).resolve().parent / "results"

RATIOS = (0.0, 0.05, 0.15, 0.30, 0.50)
MAX_NEW_TOKENS = 32


def time_to_first_token(engine, messages, kwargs) -> tuple[object, float]:
    start = time.perf_counter()
    stream = engine.stream(messages, **kwargs)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    stream.close()
    return stream.result, first if first is not None else time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval chunk_reuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=CORPORA, default="sample")
    ap.add_argument("--sizes", default="2000,4000,8000")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--prefix-questions", type=int, default=5, help="questions also timed with the prefix cache")
    ap.add_argument("--snapkv-8x", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table-only", action="store_true", help="rebuild table.md from OUT/records.jsonl (a run stopped early)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or RESULTS / f"chunk_reuse_{args.corpus}")
    if args.table_only:
        records = read_records(out)
        write_table(out, table_lines(records, args.corpus))
        return 0
    engine = Engine.default()
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="snapkv-chunk-reuse-") as tmp:
        corpus, questions = load_corpus(args.corpus, Path(tmp), args.questions)
        store = DocumentStore("chunk-reuse", path=Path(tmp) / "store")
        store.ingest([corpus])
        reference = DocumentQA(engine, store, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
        chunked = DocumentQA(engine, store, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="chunks")
        for size in (int(s) for s in args.sizes.split(",")):
            reference.retriever.context_tokens = size
            if size == int(args.sizes.split(",")[0]):
                context = reference.retrieve(questions[0].question)
                _, cold = time_to_first_token(engine, context.messages, chunked.generation_kwargs(context, compression=None))
                start = time.perf_counter()
                computed, _ = precompute_chunk_kv(engine, store.all_chunks(), chunked.kv_store)
                records.append(
                    {
                        "kind": "setup",
                        "cold_ttft_seconds": cold,
                        "precompute_seconds": time.perf_counter() - start,
                        "chunks": store.count(),
                        "computed": computed,
                        "kv_bytes": chunked.kv_store.nbytes,
                    }
                )
                print(json.dumps(records[-1]), flush=True)
            for qi, q in enumerate(questions):
                context = reference.retrieve(q.question)
                settings = [("off", reference, None, {})]
                if qi < args.prefix_questions:
                    settings.append(("prefix", reference, None, {"prefix_cache": True}))
                settings += [(f"chunks r={r:.2f}", chunked, None, {"recompute": r}) for r in RATIOS]
                if args.snapkv_8x and size == max(int(s) for s in args.sizes.split(",")):
                    policy = SnapKV(window_size="question", max_capacity_prompt=max(64, context.prompt_tokens // 8))
                    settings += [("off + snapkv 8x", reference, policy, {}), ("chunks r=0.15 + snapkv 8x", chunked, policy, {"recompute": 0.15})]
                answers = {}
                for name, qa, policy, extra in settings:
                    kwargs = {**qa.generation_kwargs(context, compression=policy), **extra}
                    result, ttft = time_to_first_token(engine, context.messages, kwargs)
                    answer = qa.answer_from(context, result)
                    answers[name] = answer
                    base = answers.get("off + snapkv 8x" if "snapkv" in name else "off", answer)
                    cited, cited_base = answer.cited("attributed"), base.cited("attributed")
                    stats = result.stats
                    records.append(
                        {
                            "kind": "answer",
                            "corpus": args.corpus,
                            "size": size,
                            "setting": name,
                            "question": q.question,
                            "prompt_tokens": result.usage.prompt_tokens,
                            "prefill_seconds": stats.prefill_seconds,
                            "ttft_seconds": ttft,
                            "reused": stats.reused_prompt_tokens,
                            "prefilled": stats.prefilled_prompt_tokens,
                            "recomputed": stats.recomputed_prompt_tokens,
                            "hits": stats.segment_hits,
                            "misses": stats.segment_misses,
                            "answer": answer.text,
                            "correct": bool(answer_correct(answer.text, q.answer)),
                            "same_as_reference": answer.text == base.text,
                            "citation_f1_vs_reference": citation_prf(cited, cited_base)[2] if (cited or cited_base) else 1.0,
                        }
                    )
                    print(json.dumps(records[-1]), flush=True)
    write_records(out, records)
    write_table(out, table_lines(records, args.corpus))
    return 0


def table_lines(records: list[dict], corpus: str) -> list[str]:
    answers = [r for r in records if r["kind"] == "answer"]
    setup = next(r for r in records if r["kind"] == "setup")
    lines = [
        f"Corpus `{corpus}`: {setup['chunks']} chunks; precomputing their K/V took {setup['precompute_seconds']:.0f} s "
        f"({setup['kv_bytes'] / 2**20:.0f} MiB on disk); a cold first question (nothing stored) took {setup['cold_ttft_seconds']:.1f} s to its first token.",
        "",
        "| stuffed | setting | questions | median prompt tokens | median prefill s | prefill vs off | median TTFT s | reused tokens | accuracy | lost vs off | same answer | citation agreement F1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sorted({r["size"] for r in answers}):
        rows = [r for r in answers if r["size"] == size]
        off = {r["question"]: r for r in rows if r["setting"] == "off"}
        off8 = {r["question"]: r for r in rows if r["setting"] == "off + snapkv 8x"}
        for setting in dict.fromkeys(r["setting"] for r in rows):
            group = [r for r in rows if r["setting"] == setting]
            ref = off8 if "snapkv" in setting else off
            speed = statistics.median(ref[r["question"]]["prefill_seconds"] / r["prefill_seconds"] for r in group)
            lost = sum(ref[r["question"]]["correct"] and not r["correct"] for r in group)
            lines.append(
                f"| {size} | {setting} | {len(group)} | {statistics.median(r['prompt_tokens'] for r in group):.0f} | "
                f"{statistics.median(r['prefill_seconds'] for r in group):.2f} | {speed:.1f}x | {statistics.median(r['ttft_seconds'] for r in group):.2f} | "
                f"{statistics.median(r['reused'] for r in group):.0f} | {sum(r['correct'] for r in group)}/{len(group)} | {lost} | "
                f"{sum(r['same_as_reference'] for r in group)}/{len(group)} | {statistics.mean(r['citation_f1_vs_reference'] for r in group):.2f} |"
            )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
