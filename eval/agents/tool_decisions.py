"""Tool decisions under tool_choice="auto" on the embedded model (issue 28).

Two tool sets, each offered with every prompt of its file:

- A: weather, multiply, currency, document search; eval/agents/data/tool_decisions.jsonl (20 prompts
  that need one of them in several phrasings, 20 that need none, several on the same topics);
- B: e-mail, timer, stock price, calendar, restaurant booking; eval/agents/data/tool_decisions_b.jsonl
  (25 and 25).

A decision is right when a prompt that needs a tool calls that tool first, and a prompt that
needs none gets an answer without a call.

1. ``model``: the model decides as it writes (the call grammar lets it start a call anywhere);
   this was the engine's only behaviour before the call gate.
2. The call gate (:mod:`snapkv_rag.tools.call_gate`): each tool's call opening scored after the prompt,
   calibrated against requests that need no tool, plus ``w`` times the marker's log-probability,
   against a threshold. ``w`` and the threshold are fitted on one tool set (the most right
   decisions with no call on its no-tool prompts) and checked on the other, both ways: the
   other set has other tools and other prompts, so this measures what a user with their own
   tools would get.
3. The engine end to end (``engine.generate`` with tool_choice="auto") with ``engine.call_gate``
   set to the gate fitted on the other set: the call is then written under the grammar with the
   gate's tool forced.

    .venv/bin/python -m eval tool_decisions [--out eval/agents/results/tool_decisions]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.engine.prompts import render_prompt
from snapkv_rag.errors import StructuredOutputError
from snapkv_rag.tools import build_output_spec
from snapkv_rag.tools.call_gate import CallGate, CallScores, decide

DATA = Path(__file__).resolve().parent / "data"
RESULTS = Path(__file__).resolve().parent / "results"


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": properties, "required": required}},
    }


def strings(*names: str) -> dict:
    return {n: {"type": "string"} for n in names}


TOOLSETS = {
    "A": [
        fn("get_weather", "Get the current weather in a city.", strings("city"), ["city"]),
        fn("multiply", "Multiply two integers exactly.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
        fn(
            "convert_currency",
            "Convert an amount of money from one currency to another at today's rate.",
            {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
            ["amount", "from_currency", "to_currency"],
        ),
        fn("search_documents", "Search the user's own documents and notes.", strings("query"), ["query"]),
    ],
    "B": [
        fn("send_email", "Send an email to a recipient.", strings("to", "subject", "body"), ["to", "body"]),
        fn("set_timer", "Start a countdown timer for a number of minutes.", {"minutes": {"type": "number"}}, ["minutes"]),
        fn("get_stock_price", "Get the latest share price of a company by its stock ticker.", strings("ticker"), ["ticker"]),
        fn("create_calendar_event", "Add an event to the user's calendar.", strings("title", "date", "time"), ["title", "date"]),
        fn("book_table", "Reserve a table at a restaurant.", {**strings("restaurant", "time"), "people": {"type": "integer"}}, ["restaurant", "people"]),
    ],
}
FILES = {"A": "tool_decisions.jsonl", "B": "tool_decisions_b.jsonl"}
MAX_NEW_TOKENS = 48
WEIGHTS = (0.0, 1.0, 2.0, 3.0, 4.0)


def load(toolset: str) -> list[dict]:
    lines = (DATA / FILES[toolset]).read_text().splitlines()
    return [{"toolset": toolset, **json.loads(line)} for line in lines if line.strip()]


def run(engine: Engine, prompts: list[dict]) -> list[dict]:
    """Each prompt through ``engine.generate`` under tool_choice="auto"."""
    out = []
    for item in prompts:
        try:
            result = engine.generate(item["prompt"], tools=TOOLSETS[item["toolset"]], tool_choice="auto", max_new_tokens=MAX_NEW_TOKENS)
            called, text, error, decision = [c.name for c in result.tool_calls], result.text, None, result.stats.tool_decision
        except StructuredOutputError as exc:  # a call cut by max_new_tokens: it did start a call
            called, text, error, decision = ["(unfinished call)"], "", str(exc)[:200], None
        right = called[:1] == [item["tool"]] if item["tool"] else not called
        out.append({**item, "called": called, "right": right, "text": text[:200], "error": error, "decision": decision})
    return out


def scored(engine: Engine, prompts: list[dict]) -> list[dict]:
    """Each prompt's call scores and its tool set's prior, from the engine's own gate functions."""
    out = []
    for item in prompts:
        spec = build_output_spec(TOOLSETS[item["toolset"]], "auto")
        scores = engine.call_scores(render_prompt(engine.tokenizer, item["prompt"], tools=spec.tools), spec)
        out.append({**item, "marker": scores.marker, "scores": scores.tools, "prior": engine.call_prior(spec)})
    return out


