"""bf16 and int8 weights against fp32 on the embedded model: next-token KL, top-1 and greedy agreement (issue 25).

The eval's fidelity prompts (document collections with a question, ``fidelity_prompt``) of
about 2K and 4K tokens, seeds 0-1, and needle prompts: the fp32 model's own 32-token greedy
continuation is the reference; fp32 and each candidate (a dtype and a weight format) are
teacher-forced over it (full cache, and SnapKV 1024 with the question window) and each
candidate's own greedy continuation is compared with it.

    .venv/bin/python -m eval dtype_fidelity [--candidates bfloat16/native,bfloat16/int8] [--out eval/decoding/results/dtype_fidelity]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.metrics import greedy_agreement
from snapkv_rag.harness.needle import build_needle_case
from snapkv_rag.harness.runner import fidelity_prompt

RESULTS = Path(__file__).resolve().parent / "results"

CONTINUATION = 32
METHODS = {"full": None, "snapkv 1024": "snapkv:budget=1024,window=question"}


def prompts(tokenizer) -> list[tuple[str, object]]:
    out = [(f"documents {n}, seed {s}", fidelity_prompt(n, s)) for n in (2000, 4000) for s in (0, 1)]
    out += [(f"needle {n}", build_needle_case(tokenizer, n, 0.5, seed=3).prompt) for n in (2000, 4000)]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval dtype_fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default="bfloat16/native,bfloat16/int8", help="dtype/weights pairs compared with fp32")
    ap.add_argument("--out", default=str(RESULTS / "dtype_fidelity"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    fp32 = Engine.default(dtype="float32", weights="native")
    candidates = {}
    for pair in args.candidates.split(","):
        dtype, weights = pair.split("/")
        candidates[pair] = Engine.default(dtype=dtype, weights=weights)
    records = []
    for name, prompt in prompts(fp32.tokenizer):
        for method, spec in METHODS.items():
            reference = fp32.generate(prompt, compression=spec, max_new_tokens=CONTINUATION, ignore_eos=True)
            ids = reference.token_ids[:CONTINUATION]
            p = torch.log_softmax(fp32.score(prompt, ids, compression=spec), -1)
            for pair, engine in candidates.items():
                q = torch.log_softmax(engine.score(prompt, ids, compression=spec), -1)
                kl = (p.exp() * (p - q)).sum(-1)
                own = engine.generate(prompt, compression=spec, max_new_tokens=CONTINUATION, ignore_eos=True).token_ids[:CONTINUATION]
                prefix, overall = greedy_agreement(ids, own)
                records.append(
                    {
                        "candidate": pair,
                        "prompt": name,
                        "prompt_tokens": reference.usage.prompt_tokens,
                        "method": method,
                        "mean_kl": float(kl.mean()),
                        "max_kl": float(kl.max()),
                        "top1": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
                        "greedy_prefix": prefix,
                        "greedy_overall": overall,
                        "same_text": own == ids,
                    }
                )
                print(json.dumps(records[-1]), flush=True)
    write_records(out, records)
    lines = [
        "| candidate (dtype/weights) | cache | prompts | mean KL(fp32 ‖ candidate) | max KL | top-1 agreement | greedy agreement (prefix) | greedy agreement (overall) | identical 32-token continuations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in candidates:
        for method in METHODS:
            rows = [r for r in records if r["method"] == method and r["candidate"] == pair]
            lines.append(
                f"| {pair} | {method} | {len(rows)} | {statistics.mean(r['mean_kl'] for r in rows):.4f} | {max(r['max_kl'] for r in rows):.3f} | "
                f"{statistics.mean(r['top1'] for r in rows):.3f} | {statistics.mean(r['greedy_prefix'] for r in rows):.3f} | "
                f"{statistics.mean(r['greedy_overall'] for r in rows):.3f} | {sum(r['same_text'] for r in rows)}/{len(rows)} |"
            )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
