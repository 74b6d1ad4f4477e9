"""The tune gates' noise (issue 65): the same gates run twice, invariant mode off and on.

``eval/tune/gate_noise.sh`` runs the gates of the base model and the shipped adapter four times:
the invariant mode on and off, each once in the prompts' order and once reversed (the same prompts
computed after another prefix-cache history). This compares each mode's two runs: how many answers
and tool decisions changed text, and how far each gate's figures moved; the most each figure moved
between any two runs of one model is its noise (``noise.json``), which the adapter rule
(:mod:`snapkv_rag.model.adapter_rule`) reads. A gate margin smaller
than the mode-off movement was inside the noise the issue-47 gates were read against.

    bash eval/tune/gate_noise.sh
    .venv/bin/python -m eval gate_noise
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.common.results_io import write_table
from eval.tune.tune_gates import RECOMPUTE, RESULTS, REUSE_SIZE, SIZES, read

NOISE_FILE = "noise.json"  # read by tune_gates --manifest (the adapter rule)
RUNS = {"off": ("off_forward", "off_reversed"), "on": ("on_forward", "on_reversed")}


def key(record: dict) -> tuple:
    return (record["part"], record["variant"], record.get("size"), record.get("setting"), record.get("question", record.get("prompt")))


def output(record: dict) -> tuple:
    return (record["answer"],) if record["part"] == "answers" else (tuple(record["called"]), record["text"])


def changed(first: list[dict], second: list[dict], part: str, variant: str) -> tuple[int, int]:
    """Records of ``part`` and ``variant`` whose output differs between the runs, of how many."""
    a = {key(r): output(r) for r in first if r["part"] == part and r["variant"] == variant}
    b = {key(r): output(r) for r in second if r["part"] == part and r["variant"] == variant}
    if a.keys() != b.keys():
        raise SystemExit(f"the two runs cover different {variant} {part} prompts")
    return sum(a[k] != b[k] for k in a), len(a)


# each figure's key (snapkv_rag.model.adapter_rule.noise_key) and its label in the table
LABELS = {
    **{f"answers_{size}": f"answers right, {size} full cache" for size in SIZES},
    "citations_1K": "own [n] citations gold F1, 1K",
    "chunk_reuse_2K": f"answers lost by chunk reuse, {REUSE_SIZE}",
    "snapkv_4x_2K": f"answers lost by SnapKV 4x, {REUSE_SIZE}",
    "tool_decisions": "tool decisions right",
    "tool_decisions.false_calls": "false calls (no tool needed)",
}


def figures(records: list[dict], variant: str) -> dict[str, float | None]:
    """The gates' figures of one model in one run, by the adapter rule's keys."""

    def answers(size: str, setting: str = "full") -> list[dict]:
        return [r for r in records if r["part"] == "answers" and r["variant"] == variant and r["size"] == size and r["setting"] == setting]

    def lost(setting: str) -> int:
        reference = {r["question"]: r["correct"] for r in answers(REUSE_SIZE)}
        return sum(reference[r["question"]] and not r["correct"] for r in answers(REUSE_SIZE, setting))

    out: dict[str, float | None] = {f"answers_{size}": sum(r["correct"] for r in answers(size)) for size in SIZES}
    cited = [r["gold_f1"] for r in answers("1K") if r["gold"]]
    out["citations_1K"] = round(sum(cited) / len(cited), 3) if cited else None
    out["chunk_reuse_2K"] = lost(f"chunks r={RECOMPUTE}")
    out["snapkv_4x_2K"] = lost("snapkv 4x")
    tools = [r for r in records if r["part"] == "tools" and r["variant"] == variant]
    out["tool_decisions"] = round(sum(r["right"] for r in tools) / len(tools), 3) if tools else None
    out["tool_decisions.false_calls"] = sum(bool(r["called"]) for r in tools if not r["tool"])
    return out


def measures(records: list[dict], variant: str) -> dict[str, str]:
    """The gates' figures of one model in one run, as the table writes them."""
    shown = {}
    for key, value in figures(records, variant).items():
        if value is None:
            shown[LABELS[key]] = "-"
        elif key == "tool_decisions":
            shown[LABELS[key]] = f"{value:.0%}"
        elif key == "citations_1K":
            shown[LABELS[key]] = f"{value:.3f}"
        else:
            shown[LABELS[key]] = str(value)
    return shown


def noise(table: dict[tuple[str, str], dict[str, float | None]]) -> dict[str, float]:
    """Each figure's noise: the most it moved between two runs of one model (any mode, any order)."""
    out: dict[str, float] = {}
    for variant in {v for _, v in table}:
        runs = [figs for (_, v), figs in table.items() if v == variant]
        for key in runs[0]:
            values = [figs[key] for figs in runs if figs[key] is not None]
            if len(values) > 1:
                out[key] = round(max(out.get(key, 0.0), max(values) - min(values)), 3)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval gate_noise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=RESULTS / "gate_noise", help="the folder gate_noise.sh wrote")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = {run: read(args.runs / run) for runs in RUNS.values() for run in runs}
    variants = {mode: sorted({r["variant"] for run in runs for r in records[run]}) for mode, runs in RUNS.items()}
    for mode, runs in RUNS.items():
        for run in runs:
            missing = [
                f"{v} {part}" for v in variants[mode] for part in ("answers", "tools") if not any(r["variant"] == v and r["part"] == part for r in records[run])
            ]
            if missing or not records[run]:
                raise SystemExit(f"{args.runs / run}: no records of {', '.join(missing) or 'anything'} yet (bash eval/tune/gate_noise.sh)")
    columns = [(mode, run, variant) for mode, runs in RUNS.items() for variant in variants[mode] for run in runs]
    numbers = {(run, variant): figures(records[run], variant) for _, run, variant in columns}
    table = {(run, variant): measures(records[run], variant) for _, run, variant in columns}
    header = " | ".join(f"{variant}, mode {mode}, {run.split('_')[1]}" for mode, run, variant in columns)
    lines = [f"| measure | {header} |", "|---|" + "---|" * len(columns)]
    first = table[(columns[0][1], columns[0][2])]
    for measure in first:
        lines.append(f"| {measure} | " + " | ".join(table[(run, variant)][measure] for _, run, variant in columns) + " |")
    lines += ["", "| outputs that changed between the two runs (forward, reversed) | mode off | mode on |", "|---|---|---|"]
    for part in ("answers", "tools"):
        for variant in ("base", "tuned"):
            cells = []
            for mode in ("off", "on"):
                if variant not in variants[mode]:
                    cells.append("not run")
                    continue
                n, total = changed(records[RUNS[mode][0]], records[RUNS[mode][1]], part, variant)
                cells.append(f"{n}/{total}")
            lines.append(f"| {variant} {part} | " + " | ".join(cells) + " |")
    measured = noise(numbers)
    lines += ["", "| figure | noise: the most it moved between two runs of one model |", "|---|---|"]
    lines += [f"| {LABELS[k]} | {v:g} |" for k, v in measured.items()]
    (args.runs / NOISE_FILE).write_text(json.dumps(measured, indent=1) + "\n")
    write_table(args.runs, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
