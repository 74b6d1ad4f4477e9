"""Prompt-lookup drafts over an agent-memory session: tool calls and answers, drafted against undrafted.

Prompt-lookup drafts on an agent-memory session (the turns of the LangChain connector's long-log
agent example, driven here through ``langchain_snapkv``'s public API): the same session run with
``prompt_lookup_num_tokens`` 0 and K, each from an empty memory. Per model call (tool-call turns,
whose arguments are decoded under the grammar, and answer turns apart): decode ms per generated
token after the first, tokens per forward, and whether the call's output is the undrafted one.

    .venv/bin/python -m eval lookup_agent [--turns 8] [--k 4] [--out eval/agents/results/lookup_agent]

The session is the one connectors/langchain-snapkv/examples/long_log_agent.py runs (the same log
parts, system prompt, questions and tool-choice steering), written out here so the benchmark does
not import an example file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"


SERVICES = ["billing", "search", "auth", "mailer", "reports", "storage", "gateway", "scheduler", "cache", "audit"]
SECRET = "the backup job failed with error code E-4471"
SYSTEM_PROMPT = "You are an operations assistant. Use read_log to read the server log. Answer briefly."


def log_part(part: int) -> str:
    """Part ``part`` of a made-up server log: ~200 tokens; part 1 holds the one alert that matters."""
    lines = []
    for i in range(8):
        service = SERVICES[(part + i) % len(SERVICES)]
        lines.append(f"0{part % 10}:{i * 4:02d}:17 INFO {service}: handled {100 + 37 * i + part} requests, p95 {12 + i} ms")
        if part == 1 and i == 5:
            lines.append(f"0{part}:{i * 4:02d}:55 ALERT backup: {SECRET}")
    return "\n".join(lines)


def read_log(part: int) -> str:
    """Read one part of the server log (parts are numbered from 1)."""
    return log_part(part)


def run_session(llm, history, turns: int) -> list[dict]:
    """``turns`` user turns through ``langchain.agents.create_agent`` (the last asks about part 1);
    one row of figures per model call. A middleware steers ``tool_choice`` as the example does:
    "any" when the user asks to read a part, "none" once the tool result is in."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    @wrap_model_call
    def steer_tool_choice(request, handler):
        last = request.messages[-1] if request.messages else None
        if isinstance(last, HumanMessage) and "read part" in last.content.lower():
            request = request.override(tool_choice="any")
        elif isinstance(last, ToolMessage):
            request = request.override(tool_choice="none")
        return handler(request)

    agent = create_agent(llm, tools=[read_log], system_prompt=SYSTEM_PROMPT, middleware=[steer_tool_choice])
    questions = [f"Read part {k} of the log and say which service is busiest." for k in range(1, turns)]
    questions.append("Question about part 1 of the log, which you read first: what did the backup job alert say? Quote it.")
    rows = []
    for turn, question in enumerate(questions, start=1):
        before = history.fitted_messages(llm.client, max_new_tokens=llm.max_tokens or 256)
        state = agent.invoke({"messages": [*before, HumanMessage(question)]})
        new = state["messages"][len(before) :]
        history.add_messages(new)
        for j, m in enumerate((m for m in new if isinstance(m, AIMessage)), start=1):
            meta = m.response_metadata
            rows.append(
                {
                    "turn": turn,
                    "call": j,
                    "prompt_tokens": meta["prompt_tokens"],
                    "reused_prompt_tokens": meta.get("reused_prompt_tokens"),
                    "kept_tokens": meta["kept_tokens"],
                    "compression_ratio": meta["compression_ratio"],
                    "prefill_seconds": meta["prefill_seconds"],
                    "tool_calls": m.tool_calls,
                    "text": m.content,
                    "completion_tokens": (m.usage_metadata or {}).get("output_tokens"),
                    "decode_seconds": meta["total_seconds"] - meta["prefill_seconds"],
                    "drafts": meta["snapkv_stats"].get("drafts"),
                }
            )
    return rows


def session(k: int, turns: int, budget: int) -> list[dict]:
    from langchain_snapkv import ChatSnapKV, SnapKVChatMessageHistory
    from snapkv_rag.integrations import AgentMemory

    llm = ChatSnapKV(model="default", max_tokens=40, compression=f"snapkv:budget={budget}", prompt_lookup_num_tokens=k)
    history = SnapKVChatMessageHistory(AgentMemory(str(Path(tempfile.mkdtemp()) / "agent.sqlite3")), f"lookup-{k}")
    rows = run_session(llm, history, turns)
    for row in rows:
        tokens = (row["completion_tokens"] or 1) - 1
        row["k"] = k
        row["kind"] = "tool call" if row["tool_calls"] else "answer"
        row["decode_ms_per_token"] = row["decode_seconds"] / tokens * 1000 if tokens > 0 else None
        row["tool_calls"] = [(c["name"], c["args"]) for c in row["tool_calls"]]
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval lookup_agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "lookup_agent"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    session(0, 2, args.budget)  # warm-up: the engine loads, the first calls' one-off costs are paid
    plain, drafted = session(0, args.turns, args.budget), session(args.k, args.turns, args.budget)
    write_records(Path(args.out), plain + drafted)
    lines = [
        "| calls | median decode ms/token (K=0 → K) | median speedup | tokens per forward | identical outputs |",
        "|---|---|---|---|---|",
    ]
    for kind in ("tool call", "answer"):
        pairs = [(a, b) for a, b in zip(plain, drafted) if a["kind"] == kind and a["decode_ms_per_token"] and b["decode_ms_per_token"]]
        if not pairs:
            continue
        per_forward = statistics.mean(b["drafts"]["tokens_per_forward"] for _, b in pairs if b["drafts"] and b["drafts"].get("tokens_per_forward"))
        same = sum((a["text"], a["tool_calls"]) == (b["text"], b["tool_calls"]) for a, b in pairs)
        lines.append(
            f"| {kind} ({len(pairs)}) | {statistics.median(a['decode_ms_per_token'] for a, _ in pairs):.1f} → "
            f"{statistics.median(b['decode_ms_per_token'] for _, b in pairs):.1f} | "
            f"{statistics.median(a['decode_ms_per_token'] / b['decode_ms_per_token'] for a, b in pairs):.2f}x | {per_forward:.2f} | {same}/{len(pairs)} |"
        )
    lines += ["", f"Command: `.venv/bin/python -m eval lookup_agent --turns {args.turns} --k {args.k}` (SnapKV budget {args.budget}, 40 new tokens at most)"]
    write_table(Path(args.out), lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
