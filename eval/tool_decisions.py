"""Right tool decisions under tool_choice="auto" on the embedded model (issue 28).

Four tools (weather, multiply, currency, document search) are offered with every prompt of
eval/data/tool_decisions.jsonl: 20 prompts that need one of them (several phrasings each)
and 20 that need none. A decision is right when a prompt that needs a tool calls that tool
first, and a prompt that needs none gets an answer without a call.

1. ``free``: the model decides freely (the call grammar lets it start a call anywhere); the
   engine records the log-probability of the call marker's first token at the first step.
2. The call-or-answer threshold on that log-probability is chosen on the even-numbered prompts
   (calibration half) and checked on the odd-numbered ones (held out), then
3. ``threshold``: the engine decides at the first token with it, and the model picks the tool
   (forced-call grammar) or writes the answer (grammar without calls).

    .venv/bin/python eval/tool_decisions.py [--out eval/results/tool_decisions] [--threshold T]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapkv_rag import Engine  # noqa: E402
from snapkv_rag.errors import StructuredOutputError  # noqa: E402


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}


TOOLS = [
    fn("get_weather", "Get the current weather in a city.", {"city": {"type": "string"}}, ["city"]),
    fn("multiply", "Multiply two integers exactly.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    fn("convert_currency", "Convert an amount of money from one currency to another at today's rate.",
       {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
       ["amount", "from_currency", "to_currency"]),
    fn("search_documents", "Search the user's own documents and notes.", {"query": {"type": "string"}}, ["query"]),
]
MAX_NEW_TOKENS = 48


def run(engine: Engine, prompts: list[dict], threshold: float | None) -> list[dict]:
    out = []
    for item in prompts:
        try:
            result = engine.generate(item["prompt"], tools=TOOLS, tool_choice="auto", tool_call_threshold=threshold,
                                     max_new_tokens=MAX_NEW_TOKENS)
            called = [c.name for c in result.tool_calls]
            decision = result.stats.tool_decision or {}
            text, error = result.text, None
        except StructuredOutputError as exc:  # a call cut by max_new_tokens: it did start a call
            called, decision, text, error = ["(unfinished call)"], {}, "", str(exc)[:200]
        right = called[:1] == [item["tool"]] if item["tool"] else not called
        out.append({**item, "called": called, "right": right, "marker_logprob": decision.get("marker_logprob"),
                    "text": text[:200], "error": error})
    return out


def best_threshold(rows: list[dict]) -> float:
    """The threshold that separates tool prompts from the others best on ``rows`` (midpoint of the gap)."""
    values = sorted({r["marker_logprob"] for r in rows})
    candidates = [values[0] - 1] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1]

    def accuracy(t: float) -> float:
        return sum((r["marker_logprob"] >= t) == bool(r["tool"]) for r in rows) / len(rows)

    return max(candidates, key=lambda t: (accuracy(t), -abs(t - sum(values) / len(values))))


def table(name: str, rows: list[dict]) -> str:
    tool = [r for r in rows if r["tool"]]
    none = [r for r in rows if not r["tool"]]
    called_when_needed = sum(bool(r["called"]) for r in tool)
    right_tool = sum(r["right"] for r in tool)
    prose = sum(r["right"] for r in none)
    return (f"| {name} | {called_when_needed}/{len(tool)} | {right_tool}/{len(tool)} | {prose}/{len(none)} | "
            f"{(right_tool + prose) / len(rows):.0%} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "eval/results/tool_decisions"))
    ap.add_argument("--threshold", type=float, default=None, help="skip calibration and use this threshold")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line) for line in (ROOT / "eval/data/tool_decisions.jsonl").read_text().splitlines() if line.strip()]
    engine = Engine.default()
    free = run(engine, prompts, None)
    calibration, held_out = free[0::2], free[1::2]
    threshold = args.threshold if args.threshold is not None else best_threshold([r for r in calibration if r["marker_logprob"] is not None])
    decided = run(engine, prompts, threshold)
    lines = [
        "| decision | called a tool when one was needed | right tool | no call when none was needed | right decisions |",
        "|---|---|---|---|---|",
        table("free (the model decides anywhere)", free),
        table(f"threshold {threshold:.2f} at the first token, all 40", decided),
        table("  of which the held-out (odd) prompts", decided[1::2]),
    ]
    separable = [r["marker_logprob"] for r in free if r["marker_logprob"] is not None]
    lines += ["", f"threshold chosen on the 20 even prompts: {threshold:.3f} (log-probability of {engine.tokenizer.decode([engine._grammar_tokenizer.marker_first_id])!r} at the first token)",
              "marker log-probability, tool prompts: " + ", ".join(f"{r['marker_logprob']:.2f}" for r in free if r["tool"] and r["marker_logprob"] is not None),
              "marker log-probability, no-tool prompts: " + ", ".join(f"{r['marker_logprob']:.2f}" for r in free if not r["tool"] and r["marker_logprob"] is not None)]
    if held_out and separable:
        lines.append(f"(held-out prompts by the free run's log-probabilities alone: {sum((r['marker_logprob'] >= threshold) == bool(r['tool']) for r in held_out)}/{len(held_out)})")
    (out / "records.jsonl").write_text("".join(json.dumps({"run": "free", **r}) + "\n" for r in free)
                                       + "".join(json.dumps({"run": "threshold", "threshold": threshold, **r}) + "\n" for r in decided))
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    print(text)
    assert math.isfinite(threshold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
