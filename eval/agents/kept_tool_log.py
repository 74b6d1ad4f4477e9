"""An agent's long tool log asked its later questions (issue 76): compressed once without a question
and kept, against today's memory (the prefix cache keeps the log's full K/V, each question compresses
it again with its own window).

The history is the long-log agent's (connectors/langchain-snapkv/examples/long_log_agent.py): the
system prompt, then per log part a user turn asking to read it, the assistant's ``read_log`` call, the
tool's result (~200 tokens) and a short reply; ``--parts`` parts (8: about 2,700 tokens; 16: 5,500), eight of
which hold one ALERT line with its own error code. The agent is then asked, one question at a time,
which error code each alert reported (the last user turn; the history is the same for all of them).
Readings, at a budget of the history's tokens over ``--ratio`` (4):

- ``today``: SnapKV with each question's own window, the prefix cache on (the agent's consecutive
  prompts share the history, whose full K/V the cache keeps and reuses);
- ``agnostic-snapkv`` / ``agnostic-expected`` / ``agnostic-kvzip``: the history compressed once with
  no question (``keep_context``) and every question read over it;
- ``cut-expected``: the history compressed once by Expected Attention at twice the budget and kept, each
  question then cut to the budget by SnapKV with its own window;
- ``full``: the full cache, the prefix cache on.

Per question: the answer, whether it quotes the code, end-to-end seconds, the call's kept K/V bytes
and what the engine holds between questions (prefix cache and kept contexts).

    .venv/bin/python -m eval kept_tool_log [--parts 8] [--ratio 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from eval.common.results_io import write_records, write_table
from eval.rag.follow_ups import reading_call
from snapkv_rag import Engine

RESULTS = Path(__file__).resolve().parent / "results"
READINGS = ("today", "agnostic-snapkv", "agnostic-expected", "agnostic-kvzip", "cut-expected", "full")
SERVICES = ["billing", "search", "auth", "mailer", "reports", "storage", "gateway", "scheduler", "cache", "audit"]
SYSTEM_PROMPT = "You are an operations assistant. Use read_log to read the server log. Answer briefly."
READ_LOG = {
    "type": "function",
    "function": {
        "name": "read_log",
        "description": "Read one part of the server log (parts are numbered from 1).",
        "parameters": {"type": "object", "properties": {"part": {"type": "integer"}}, "required": ["part"]},
    },
}
MAX_NEW_TOKENS = 24


def log_part(part: int, alert: str | None) -> str:
    lines = [
        f"{part:02d}:{i * 4:02d}:17 INFO {SERVICES[(part + i) % len(SERVICES)]}: handled {100 + 37 * i + part} requests, p95 {12 + i} ms" for i in range(8)
    ]
    if alert is not None:
        lines.insert(5, f"{part:02d}:20:55 ALERT {alert}")
    return "\n".join(lines)


def history(parts: int, seed: int = 0) -> tuple[list[dict], list[tuple[str, str]]]:
    """The agent's messages and ``(question, error code)`` per alert."""
    rng = random.Random(seed)
    alerted = list(range(1, parts + 1, max(1, parts // 8)))[:8]  # eight parts, evenly spread
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    questions = []
    for part in range(1, parts + 1):
        alert = None
        if part in alerted:
            code = f"E-{rng.randint(1000, 9999)}"
            service = SERVICES[(part * 3) % len(SERVICES)]
            alert = f"{service}: the nightly job failed with error code {code}"
            questions.append((f"Which error code did the {service} alert in part {part} of the log report?", code))
        call = {"id": f"call-{part}", "type": "function", "function": {"name": "read_log", "arguments": json.dumps({"part": part})}}
        messages += [
            {"role": "user", "content": f"Read part {part} of the log."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": log_part(part, alert)},
            {"role": "assistant", "content": f"I have read part {part}."},
        ]
    return messages, questions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval kept_tool_log", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--readings", nargs="+", choices=READINGS, default=list(READINGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "kept_tool_log")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine.default()
    messages, questions = history(args.parts)
    log_tokens = engine.count_tokens(messages, tools=[READ_LOG])
    budget = max(128, log_tokens // args.ratio)
    records = []
    for reading in args.readings:
        engine.prefix_cache.clear()
        engine.kept_contexts.clear()
        compression, keep = reading_call("own" if reading == "today" else reading, budget, 0)
        for index, (question, code) in enumerate(questions):
            options = {"keep_context": keep} if keep else {}
            result = engine.generate(
                [*messages, {"role": "user", "content": question}],
                compression=compression,
                tools=[READ_LOG],
                tool_choice="none",
                max_new_tokens=MAX_NEW_TOKENS,
                **options,
            )
            held = engine.prefix_cache.stats().bytes + engine.kept_contexts.stats().bytes
            records.append(
                {
                    "reading": reading,
                    "ratio": args.ratio,
                    "history_tokens": log_tokens,
                    "index": index,
                    "question": question,
                    "answer": result.text,
                    "correct": code in result.text,
                    "seconds": round(result.stats.total_seconds, 3),
                    "prefilled_tokens": result.stats.prefilled_prompt_tokens,
                    "kv_bytes": result.stats.prompt_kv_bytes_kept,
                    "held_bytes": held,
                    "context_reuse": result.stats.context_reuse,
                }
            )
            print(json.dumps(records[-1]), flush=True)
    write_records(args.out, records)
    lines = [
        "| reading | history tokens | budget | questions | right | median s per question | median s after the first | KV MB per call | MB held between questions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for reading in args.readings:
        rows = [r for r in records if r["reading"] == reading]
        later = [r["seconds"] for r in rows if r["index"] > 0]
        lines.append(
            f"| {reading} | {rows[0]['history_tokens']} | {budget if reading != 'full' else '-'} | {len(rows)} | {sum(r['correct'] for r in rows)} | "
            f"{statistics.median(r['seconds'] for r in rows):.2f} | {statistics.median(later):.2f} | "
            f"{statistics.median(r['kv_bytes'] for r in rows) / 2**20:.1f} | {max(r['held_bytes'] for r in rows) / 2**20:.1f} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
