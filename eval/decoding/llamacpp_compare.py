"""The engine against llama.cpp on the same model, the same token ids and the same threads (issue 25).

Not a test. Needs the optional extra (it compiles llama.cpp, about 10 minutes on 2 cores):

    .venv/bin/pip install -e ".[llamacpp]"
    .venv/bin/python -m eval llamacpp_compare --out eval/decoding/results/llamacpp

Rows: llama.cpp on the shipped Q4_1 GGUF (flash attention on), llama.cpp on another GGUF of the
same model when ``--bf16-gguf`` names one (llama.cpp's ``convert_hf_to_gguf.py --outtype bf16``
on the engine's de-quantized copy; its vocabulary detection fell back to sentencepiece here, so
that row was not produced), and the engine in each ``--engines`` configuration (dtype/weights[/plain]:
fp32 with native weights in the plain layout was the CPU default before issue 25; the default is
now bf16 where the CPU has it, native weights packed for oneDNN; int8 is an option), full cache
and SnapKV 1024 with the question window. ``--engine-only`` leaves llama.cpp out.
Each prompt is rendered once by the engine's chat template; llama.cpp gets the same ids. Every
runner runs in a child process of its own (in one process llama.cpp's OpenMP threads slowed the
engine, and several engines' thread pools would share the cores).
Prefill: seconds for the whole prompt. Decode: median ms per token over ``--tokens`` greedy
steps right after the prompt. Configurations are interleaved over ``--rounds``; the medians
over rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import torch

from eval.common.processes import child_env, module_command
from eval.common.results_io import write_records, write_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

# llama-cpp-python 0.3.36 built for the host CPU crashed in ggml's AMX matrix product on an Intel
# host with AMX (SIGSEGV in ggml_backend_amx_mul_mat); built without AMX it runs.
AMX_CRASH = (
    "llama.cpp crashed (SIGSEGV). On a CPU with AMX rebuild it without AMX: "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" '
    '.venv/bin/pip install --force-reinstall --no-deps --no-cache-dir "llama-cpp-python==0.3.36"'
)
ENGINE_METHODS = [("engine, full cache", None), ("engine, SnapKV 1024 (question window)", "snapkv:budget=1024,window=question")]


def corpus_prompt(tokenizer, tokens: int) -> str:
    docs = [p.read_text() for p in sorted((ROOT / "examples" / "sample_corpus").glob("*"))]
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += docs[i % len(docs)] + "\n\n"
        i += 1
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids) + "\n\nQuestion: what time does the first ferry leave on weekdays?"


def parse_engine_config(config: str) -> tuple[str, str, list[str]]:
    """``dtype/weights[/plain][/compiled]`` as ``(dtype, weights, options)``; a bad one exits with one line."""
    parts = config.split("/")
    if len(parts) < 2 or not all(parts[:2]) or set(parts[2:]) - {"plain", "compiled"}:
        raise SystemExit(f"bad engine configuration {config!r}: dtype/weights[/plain][/compiled], e.g. bfloat16/native/compiled")
    return parts[0], parts[1], parts[2:]


def engine_worker(config: str, length: int, tokens: int, threads: int) -> None:
    """Child process: the engine in ``dtype/weights[/plain][/compiled]``, both cache methods on one prompt; prints JSON.

    ``/plain`` keeps PyTorch's plain weight layout (the default packs the CPU's linear weights for oneDNN);
    ``/compiled`` decodes through the compiled step (``compile_decode=True``), compiled by a short
    request first (its time, from the on-disk cache where an earlier run left one, is ``compile_s``)."""
    from snapkv_rag import Engine

    torch.set_num_threads(threads)
    dtype, weights, options = parse_engine_config(config)
    engine = Engine.default(dtype=dtype, weights=weights, pack_weights=False if "plain" in options else None, compile_decode="compiled" in options)
    compile_s = None
    if "compiled" in options:
        start = time.perf_counter()
        engine.generate(corpus_prompt(engine.tokenizer, 64), max_new_tokens=4, ignore_eos=True, prefix_cache=False)
        compile_s = round(time.perf_counter() - start, 1)
    prompt = corpus_prompt(engine.tokenizer, length)
    rows = []
    for label, spec in ENGINE_METHODS:
        result = engine.generate(prompt, compression=spec, max_new_tokens=tokens + 1, ignore_eos=True, prefix_cache=False)
        rows.append(
            {
                "runner": f"{label}, {config}",
                "prompt_tokens": result.usage.prompt_tokens,
                "prefill_s": result.stats.prefill_seconds,
                "decode_ms": result.stats.decode_ms_per_token,
                "decode_step": result.stats.decode_step,
                "compile_s": compile_s,
            }
        )
    print(json.dumps(rows))


def llama_cpp_worker(gguf: str, ids_file: str, tokens: int, threads: int) -> None:
    """Child process: load ``gguf``, prefill the ids in ``ids_file``, decode; print the timings as JSON.

    llama.cpp runs in its own process: its OpenMP runtime and spinning worker threads slowed the
    engine's steps about 1.5x when both lived in one process."""
    import json

    from llama_cpp import Llama

    model = Llama(gguf, n_ctx=8192, n_threads=threads, n_batch=512, flash_attn=True, verbose=False)
    ids = json.loads(Path(ids_file).read_text())
    prefill, steps = llama_cpp_run(model, ids, tokens)
    print(json.dumps({"prefill_s": prefill, "decode_ms": statistics.median(steps) * 1000}))


