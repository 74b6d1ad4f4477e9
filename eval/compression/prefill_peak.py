"""Prefill peak memory with the prefix cache (issue 63): does a default engine keep compression's low peak?

Each case runs in a fresh process (a process keeps the memory an earlier call took): the embedded
model loaded with the case's engine options, a short warm-up answer, then one or more answers to
a needle haystack of the given length; the figure is the process's peak RSS during those answers
minus its peak once loaded and warmed (``ru_maxrss``), so it counts every byte the answers added:
the prefill's working memory and whatever the prefix cache kept.

Cases: SnapKV 1024 at 7,800 tokens with the default prefix cache (admission ``repeat``), with the
cache off (``prefix_cache_bytes=0``), and with ``admission=always`` (every prompt stored, the old
default); the same prompt read twice and three times under the default (the second read stores it,
the third reuses it); and a rolled read (``rolling=2048``) of 4K and 32K tokens with defaults and
with the cache off.

    .venv/bin/python -m eval prefill_peak --out eval/compression/results/prefill_peak
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eval.common.processes import child_env, module_command
from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"
SNAPKV = "snapkv:budget=1024,window=question"
ROLLED = "snapkv:budget=1024,window=question,rolling=2048"
# (label, prompt tokens, spec, reads, engine options)
CASES = [
    ("defaults (admission repeat), first read", 7800, SNAPKV, 1, {}),
    ("prefix cache off", 7800, SNAPKV, 1, {"prefix_cache_bytes": 0}),
    ("admission always (the old default)", 7800, SNAPKV, 1, {"prefix_cache_admission": "always"}),
    ("defaults, the same prompt read twice (stored at the second)", 7800, SNAPKV, 2, {}),
    ("defaults, read three times (reused at the third)", 7800, SNAPKV, 3, {}),
    ("rolled, defaults", 4096, ROLLED, 1, {}),
    ("rolled, defaults", 32768, ROLLED, 1, {}),
    ("rolled, prefix cache off", 4096, ROLLED, 1, {"prefix_cache_bytes": 0}),
    ("rolled, prefix cache off", 32768, ROLLED, 1, {"prefix_cache_bytes": 0}),
]


def one_case(args) -> None:
    """One case in this process: prints a JSON line."""
    import resource

    from snapkv_rag import Engine
    from snapkv_rag.harness.needle import build_needle_case

    options = json.loads(args.options)
    engine = Engine.default(**options)
    case = build_needle_case(engine.tokenizer, args.length, 0.5, seed=args.length)
    engine.generate("Hello", max_new_tokens=2)  # warm-up: what any call needs
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results = [engine.generate(case.prompt, compression=args.spec, max_new_tokens=4) for _ in range(args.reads)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    last = results[-1]
    record = {
        "prompt_tokens": last.usage.prompt_tokens,
        "spec": args.spec,
        "options": options,
        "reads": args.reads,
        "loaded_rss_bytes": loaded,
        "peak_rss_bytes": peak,
        "added_bytes": peak - loaded,
        "prefix_cache_bytes": engine.prefix_cache.nbytes,
        "reused_prompt_tokens": [r.stats.reused_prompt_tokens for r in results],
        "prefill_seconds": [round(r.stats.prefill_seconds, 2) for r in results],
        "dtype": last.stats.dtype,
    }
    print(json.dumps(record))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval prefill_peak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill_peak")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=7800, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=SNAPKV, help=argparse.SUPPRESS)
    parser.add_argument("--reads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        one_case(args)
        return 0
    records = []
    for label, length, spec, reads, options in CASES:
        command = ["--one", "--length", str(length), "--spec", spec, "--reads", str(reads), "--options", json.dumps(options)]
        run = subprocess.run(module_command(__spec__.name, *command), env=child_env(), capture_output=True, text=True, check=True)
        record = {"case": label, **json.loads(run.stdout.strip().splitlines()[-1])}
        records.append(record)
        print(f"{label}: {record['prompt_tokens']:,} tokens, added {record['added_bytes'] / 2**20:.0f} MiB", flush=True)
    write_records(args.out, records)
    base = {r["prompt_tokens"]: r["added_bytes"] for r in records if r["case"] == "prefix cache off"}
    lines = [
        f"Embedded model, {records[0]['dtype']}; peak RSS added by the answers over the process once loaded (fresh process per row).",
        "",
        "| case | prompt tokens | compression | added MiB | against the cache off | prefix cache after, MiB | reused tokens per read | prefill s per read |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        off = base.get(r["prompt_tokens"])
        ratio = f"{r['added_bytes'] / off:.2f}x" if off else "-"
        lines.append(
            f"| {r['case']} | {r['prompt_tokens']:,} | `{r['spec']}` | {r['added_bytes'] / 2**20:.0f} | {ratio} | "
            f"{r['prefix_cache_bytes'] / 2**20:.0f} | {r['reused_prompt_tokens']} | {r['prefill_seconds']} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
