"""Exact prefix reuse at any share (issue 48): prefill speed-up against the share a stored prefix covers.

Exact prefix reuse at any share (issue 48): prefill speed-up against the share of the prompt
that a stored prefix covers, with the rest attended through the merged maskless attention
(``cached_prefix_attention``) and through SDPA with an explicit mask (before).

Not a test. On the embedded model, one process, 2 threads. For each prompt length and share:
a fresh prompt (council minutes, its own seed), and before each timed call only its first
``share`` of tokens in the prefix cache (a 1-token generation over them); the
whole prompt's prefill is timed without reuse (``prefix_cache=False``), with reuse and the merged
attention, and with reuse and the masked attention, interleaved, ``--repeats`` times; medians.
The engine's reuse thresholds (``MIN_REUSE_SHARE`` and its bf16 one) are set to 0 here so every share is reused.
The full cache (no compression) isolates the prefill; the reused answers are checked equal.

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval prefix_share_bench --dtype float32 --out eval/reuse/results/prefix_share_fp32
    HF_HUB_OFFLINE=1 .venv/bin/python -m eval prefix_share_bench --dtype bfloat16 --out eval/reuse/results/prefix_share_bf16
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import snapkv_rag.compression.runtime as runtime
from eval.common.results_io import write_records, write_table
from eval.reuse.prefix_cache_bench import build_document
from snapkv_rag import Engine
from snapkv_rag.reuse import prefix_cache

RESULTS = Path(__file__).resolve().parent / "results"


def prefill(engine: Engine, ids: list[int], reuse: bool, merged: bool) -> tuple[float, int, str]:
    runtime.FAST_PREFIX_ATTENTION = merged
    result = engine.generate(engine.tokenizer.decode(ids), max_new_tokens=4, compression="full", chat=False, prefix_cache=reuse)
    return result.stats.prefill_seconds, result.stats.reused_prompt_tokens, result.text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval prefix_share_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--shares", default="0.05,0.1,0.25,0.5,0.75,0.9")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_share")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    prefix_cache.MIN_REUSE_SHARE = prefix_cache.MIN_REUSE_SHARE_LOW_PRECISION = 0.0
    records: list[dict] = []
    table = [
        f"Prefill speed-up from an exact stored prefix, by share reused: {engine.name}, {args.dtype}, full cache, "
        f"median of {args.repeats}; merged = the rest attends through two maskless flash calls, masked = SDPA with an explicit mask",
        "",
        "| prompt tokens | share | reused tokens | no reuse (s) | merged (s) | speed-up | masked (s) | speed-up | same text |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seed = 0
    for length in (int(x) for x in args.lengths.split(",")):
        for share in (float(x) for x in args.shares.split(",")):
            seed += 1
            ids = engine.tokenizer(build_document(engine.tokenizer, length + 400, seed=seed), add_special_tokens=False)["input_ids"][:length]
            times: dict[str, list[float]] = {"none": [], "merged": [], "masked": []}
            texts, reused = set(), 0
            for _ in range(args.repeats):
                for mode in ("none", "merged", "masked"):
                    engine.prefix_cache.clear()  # only the prefix is stored: a reusing call stores its whole prompt
                    engine.generate(engine.tokenizer.decode(ids[: int(length * share)]), max_new_tokens=1, compression="full", chat=False)
                    seconds, took, text = prefill(engine, ids, reuse=mode != "none", merged=mode == "merged")
                    times[mode].append(seconds)
                    texts.add(text)
                    reused = max(reused, took)
            median = {mode: statistics.median(values) for mode, values in times.items()}
            record = {"length": length, "share": share, "reused": reused, **{f"{m}_seconds": v for m, v in median.items()}, "same_text": len(texts) == 1}
            records.append(record)
            print(record, flush=True)
            table.append(
                f"| {length:,} | {share:.0%} | {reused:,} | {median['none']:.2f} | {median['merged']:.2f} | {median['none'] / median['merged']:.2f}x | "
                f"{median['masked']:.2f} | {median['none'] / median['masked']:.2f}x | {'yes' if len(texts) == 1 else 'no'} |"
            )
    runtime.FAST_PREFIX_ATTENTION = True
    write_records(args.out, records)
    write_table(args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
