"""LESS against its base policy on several held-out domains, one table (issue 30: "never worse").

Domains: ``documents`` (the eval's synthetic document-QA prompts, greedy reference of the full
cache, ``snapkv-rag eval fidelity --text documents``), ``pydoc`` and ``packages`` (the held-out
splits of the LESS training texts, their own continuation, ``--text heldout``). Each LESS spec
(kernel files, ``{budget}`` in a path standing for each budget; ``probe=``) runs beside its base at every budget and length on the same prompts.
Per row: mean KL(full || method) of the base and of LESS, the share of the base's KL gap LESS
closes (``1 - KL_less / KL_base``; negative: worse) and on how many prompts LESS is below its base.

    .venv/bin/python -m eval less_domains --specs less:base=snapkv less:base=snapkv,probe=32 \\
        [--domains documents,pydoc,packages] [--lengths 2048,4096] [--budgets 256,512] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import LESS
from snapkv_rag.harness.heldout import run_heldout_fidelity
from snapkv_rag.harness.runner import Method, method_grid, run_fidelity

RESULTS = Path(__file__).resolve().parent / "results"

DOMAINS = ("documents", "pydoc", "packages")


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run_domain(engine, domain: str, methods, lengths, seeds, per_length: int) -> list[dict]:
    if domain == "documents":
        bases = {(m.policy.base, m.budget): Method(m.policy.base.name, m.policy.base, m.budget) for m in methods}
        records = run_fidelity(engine, [*bases.values(), *methods], lengths, seeds=seeds, progress=False)
        for r in records:
            r["prompt_key"] = r["seed"]
            r["role"] = "less" if r["method"].startswith("less") else ("full" if r["budget"] is None else "base")
    else:
        records = run_heldout_fidelity(engine, methods, lengths, per_length=per_length, decode_tokens=0, text=domain, progress=False)
        for r in records:
            r["prompt_key"] = r["prompt_index"]
    for r in records:
        r["domain"] = domain
    return [r for r in records if r["role"] in ("base", "less")]


def table(records: list[dict], specs: list[str]) -> list[str]:
    kl: dict[tuple, dict] = defaultdict(dict)  # (domain, length, budget, method) -> prompt -> KL
    for r in records:
        kl[(r["domain"], r["target_tokens"], r["budget"], r["method"] if r["role"] == "less" else "base")][r["prompt_key"]] = r["kl_mean"]
    header = "| domain | prompt tokens | budget | prompts | KL base | " + " | ".join(f"{s}: KL / gap closed / prompts below base" for s in specs) + " |"
    lines = [header, "|" + "---|" * (5 + len(specs))]
    keys = sorted({k[:3] for k in kl}, key=lambda k: (DOMAINS.index(k[0]), k[1], k[2]))
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for domain, length, budget in keys:
        base = kl[(domain, length, budget, "base")]
        base_mean = statistics.fmean(base.values())
        cells = []
        for spec in specs:
            less = kl.get((domain, length, budget, spec), {})
            if not less:
                cells.append("-")
                continue
            mean = statistics.fmean(less.values())
            below = sum(less[p] < base[p] for p in less)
            totals[spec][0] += below
            totals[spec][1] += len(less)
            cells.append(f"{mean:.4f} / {1 - mean / base_mean:+.1%} / {below}/{len(less)}")
        lines.append(f"| {domain} | {length} | {budget} | {len(base)} | {base_mean:.4f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {spec}: below its base on {below} of {n} prompt-budget pairs" for spec, (below, n) in totals.items()]
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval less_domains", description=__doc__.split("\n")[0])
    ap.add_argument("--specs", nargs="+", required=True, help="LESS specs (their budget is set by --budgets)")
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--lengths", type=_csv_ints, default=[2048, 4096])
    ap.add_argument("--budgets", type=_csv_ints, default=[256, 512])
    ap.add_argument("--seeds", type=_csv_ints, default=[0, 1, 2], help="documents: prompts per length")
    ap.add_argument("--prompts-per-length", type=int, default=3, help="pydoc/packages: windows per length")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "less_domains")
    ap.add_argument("--merge", type=Path, nargs="*", default=[], help="records.jsonl of earlier runs (same prompts) whose LESS rows join the table")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    domains = [d for d in args.domains.split(",") if d]
    if unknown := set(domains) - set(DOMAINS):
        ap.error(f"unknown domains {sorted(unknown)}; choose from {', '.join(DOMAINS)}")
    torch.set_num_threads(args.threads)
    engine = Engine.default(dtype=args.dtype)
    methods = []
    for spec in args.specs:  # "{budget}" in a spec (a kernel file per budget) is each budget
        for budget in args.budgets:
            (method,) = method_grid([spec.replace("{budget}", str(budget))], [budget])
            methods.append(Method(spec, method.policy, budget))
    if not all(isinstance(m.policy, LESS) for m in methods):
        ap.error("--specs takes LESS specs (less:base=...); each runs beside its base")
    records = []
    for domain in domains:
        records += run_domain(engine, domain, methods, args.lengths, args.seeds, args.prompts_per_length)
        write_records(args.out, records)
    specs = list(args.specs)
    for path in args.merge:  # the base rows are this run's (the same prompts give the same base KL)
        earlier = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        records += [r for r in earlier if r["role"] == "less"]
        specs = [*dict.fromkeys(r["method"] for r in earlier if r["role"] == "less"), *specs]
    command = "python -m eval less_domains " + " ".join(sys.argv[1:] if argv is None else argv)
    write_table(args.out, [f"Produced by `{command}` ({args.dtype}, {args.threads} threads)", "", *table(records, specs)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
