"""Tool decisions under tool_choice="auto" on the embedded model (issue 28): where they stand.

Four tools (weather, multiply, currency, document search) are offered with every prompt of
eval/data/tool_decisions.jsonl: 20 prompts that need one of them (several phrasings each)
and 20 that need none. A decision is right when a prompt that needs a tool calls that tool
first, and a prompt that needs none gets an answer without a call.

1. ``free``: the engine as shipped (the call grammar lets the model start a call anywhere).
2. An analysis, not shipped: each tool's call prefix ``<tool_call>\n{"name": "<tool>"`` is
   scored by teacher forcing after the prompt, minus the same score after content-free
   prompts (contextual calibration); a threshold on the best calibrated score (plus 3x the
   log-probability of the marker's first token) is fitted on one half of the prompts and
   checked on the other, both ways.

    .venv/bin/python eval/tool_decisions.py [--out eval/results/tool_decisions]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_io import write_records, write_table  # noqa: E402

from snapkv_rag import Engine  # noqa: E402
from snapkv_rag.errors import StructuredOutputError  # noqa: E402


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": properties, "required": required}},
    }


TOOLS = [
    fn("get_weather", "Get the current weather in a city.", {"city": {"type": "string"}}, ["city"]),
    fn("multiply", "Multiply two integers exactly.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    fn(
        "convert_currency",
        "Convert an amount of money from one currency to another at today's rate.",
        {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        ["amount", "from_currency", "to_currency"],
    ),
    fn("search_documents", "Search the user's own documents and notes.", {"query": {"type": "string"}}, ["query"]),
]
MAX_NEW_TOKENS = 48


def run(engine: Engine, prompts: list[dict]) -> list[dict]:
    out = []
    for item in prompts:
        try:
            result = engine.generate(item["prompt"], tools=TOOLS, tool_choice="auto", max_new_tokens=MAX_NEW_TOKENS)
            called, text, error = [c.name for c in result.tool_calls], result.text, None
        except StructuredOutputError as exc:  # a call cut by max_new_tokens: it did start a call
            called, text, error = ["(unfinished call)"], "", str(exc)[:200]
        right = called[:1] == [item["tool"]] if item["tool"] else not called
        out.append({**item, "called": called, "right": right, "text": text[:200], "error": error})
    return out


def call_scores(engine: Engine, prompt: str) -> dict[str, float]:
    """Log-probability of each tool's call prefix right after ``prompt`` (teacher forcing)."""
    import torch

    from snapkv_rag.tools import CALL_OPEN, build_output_spec, call_prefix

    (row,) = engine._render_within_context([prompt], None, 32, [build_output_spec(TOOLS, "auto")])
    out = {}
    for tool in TOOLS:
        name = tool["function"]["name"]
        cont = engine.tokenizer(CALL_OPEN + call_prefix(name).removesuffix(', "arguments": '), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = engine.model(torch.tensor([row + cont]), use_cache=False).logits[0, len(row) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(cont)), torch.tensor(cont)]
        out[name] = float(lp.sum())
        out["first_token"] = float(lp[0])
    return out


def table(name: str, rows: list[dict]) -> str:
    tool = [r for r in rows if r["tool"]]
    none = [r for r in rows if not r["tool"]]
    called_when_needed = sum(bool(r["called"]) for r in tool)
    right_tool = sum(r["right"] for r in tool)
    prose = sum(r["right"] for r in none)
    return f"| {name} | {called_when_needed}/{len(tool)} | {right_tool}/{len(tool)} | {prose}/{len(none)} | {(right_tool + prose) / len(rows):.0%} |"


def calibrated(rows: list[dict], prior: dict[str, float], threshold: float) -> list[dict]:
    names = [t["function"]["name"] for t in TOOLS]
    out = []
    for r in rows:
        cal = {n: r["scores"][n] - prior[n] for n in names}
        best = max(names, key=cal.get)
        call = cal[best] + 3 * r["scores"]["first_token"] >= threshold
        called = [best] if call else []
        out.append({**r, "called": called, "right": called[:1] == [r["tool"]] if r["tool"] else not called})
    return out


def fit(rows: list[dict], prior: dict[str, float]) -> float:
    grid = [x / 2 for x in range(-100, 21)]
    return max(grid, key=lambda t: sum(r["right"] for r in calibrated(rows, prior, t)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "eval/results/tool_decisions"))
    args = ap.parse_args()
    out = Path(args.out)
    prompts = [json.loads(line) for line in (ROOT / "eval/data/tool_decisions.jsonl").read_text().splitlines() if line.strip()]
    engine = Engine.default()
    free = run(engine, prompts)
    scored = [{**p, "scores": call_scores(engine, p["prompt"])} for p in prompts]
    empty = [call_scores(engine, p) for p in ("N/A", "...", "Hello.")]
    prior = {k: sum(e[k] for e in empty) / len(empty) for k in empty[0]}
    even, odd = scored[0::2], scored[1::2]
    t_even, t_odd = fit(even, prior), fit(odd, prior)
    lines = [
        "| decision | called a tool when one was needed | right tool | no call when none was needed | right decisions |",
        "|---|---|---|---|---|",
        table("free (as shipped)", free),
        table(f"calibrated prefix score, fitted on even prompts (t={t_even}), odd prompts", calibrated(odd, prior, t_even)),
        table(f"calibrated prefix score, fitted on odd prompts (t={t_odd}), even prompts", calibrated(even, prior, t_odd)),
    ]
    write_records(out, [{"run": "free", **r} for r in free] + [{"run": "scores", **r} for r in scored])
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
