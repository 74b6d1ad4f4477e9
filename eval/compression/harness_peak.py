"""The harness measures the engine users run: `snapkv-rag eval speed`'s peak memory against the same call made directly.

Loads the embedded model as `snapkv-rag ask` does (the invariant mode as the environment sets it), reads
one needle prompt of ``--length`` tokens under SnapKV ``--budget`` through the harness's ``run_speed``
and then through ``engine.generate`` with the same arguments, and writes both peaks, their ratio and
whether the harness ran invariant (issue 73: the target is a ratio within 10%).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "harness_peak"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval harness_peak", description=__doc__)
    ap.add_argument("--length", type=int, default=7800, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--harness-invariant", action="store_true", help="run the harness's side invariant (what it did before issue 73), the direct call as users run it"
    )
    ap.add_argument("--out", type=Path, default=OUT)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from snapkv_rag.engine.invariant import invariant_from_environment
    from snapkv_rag.engine.shared import load_engine_quietly
    from snapkv_rag.harness.needle import build_needle_case
    from snapkv_rag.harness.runner import method_grid, run_speed

    torch.set_num_threads(args.threads)
    engine = load_engine_quietly("default")
    (method,) = method_grid(["snapkv:window=32"], [args.budget])
    engine.invariant = args.harness_invariant or engine.invariant
    harness = next(r for r in run_speed(engine, [method], [args.length], new_tokens=args.new_tokens, progress=False) if r["method"] == method.label)
    engine.invariant = invariant_from_environment()
    prompt = build_needle_case(engine.tokenizer, args.length, 0.5, seed=0).prompt  # run_speed's prompt (repeat 0)
    direct = engine.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True, compression=method.policy, prefix_cache=False).stats
    row = {
        "prompt_tokens": harness["prompt_tokens"],
        "method": method.label,
        "harness_invariant": harness["invariant"],
        "harness_peak_bytes": harness["peak_memory_bytes"],
        "direct_peak_bytes": direct.peak_memory_bytes,
        "peak_kind": direct.peak_memory_kind,
        "harness_over_direct": harness["peak_memory_bytes"] / direct.peak_memory_bytes,
        "harness_added_bytes": harness["peak_memory_added_bytes"],
        "direct_added_bytes": direct.peak_memory_added_bytes,
        "dtype": harness["dtype"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("harness_peak_invariant.json" if args.harness_invariant else "harness_peak.json")).write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
