"""What compiling the decode step costs: the first compile, a second process's start, resident memory.

Each run is a child process of its own with an empty Inductor cache directory made for this run:
``eager`` (no compile), then ``compiled`` twice in a row (the first compiles cold and fills the
cache, the second starts from it). Each loads the embedded model, answers one 1K-token prompt with
32 greedy tokens (untimed warm-up for the compiled step is the first request itself), then one more;
reported: the first request's seconds, the second request's decode ms/token, the process's resident
memory after both, and how the steps ran.

    .venv/bin/python -m eval compile_startup [--out eval/decoding/results/compile_startup]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from eval.common.processes import child_env, module_command
from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval compile_startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "compile_startup"))
    ap.add_argument("--worker", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    return ap


def worker(mode: str, threads: int) -> None:
    import torch

    from eval.decoding.llamacpp_compare import corpus_prompt
    from snapkv_rag import Engine
    from snapkv_rag.model.peak_memory import current_rss_bytes

    torch.set_num_threads(threads)
    start = time.perf_counter()
    engine = Engine.default(compile_decode=mode == "compiled")
    load_s = time.perf_counter() - start
    prompt = corpus_prompt(engine.tokenizer, 1000)
    start = time.perf_counter()
    engine.generate(prompt, max_new_tokens=32, ignore_eos=True, prefix_cache=False)
    first_s = time.perf_counter() - start
    second = engine.generate(prompt, max_new_tokens=32, ignore_eos=True, prefix_cache=False)
    stats = engine.compiled_decode.stats()
    print(
        json.dumps(
            {
                "load_s": round(load_s, 1),
                "first_request_s": round(first_s, 1),
                "first_compiled_step_s": stats["first_step_seconds"],
                "inductor_s": stats["compile_seconds"],
                "decode_ms": second.stats.decode_ms_per_token,
                "rss_mib": round(current_rss_bytes() / 2**20),
                "decode_step": second.stats.decode_step,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads)
        return 0
    out = Path(args.out)
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-inductor-") as cache:
        env = {**child_env(), "TORCHINDUCTOR_CACHE_DIR": cache}
        for label, mode in (("eager", "eager"), ("compiled, empty cache", "compiled"), ("compiled, second process", "compiled")):
            command = module_command(__spec__.name, "--worker", mode, "--threads", str(args.threads))
            row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1])
            records.append({"run": label, **row})
            print(label, row, flush=True)
    write_records(out, records)
    lines = [
        f"The embedded model, bf16 default, {args.threads} threads, a 1K-token prompt, 32 greedy tokens; each row a new process, one Inductor cache directory for all three.",
        "",
        "| run | load | first request | of which the compiled step's first call | decode (second request) | resident memory | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        first_step = "" if r["first_compiled_step_s"] is None else f"{r['first_compiled_step_s']} s"
        lines.append(
            f"| {r['run']} | {r['load_s']} s | {r['first_request_s']} s | {first_step} | {r['decode_ms']:.1f} ms | {r['rss_mib']} MiB | {r['decode_step']} |"
        )
    lines += ["", "Command: `.venv/bin/python -m eval compile_startup`", f"Host CPUs: {os.cpu_count()}."]
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
