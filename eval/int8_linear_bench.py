"""One linear layer of the embedded model's shapes: bf16 ``linear`` against the int8 kernel
(``aten._weight_int8pack_mm``) and against dequantize-then-``linear``, at 1 to 512 rows (issue 25).

Not a test. Interleaved repeats in one process, median microseconds per call:

    .venv/bin/python eval/int8_linear_bench.py [--threads 2] [--out eval/results/int8_linear]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results_io import write_records, write_table  # noqa: E402

# SmolLM2-135M: q/o projections, k/v, MLP up/gate, MLP down, the output head
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = [1, 4, 16, 32, 64, 512]


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "eval/results/int8_linear"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    records = []
    for rows in ROWS:
        for out_features, in_features in SHAPES:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
            scale = weight.float().abs().amax(1).div(127).to(torch.bfloat16)
            qweight = (weight.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            runs = {
                "bf16 linear": lambda x=x, w=weight: torch.nn.functional.linear(x, w),
                "int8 kernel": lambda x=x, q=qweight, s=scale: torch.ops.aten._weight_int8pack_mm(x, q, s),
                "dequantize + linear": lambda x=x, q=qweight, s=scale: torch.nn.functional.linear(x, q.to(torch.bfloat16) * s[:, None]),
            }
            calls = max(3, int(2e6 // (rows * out_features * in_features / 1e3 + 1)))
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    times[name].append(per_call_us(fn, calls))
            record = {"rows": rows, "out": out_features, "in": in_features, **{name: statistics.median(t) for name, t in times.items()}}
            records.append(record)
            print(record, flush=True)
    write_records(Path(args.out), records)
    lines = [
        f"{args.threads} threads, median of {args.repeats} interleaved repeats, microseconds per call.",
        "",
        "| rows | weight (out x in) | bf16 linear | int8 kernel | dequantize + linear | int8 kernel vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['rows']} | {r['out']} x {r['in']} | {r['bf16 linear']:.0f} | {r['int8 kernel']:.0f} | {r['dequantize + linear']:.0f} | "
            f"{r['bf16 linear'] / r['int8 kernel']:.2f}x |"
        )
    write_table(Path(args.out), lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
