"""Decode-time compression (issue 29): long generations with a bounded cache, against the full cache.

For each prompt (sample-corpus documents stuffed to about --context tokens, then "write a long
report"), the full-cache run generates --tokens tokens greedily (ignore_eos, so every run is
that long); that continuation is the reference. Each method then

- generates the same number of tokens itself: decode ms/token (median), the most entries one
  layer held during decoding, the final cache bytes, and how many leading tokens equal the
  full run's (greedy agreement, free-running);
- is teacher-forced along the full run's continuation (``Engine.score``, which feeds a policy
  with decode cuts one token at a time, as it decodes): per-token KL(full || method) and top-1
  agreement with the full cache's next token.

Prompt-only compression (the cache grows by one entry per token) is the row to beat on memory.
Decode ms/token of a long run is only comparable on a quiet machine; ``--timing-only`` times
the methods alone (no scoring), interleaved over ``--rounds``, into ``timing.md``.

    .venv/bin/python -m eval decode_compression --prompts 3 --tokens 1200
    .venv/bin/python -m eval decode_compression --prompts 1 --tokens 1200 --timing-only --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import torch

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

METHODS = [
    ("snapkv prompt only", "snapkv:budget=256,window=32"),
    # never cuts, but is teacher-forced one token at a time like the cutting rows: the numerical noise floor
    ("snapkv decode, budget not reached", "snapkv:budget=256,window=32,decode_budget=100000,decode_interval=64"),
    ("snapkv decode", "snapkv:budget=256,window=32,decode_budget=256,decode_interval=64"),
    ("streamingllm decode", "streamingllm:budget=256,decode_budget=256,decode_interval=64"),
    ("h2o decode", "h2o:budget=256,decode_budget=256,decode_interval=64"),
    ("random decode", "random:budget=256,decode_budget=256,decode_interval=64"),
    ("less decode", "less:base=snapkv,budget=256,window=32,decode_budget=256,decode_interval=64"),
]


def prompts(engine: Engine, count: int, context: int) -> list[str]:
    docs = sorted((ROOT / "examples" / "sample_corpus").glob("*"))
    out = []
    for i in range(count):
        text, used = [], 0
        for doc in docs[i * 3 :] + docs[: i * 3]:
            body = doc.read_text()
            used += len(engine.tokenizer(body)["input_ids"])
            if used > context and text:
                break
            text.append(f"## {doc.stem}\n{body}")
        out.append("\n\n".join(text) + "\n\nWrite a long, detailed report on everything in the documents above, section by section.")
    return out


def kl_and_top1(full: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    p = full.float().log_softmax(-1)
    q = other.float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    return float(kl.mean()), float((full.argmax(-1) == other.argmax(-1)).float().mean())


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval decode_compression", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--context", type=int, default=1500, help="stuffed document tokens per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_compression")
    parser.add_argument("--timing-only", action="store_true", help="only decode ms/token per method, interleaved over --rounds")
    parser.add_argument("--rounds", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    engine = Engine.default()
    if args.timing_only:
        return timing_only(engine, args)
    per_token = engine.info().kv_bytes_per_token
    records = []
    for index, prompt in enumerate(prompts(engine, args.prompts, args.context)):
        full = engine.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True, prefix_cache=False)
        reference = engine.score(prompt, full.token_ids, prefix_cache=False)
        base = {"prompt": index, "prompt_tokens": full.usage.prompt_tokens, "tokens": args.tokens}
        records.append(
            {
                **base,
                "method": "full",
                "spec": "full",
                "decode_ms_per_token": full.stats.decode_ms_per_token,
                "cache_entries_max": full.usage.prompt_tokens + args.tokens,
                "kv_bytes_final": full.stats.kv_bytes_final,
                "kl": 0.0,
                "top1": 1.0,
                "leading_agreement": args.tokens,
            }
        )
        print(f"prompt {index}: {full.usage.prompt_tokens} tokens, full {full.stats.decode_ms_per_token:.1f} ms/token", flush=True)
        for label, spec in METHODS:
            result = engine.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True, compression=spec, prefix_cache=False)
            kl, top1 = kl_and_top1(reference, engine.score(prompt, full.token_ids, compression=spec, prefix_cache=False))
            stats = result.stats.policy_stats
            largest = stats.get("decode_cache_entries_max", max(result.stats.kept_tokens_per_layer) + args.tokens)
            records.append(
                {
                    **base,
                    "method": label,
                    "spec": spec,
                    "decode_ms_per_token": result.stats.decode_ms_per_token,
                    "cache_entries_max": largest,
                    "kv_bytes_final": result.stats.kv_bytes_final,
                    "kl": kl,
                    "top1": top1,
                    "leading_agreement": leading_agreement(full.token_ids, result.token_ids),
                    "decode_compactions": stats.get("decode_compactions", 0),
                    "decode_compaction_ms": stats.get("decode_compaction_ms", 0.0),
                }
            )
            print(f"  {label}: {result.stats.decode_ms_per_token:.1f} ms/token, max entries {largest}, KL {kl:.3f}, top-1 {top1:.3f}", flush=True)
        write_records(args.out, records)

    def median(method: str, key: str) -> float:
        return statistics.median(r[key] for r in records if r["method"] == method)

    full_ms = median("full", "decode_ms_per_token")
    lines = [
        f"{args.prompts} prompts of ~{statistics.median(r['prompt_tokens'] for r in records):.0f} tokens, {args.tokens} generated tokens each, "
        f"{engine.info().dtype}, {torch.get_num_threads()} threads; medians over prompts.",
        "",
        "| method | max entries per layer | final cache | decode ms/token (vs full) | decode cuts | KL(full‖method) | top-1 agreement | leading tokens equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in ["full"] + [m for m, _ in METHODS]:
        ms = median(label, "decode_ms_per_token")
        lines.append(
            f"| {label} | {median(label, 'cache_entries_max'):.0f} | {median(label, 'kv_bytes_final') / 2**20:.1f} MiB "
            f"| {ms:.1f} ({ms / full_ms:.2f}x) | {median(label, 'decode_compactions') if label != 'full' else 0:.0f} "
            f"| {median(label, 'kl'):.3f} | {median(label, 'top1'):.3f} | {median(label, 'leading_agreement'):.0f} |"
        )
    lines.append("")
    lines.append(f"KV bytes per token: {per_token}. Command: `.venv/bin/python -m eval decode_compression --prompts {args.prompts} --tokens {args.tokens}`")
    write_table(args.out, lines)


def timing_only(engine: Engine, args: argparse.Namespace) -> None:
    prompt = prompts(engine, 1, args.context)[0]
    engine.generate(prompt, max_new_tokens=16, prefix_cache=False)  # warm-up
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for label, spec in [("full", None), *METHODS]:
            result = engine.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True, compression=spec, prefix_cache=False)
            runs.setdefault(label, []).append(result.stats.decode_ms_per_token)
            print(f"{label}: {result.stats.decode_ms_per_token:.1f} ms/token", flush=True)
    full = statistics.median(runs["full"])
    lines = [
        f"Decode ms/token over {args.tokens} generated tokens after a {engine.count_tokens(prompt)}-token prompt, "
        f"{engine.info().dtype}, {torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds.",
        "",
        "| method | decode ms/token | vs full | rounds |",
        "|---|---|---|---|",
    ]
    for label, values in runs.items():
        ms = statistics.median(values)
        lines.append(f"| {label} | {ms:.1f} | {ms / full:.2f}x | {', '.join(f'{v:.1f}' for v in values)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
