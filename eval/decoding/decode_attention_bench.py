"""Decode ms/token on the embedded model: the decode attention path against SDPA, fp32 and bf16.

One process, interleaved (path on, path off, on, off, ...) so drift on a shared machine hits
both alike; needle prompts of about 512 and 7,800 tokens, the full cache and SnapKV 1024 with
the question-aligned window; 32 new tokens (``ignore_eos``), the median step of each run and
the median over ``--repeats`` runs. The pass key must be in the output (full cache and SnapKV),
as a check that the path answers alike.

    .venv/bin/python -m eval decode_attention_bench [--repeats 3] [--threads 2] [--out eval/decoding/results/decode_attention]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import runtime
from snapkv_rag.harness.needle import build_needle_case

RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {"full": None, "snapkv 1024": "snapkv:budget=1024,window=question"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval decode_attention_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,7800")
    ap.add_argument("--out", default=str(RESULTS / "decode_attention"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    records = []
    for dtype in ("float32", "bfloat16"):
        engine = Engine.default(dtype=dtype)
        for length in (int(x) for x in args.lengths.split(",")):
            case = build_needle_case(engine.tokenizer, length, 0.5, seed=1)
            for method, spec in METHODS.items():
                for repeat in range(args.repeats):
                    for fast in (True, False):
                        runtime.FAST_DECODE_ATTENTION = fast
                        r = engine.generate(case.prompt, compression=spec, max_new_tokens=32, ignore_eos=True)
                        records.append(
                            {
                                "dtype": dtype,
                                "length": length,
                                "prompt_tokens": r.usage.prompt_tokens,
                                "method": method,
                                "path": "decode_attention" if fast else "sdpa",
                                "repeat": repeat,
                                "decode_ms_per_token": r.stats.decode_ms_per_token,
                                "needle_found": case.answer in r.text,
                            }
                        )
                        print(json.dumps(records[-1]), flush=True)
        runtime.FAST_DECODE_ATTENTION = True
        del engine
    write_records(out, records)
    lines = [
        "| dtype | prompt tokens | cache | SDPA ms/token | decode path ms/token | speed-up | pass key found (SDPA / path) |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["dtype"], r["length"], r["method"]) for r in records}, key=lambda k: (k[0] != "float32", k[1], k[2]))
    for dtype, length, method in keys:
        rows = [r for r in records if (r["dtype"], r["length"], r["method"]) == (dtype, length, method)]
        ms = {p: statistics.median(r["decode_ms_per_token"] for r in rows if r["path"] == p) for p in ("sdpa", "decode_attention")}
        found = {p: sum(r["needle_found"] for r in rows if r["path"] == p) for p in ("sdpa", "decode_attention")}
        n = sum(1 for r in rows if r["path"] == "sdpa")
        lines.append(
            f"| {dtype} | {rows[0]['prompt_tokens']} | {method} | {ms['sdpa']:.1f} | {ms['decode_attention']:.1f} | "
            f"{ms['sdpa'] / ms['decode_attention']:.2f}x | {found['sdpa']}/{n} / {found['decode_attention']}/{n} |"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