def llama_cpp_run(model, ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """Prefill ``ids`` and decode ``tokens`` greedy steps; (prefill seconds, step seconds)."""
    import numpy as np

    model.reset()
    start = time.perf_counter()
    model.eval(ids)
    prefill = time.perf_counter() - start
    steps = []
    for _ in range(tokens):
        token = int(np.argmax(model.eval_logits[-1]))
        start = time.perf_counter()
        model.eval([token])
        steps.append(time.perf_counter() - start)
    return prefill, steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval llamacpp_compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,7800", help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps measured")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engines",
        default="float32/native/plain,bfloat16/native/plain,bfloat16/native,bfloat16/int8",
        help="engine dtype/weights[/plain] configurations (plain: weights not packed for oneDNN, as before)",
    )
    parser.add_argument("--engine-only", action="store_true", help="only the engine rows (no llama.cpp needed)")
    parser.add_argument("--bf16-gguf", type=Path, default=None, help="a bf16 GGUF of the same model, compared too")
    parser.add_argument("--out", type=Path, default=RESULTS / "llamacpp")
    parser.add_argument("--worker", nargs=2, metavar=("GGUF", "IDS_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--engine-worker", nargs=2, metavar=("DTYPE/WEIGHTS", "LENGTH"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    if args.worker:
        return llama_cpp_worker(args.worker[0], args.worker[1], args.tokens, args.threads)
    if args.engine_worker:
        return engine_worker(args.engine_worker[0], int(args.engine_worker[1]), args.tokens, args.threads)
    for config in args.engines.split(","):
        parse_engine_config(config)  # before minutes of runs, not in the first child
    if not args.engine_only:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            sys.exit('llama-cpp-python is not installed: .venv/bin/pip install -e ".[llamacpp]" (compiles llama.cpp, ~10 minutes), or pass --engine-only')

    from transformers import AutoTokenizer

    from snapkv_rag.engine.prompts import render_prompt
    from snapkv_rag.model.loading import DEFAULT_MODEL, embedded_gguf_path, resolve_model_source

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(DEFAULT_MODEL)[0])
    gguf = embedded_gguf_path()
    runners = {} if args.engine_only else {"llama.cpp, shipped Q4_1 GGUF, flash-attn": str(gguf)}
    if args.bf16_gguf is not None and not args.engine_only:
        runners["llama.cpp, same weights in bf16, flash-attn"] = str(args.bf16_gguf)

    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: corpus_prompt(tokenizer, n) for n in lengths}
    ids = {n: render_prompt(tokenizer, prompts[n]) for n in lengths}
    records = []
    for round_ in range(args.rounds):
        for n in lengths:
            ids_file = args.out / f"ids-{n}.json"  # for the child process; removed at the end
            ids_file.write_text(json.dumps(ids[n]))
            for label, path in runners.items():
                command = module_command(__spec__.name, "--worker", path, str(ids_file), "--tokens", str(args.tokens), "--threads", str(args.threads))
                done = subprocess.run(command, capture_output=True, text=True, env=child_env())
                if done.returncode == -11:
                    sys.exit(AMX_CRASH)
                done.check_returncode()
                timing = json.loads(done.stdout.strip().splitlines()[-1])
                records.append({"round": round_, "length": n, "prompt_tokens": len(ids[n]), "runner": label, **timing})
                print(f"{n:>5} {label}: prefill {timing['prefill_s']:.1f} s, decode {timing['decode_ms']:.1f} ms", flush=True)
            for config in args.engines.split(","):
                command = module_command(__spec__.name, "--engine-worker", config, str(n), "--tokens", str(args.tokens), "--threads", str(args.threads))
                rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=child_env()).stdout.strip().splitlines()[-1])
                for row in rows:
                    assert row["prompt_tokens"] == len(ids[n])
                    records.append({"round": round_, "length": n, **row})
                    print(f"{n:>5} {row['runner']}: prefill {row['prefill_s']:.1f} s, decode {row['decode_ms']:.1f} ms", flush=True)
            write_records(args.out, records)

    for n in lengths:
        (args.out / f"ids-{n}.json").unlink(missing_ok=True)
    runner_names = list(dict.fromkeys(r["runner"] for r in records))
    header = "| | " + " | ".join(f"prefill {n:,} tokens | decode at {n:,}" for n in lengths) + " |"
    lines = [
        f"SmolLM2-135M-Instruct, {args.threads} threads, the same token ids; median of {args.rounds} interleaved rounds, {args.tokens} greedy decode steps.",
        "",
        header,
        "|---|" + "---|---|" * len(lengths),
    ]
    for name in runner_names:
        cells = []
        for n in lengths:
            rows = [r for r in records if r["runner"] == name and r["length"] == n]
            cells += [f"{statistics.median(r['prefill_s'] for r in rows):.1f} s", f"{statistics.median(r['decode_ms'] for r in rows):.1f} ms"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    compiled = [r for r in records if r.get("compile_s") is not None and r["runner"].startswith(ENGINE_METHODS[0][0])]
    if compiled:
        lines += ["", "Compiled step's first short request per child process (tracing and compiling, or loading from the on-disk cache), in run order: "]
        lines[-1] += ", ".join(f"{r['compile_s']} s" for r in compiled) + "."
    command = f"--lengths {args.lengths} --tokens {args.tokens} --rounds {args.rounds} --engines {args.engines}" + (
        " --engine-only" if args.engine_only else ""
    )
    lines += ["", f"Command: `.venv/bin/python -m eval llamacpp_compare {command}`"]
    write_table(args.out, lines)


if __name__ == "__main__":
    raise SystemExit(main())
