"""One pass over every linear layer of the embedded model's decoder, as a decode step makes it (issue 25).

Not a test. Unlike ``int8_linear_bench.py``, which repeats one layer (its weight stays in the CPU
cache), this runs the 210 decoder layers one after another, so each weight is read from memory
as in a real step. Layouts: ``nn.Linear`` in bf16 and fp32, the same weights packed for oneDNN
(``snapkv_rag.model.packed_linear``, the CPU default), and the int8 kernel (``--weights int8``).
Interleaved repeats in one process, median milliseconds per pass:

    .venv/bin/python eval/linear_pass_bench.py [--rows 1,4,16,512] [--out eval/results/linear_pass]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results_io import write_records, write_table  # noqa: E402


def linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "eval/results/linear_pass"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from snapkv_rag.model.loading import load_model_and_tokenizer
    from snapkv_rag.model.packed_linear import PackedLinear, packing_available
    from snapkv_rag.model.quantization import Int8Linear

    model, _, _ = load_model_and_tokenizer("default", dtype="bfloat16", pack_weights=False)
    linears = [m for m in model.model.modules() if type(m) is torch.nn.Linear]
    bf16, fp32 = torch.bfloat16, torch.float32
    # name: (activation dtype, the layers)
    layouts: dict[str, tuple[torch.dtype, list]] = {"bf16 nn.Linear": (bf16, linears)}
    if packing_available(bf16):
        layouts["bf16 packed"] = (bf16, [PackedLinear(m) for m in linears])
    layouts["int8 kernel"] = (bf16, [Int8Linear(m) for m in linears])
    layouts["fp32 nn.Linear"] = (fp32, [linear_of(m.weight.detach().float()) for m in linears])
    if packing_available(fp32):
        layouts["fp32 packed"] = (fp32, [PackedLinear(layer) for layer in layouts["fp32 nn.Linear"][1]])
    params = sum(m.weight.numel() for m in linears)
    print(f"{len(linears)} layers, {params / 1e6:.1f} M weights", flush=True)

    records = []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {dtype: [torch.randn(rows, m.in_features, dtype=dtype) for m in linears] for dtype in (torch.bfloat16, torch.float32)}
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for _ in range(args.repeats):
                for name, (dtype, layers) in layouts.items():
                    start = time.perf_counter()
                    for layer, x in zip(layers, inputs[dtype]):
                        layer(x)
                    times[name].append((time.perf_counter() - start) * 1000)
            record = {"rows": rows, **{name: statistics.median(t) for name, t in times.items()}}
            records.append(record)
            print(record, flush=True)
    write_records(Path(args.out), records)
    names = list(layouts)
    lines = [
        f"{len(linears)} decoder linear layers ({params / 1e6:.1f} M weights), {args.threads} threads, median of {args.repeats} interleaved passes, ms per pass.",
        "",
        "| rows | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in records:
        lines.append(f"| {r['rows']} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |")
    write_table(Path(args.out), lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
