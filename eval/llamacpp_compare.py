"""The engine against llama.cpp on the same model, the same token ids and the same threads (issue 25).

Not a test. Needs the optional extra (it compiles llama.cpp, about 10 minutes on 2 cores):

    .venv/bin/pip install -e ".[llamacpp]"
    .venv/bin/python eval/llamacpp_compare.py --out eval/results/llamacpp

Rows: llama.cpp on the shipped Q4_1 GGUF (flash attention on), llama.cpp on the same weights
in bf16 (converted from the engine's de-quantized copy with llama.cpp's own converter when
``--bf16-gguf`` names a file or the converter is found; skipped otherwise), and the engine with
its defaults (bf16 where the CPU has it), full cache and SnapKV 1024 with the question window.
Each prompt is rendered once by the engine's chat template; llama.cpp gets the same ids.
Prefill: seconds for the whole prompt. Decode: median ms per token over ``--tokens`` greedy
steps right after the prompt. Configurations are interleaved over ``--rounds``; the medians
over rounds are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results_io import write_records, write_table  # noqa: E402

ENGINE_METHODS = [("engine, full cache", None), ("engine, SnapKV 1024 (question window)", "snapkv:budget=1024,window=question")]


def corpus_prompt(tokenizer, tokens: int) -> str:
    docs = [p.read_text() for p in sorted((ROOT / "examples" / "sample_corpus").glob("*"))]
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += docs[i % len(docs)] + "\n\n"
        i += 1
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids) + "\n\nQuestion: what time does the first ferry leave on weekdays?"


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


def bf16_gguf(engine_dir: Path, out: Path) -> Path | None:
    """llama.cpp's converter (vendored in the llama-cpp-python source) on the engine's de-quantized weights."""
    import subprocess

    import llama_cpp

    candidates = [Path(llama_cpp.__file__).parent / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py", *Path("/tmp").glob("**/convert_hf_to_gguf.py")]
    script = next((c for c in candidates if c.is_file()), None)
    if script is None:
        return None
    target = out / "smollm2-135m-bf16.gguf"
    if not target.exists():
        result = subprocess.run([sys.executable, str(script), str(engine_dir), "--outtype", "bf16", "--outfile", str(target)], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"bf16 conversion failed, row skipped: {result.stderr[-500:]}", flush=True)
            return None
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,7800", help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps measured")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16-gguf", type=Path, default=None, help="a bf16 GGUF of the same model (default: convert one)")
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "llamacpp")
    args = parser.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit('llama-cpp-python is not installed: .venv/bin/pip install -e ".[llamacpp]" (compiles llama.cpp, ~10 minutes)')

    from snapkv_rag import Engine
    from snapkv_rag.loading import converted_gguf_dir, embedded_gguf_path
    from snapkv_rag.prompts import render_prompt

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.default()
    gguf = embedded_gguf_path()
    runners = {"llama.cpp, shipped Q4_1 GGUF, flash-attn": Llama(str(gguf), n_ctx=8192, n_threads=args.threads, n_batch=512, flash_attn=True, verbose=False)}
    bf16 = args.bf16_gguf or bf16_gguf(converted_gguf_dir(gguf), args.out)
    if bf16 is not None:
        runners["llama.cpp, same weights in bf16, flash-attn"] = Llama(
            str(bf16), n_ctx=8192, n_threads=args.threads, n_batch=512, flash_attn=True, verbose=False
        )

    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: corpus_prompt(engine.tokenizer, n) for n in lengths}
    ids = {n: render_prompt(engine.tokenizer, prompts[n]) for n in lengths}
    records = []
    for round_ in range(args.rounds):
        for n in lengths:
            for label, model in runners.items():
                prefill, steps = llama_cpp_run(model, ids[n], args.tokens)
                records.append(
                    {
                        "round": round_,
                        "length": n,
                        "prompt_tokens": len(ids[n]),
                        "runner": label,
                        "prefill_s": prefill,
                        "decode_ms": statistics.median(steps) * 1000,
                    }
                )
                print(f"{n:>5} {label}: prefill {prefill:.1f} s, decode {records[-1]['decode_ms']:.1f} ms", flush=True)
            for label, spec in ENGINE_METHODS:
                result = engine.generate(prompts[n], compression=spec, max_new_tokens=args.tokens + 1, ignore_eos=True, prefix_cache=False)
                assert result.usage.prompt_tokens == len(ids[n])
                records.append(
                    {
                        "round": round_,
                        "length": n,
                        "prompt_tokens": len(ids[n]),
                        "runner": f"{label}, {engine.info().dtype}",
                        "prefill_s": result.stats.prefill_seconds,
                        "decode_ms": result.stats.decode_ms_per_token,
                    }
                )
                print(
                    f"{n:>5} {records[-1]['runner']}: prefill {result.stats.prefill_seconds:.1f} s, decode {result.stats.decode_ms_per_token:.1f} ms",
                    flush=True,
                )
            write_records(args.out, records)

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
    lines += ["", f"Command: `.venv/bin/python eval/llamacpp_compare.py --lengths {args.lengths} --tokens {args.tokens} --rounds {args.rounds}`"]
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
