"""Packed and fused against plain linear weights in the engine, in one process, interleaved (issue 25).

Not a test. One engine (the embedded model, ``--dtype``, default the engine's); three layouts of its
linear layers are swapped in turn: plain ``nn.Linear`` copies, each layer packed for oneDNN alone
(``packed``), and the loader's default, siblings that read one input sharing one packed weight
(``packed+fused``). All decode the same prompts on the same cache through the same engine, round
after round, and the machine's drift hits them alike.
Decode: ms per token over ``--tokens`` greedy steps after a prompt whose K/V comes from the
prefix cache (prefilled once); full cache and SnapKV 1024 (question window). Prefill: seconds for
a whole prompt with no reuse, at the ``--prefill-lengths``.

    .venv/bin/python -m eval packed_weights --out eval/decoding/results/packed_weights
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import torch

from eval.common.results_io import write_records, write_table
from eval.decoding.llamacpp_compare import corpus_prompt

RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {"full cache": None, "SnapKV 1024 (question window)": "snapkv:budget=1024,window=question"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval packed_weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,7800", help="prompt tokens for decode")
    parser.add_argument("--prefill-lengths", default="512,2000", help="prompt tokens for prefill (no reuse)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="default: the engine's choice for this CPU")
    parser.add_argument("--out", type=Path, default=RESULTS / "packed_weights")
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    from snapkv_rag import Engine
    from snapkv_rag.model.packed_linear import FusedMember, PackedLinear, packed_layers, replace_module

    torch.set_num_threads(args.threads)
    engine = Engine.default(dtype=args.dtype)
    model = engine.model
    dtype = str(model.dtype).removeprefix("torch.")
    layers = packed_layers(model)
    if not layers:
        sys.exit(f"nothing was packed ({dtype} on this CPU): no comparison to make")
    layouts = {
        "plain": {name: layer.to_linear() for name, layer in layers},
        "packed": {name: PackedLinear(layer.to_linear()) if isinstance(layer, FusedMember) else layer for name, layer in layers},
        "packed+fused": dict(layers),
    }

    def use(layout: str) -> None:
        for name, module in layouts[layout].items():
            replace_module(model, name, module)

    records = []
    for n in [int(x) for x in args.lengths.split(",")]:
        prompt = corpus_prompt(engine.tokenizer, n)
        engine.generate(prompt, max_new_tokens=1)  # the prompt's K/V into the prefix cache
        for round_ in range(args.rounds):
            for method, spec in METHODS.items():
                for layout in layouts:
                    use(layout)
                    result = engine.generate(prompt, max_new_tokens=args.tokens + 1, ignore_eos=True, compression=spec)
                    records.append({"kind": "decode", "length": n, "method": method, "layout": layout, "round": round_, "ms": result.stats.decode_ms_per_token})
                    print(f"decode {n:>5} {method}, {layout}: {result.stats.decode_ms_per_token:.1f} ms", flush=True)
    for n in [int(x) for x in args.prefill_lengths.split(",")]:
        prompt = corpus_prompt(engine.tokenizer, n)
        for round_ in range(args.rounds):
            for layout in layouts:
                use(layout)
                result = engine.generate(prompt, max_new_tokens=1, prefix_cache=False)
                records.append({"kind": "prefill", "length": n, "layout": layout, "round": round_, "s": result.stats.prefill_seconds})
                print(f"prefill {n:>5} {layout}: {result.stats.prefill_seconds:.2f} s", flush=True)
    use("packed+fused")
    write_records(args.out, records)

    def median(**match) -> float:
        key = "ms" if match["kind"] == "decode" else "s"
        return statistics.median(r[key] for r in records if all(r[k] == v for k, v in match.items()))

    lines = [
        f"SmolLM2-135M-Instruct, {dtype}, {args.threads} threads, one process, layouts interleaved; median of {args.rounds} rounds.",
        "",
        "| | plain `nn.Linear` | packed, each layer alone | packed+fused (default) | fused vs packed | fused vs plain |",
        "|---|---|---|---|---|---|",
    ]

    def row(label: str, unit: str, **match) -> str:
        plain, packed, fused = (median(**match, layout=layout) for layout in layouts)
        digits = 1 if unit == "ms" else 2
        return (
            f"| {label} | {plain:.{digits}f} {unit} | {packed:.{digits}f} {unit} | {fused:.{digits}f} {unit} | {packed / fused:.2f}x | {plain / fused:.2f}x |"
        )

    for n in [int(x) for x in args.lengths.split(",")]:
        for method in METHODS:
            lines.append(row(f"decode at {n:,}, {method}", "ms", kind="decode", length=n, method=method))
    for n in [int(x) for x in args.prefill_lengths.split(",")]:
        lines.append(row(f"prefill {n:,} tokens", "s", kind="prefill", length=n))
    lines += [
        "",
        f"Command: `.venv/bin/python -m eval packed_weights --lengths {args.lengths} --prefill-lengths {args.prefill_lengths} --rounds {args.rounds}"
        + (f" --dtype {args.dtype}`" if args.dtype else "`"),
    ]
    write_table(args.out, lines)


if __name__ == "__main__":
    raise SystemExit(main())
