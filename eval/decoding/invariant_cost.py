"""What the invariant mode costs (issue 65): prefill, decode and batched throughput, mode off against on.

One process, one engine (the embedded model at its default dtype), the mode switched between runs
(``engine.invariant``), each measurement repeated and its median taken, modes alternating so drift
hits both. Prefill: needle haystacks of ``--lengths`` tokens under the full cache and SnapKV 1024,
prefix cache off (a cold prompt; the mode's aligned chunks against one forward). Decode: one
request's ms per token over ``--new-tokens``. Batched: ``generate_batch`` of 4 prompts of ~500
tokens (the mode prefills and decodes them one by one), wall seconds and generated tokens per
second. Ratios are on/off.

    .venv/bin/python -m eval invariant_cost --out eval/decoding/results/invariant_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval invariant_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,7800", help="prompt tokens of the prefill rows")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "invariant_cost")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from snapkv_rag import Engine
    from snapkv_rag.harness.needle import build_needle_case

    engine = Engine.default()
    engine.generate("Hello", max_new_tokens=2)
    records = []

    def measure(name: str, call) -> None:
        values: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for mode in (False, True):
                engine.invariant = mode
                values[mode].append(call())
        engine.invariant = False
        off, on = statistics.median(values[False]), statistics.median(values[True])
        records.append({"measure": name, "off": off, "on": on, "ratio": on / off})
        print(f"{name}: off {off:.3f} on {on:.3f} ({on / off:.2f}x)", flush=True)

    for length in (int(x) for x in args.lengths.split(",")):
        case = build_needle_case(engine.tokenizer, length, 0.5, seed=length)
        for spec in (None, "snapkv:budget=1024,window=question"):
            label = spec or "full"

            def prefill(prompt=case.prompt, spec=spec) -> float:
                return engine.generate(prompt, compression=spec, max_new_tokens=1, prefix_cache=False).stats.prefill_seconds

            measure(f"prefill s, {length} tokens, {label}", prefill)

    def decode() -> float:
        result = engine.generate("Write a long story about a ferry crossing.", max_new_tokens=args.new_tokens, ignore_eos=True, prefix_cache=False)
        return result.stats.decode_ms_per_token

    measure(f"decode ms/token, one request, {args.new_tokens} tokens", decode)
    story = "The harbour log records ferries, passengers and weather for each day of the season. " * 30
    prompts = [story + q for q in ("Which day was busiest?", "Summarise the weather.", "Name a ferry.", "How many days are logged?")]

    def batched() -> float:
        started = time.perf_counter()
        results = engine.generate_batch(prompts, max_new_tokens=args.new_tokens, ignore_eos=True, prefix_cache=False)
        return sum(r.usage.completion_tokens for r in results) / (time.perf_counter() - started)

    measure(f"batch of 4 (~{engine.count_tokens(prompts[0])} tokens each), generated tokens/s", batched)
    info = engine.info()
    write_records(args.out, [{**r, "dtype": info.dtype, "device": info.device} for r in records])
    lines = [
        f"Embedded model, {info.dtype} on {info.device}; medians of {args.repeats}, modes alternating in one process.",
        "",
        "| measure | mode off | mode on | on / off |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['measure']} | {r['off']:.3f} | {r['on']:.3f} | {r['ratio']:.2f}x |" for r in records]
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