def gate_decisions(rows: list[dict], gate: CallGate) -> list[dict]:
    out = []
    for r in rows:
        tool = decide(gate, CallScores(r["marker"], r["scores"]), r["prior"]).tool
        called = [tool] if tool else []
        out.append({**r, "called": called, "right": called[:1] == [r["tool"]] if r["tool"] else not called})
    return out


def fit(rows: list[dict]) -> CallGate:
    """The gate with the most right decisions among those that call no tool on a no-tool prompt."""
    best, best_key = CallGate(threshold=1e9), (-1, 0.0)
    for weight in WEIGHTS:
        for threshold in [x / 2 for x in range(-120, 21)]:
            gate = CallGate(threshold=threshold, marker_weight=weight)
            decided = gate_decisions(rows, gate)
            if any(d["called"] for d in decided if not d["tool"]):
                continue
            key = (sum(d["right"] for d in decided), -threshold)  # ties: the lowest threshold that still calls nothing wrongly
            if key > best_key:
                best, best_key = gate, key
    return best


def table_row(name: str, rows: list[dict]) -> str:
    tool = [r for r in rows if r["tool"]]
    none = [r for r in rows if not r["tool"]]
    called = sum(bool(r["called"]) for r in tool)
    right_tool = sum(r["right"] for r in tool)
    prose = sum(r["right"] for r in none)
    return f"| {name} | {called}/{len(tool)} | {right_tool}/{len(tool)} | {prose}/{len(none)} | {right_tool + prose}/{len(rows)} ({(right_tool + prose) / len(rows):.0%}) |"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval tool_decisions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "tool_decisions"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    engine = Engine.default()
    prompts = {name: load(name) for name in TOOLSETS}
    free = {name: run(engine, p) for name, p in prompts.items()}
    scores = {name: scored(engine, p) for name, p in prompts.items()}
    gates = {name: fit(rows) for name, rows in scores.items()}
    gated = {}
    for name, p in prompts.items():
        engine.call_gate = gates[next(n for n in TOOLSETS if n != name)]
        gated[name] = run(engine, p)
    engine.call_gate = None
    lines = [
        "| tool set | decision | called a tool when one was needed | right tool | no call when none was needed | right decisions |",
        "|---|---|---|---|---|---|",
    ]
    for name in TOOLSETS:
        other = next(n for n in TOOLSETS if n != name)
        g = gates[other]
        lines += [
            "| " + name + " " + table_row("the model, as it writes (before)", free[name]),
            "| " + name + " " + table_row(f"gate fitted on set {other} (w={g.marker_weight:g}, t={g.threshold:g})", gate_decisions(scores[name], g)),
            "| "
            + name
            + " "
            + table_row(
                f"gate fitted on this set (w={gates[name].marker_weight:g}, t={gates[name].threshold:g}; in-sample)", gate_decisions(scores[name], gates[name])
            ),
            "| " + name + " " + table_row(f"gate fitted on set {other}, end to end through engine.generate", gated[name]),
        ]
    records = [{"run": "model", **r} for rows in free.values() for r in rows]
    records += [{"run": "gate", **r} for rows in gated.values() for r in rows]
    records += [{"run": "scores", **r} for rows in scores.values() for r in rows]
    write_records(out, records)
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
