"""An agent over a long history: 20 turns, a tool that returns a long log, a question about its start.

    python connectors/langchain-snapkv/examples/long_log_agent.py [--turns 20] [--budget 512]

``langchain.agents.create_agent(ChatSnapKV(...), tools=[read_log])`` runs each turn. Turns
1..N-1 ask the agent to read the next part of a server log (each part ~200 tokens; together
they exceed the SnapKV budget several times); the last turn asks about a detail that only
part 1 holds. Every message, tool logs included, is kept verbatim in the core agent memory
(SQLite) through ``SnapKVChatMessageHistory``; each turn starts from the stored history, so
consecutive prompts share their prefix (what the engine's prefix cache reuses, where the
engine has one). Per model call it prints prompt tokens, reused prefix tokens, KV entries
kept per layer and the compression ratio.

The 135M embedded model does not decide reliably when to call a tool, so a small middleware
steers ``tool_choice`` (LangChain's standard request field): "any" when the user asks to
read a part, "none" once the tool result is in. The call itself (name and arguments) is the
model's, under the engine's constrained decoding.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from langchain_snapkv import ChatSnapKV, SnapKVChatMessageHistory
from snapkv_rag.integrations import AgentMemory

SERVICES = ["billing", "search", "auth", "mailer", "reports", "storage", "gateway", "scheduler", "cache", "audit"]
SECRET = "the backup job failed with error code E-4471"


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


@wrap_model_call
def steer_tool_choice(request, handler):
    last = request.messages[-1] if request.messages else None
    if isinstance(last, HumanMessage) and "read part" in last.content.lower():
        request = request.override(tool_choice="any")
    elif isinstance(last, ToolMessage):
        request = request.override(tool_choice="none")
    return handler(request)


def run_session(llm: ChatSnapKV, history: SnapKVChatMessageHistory, turns: int = 10, echo=print) -> list[dict]:
    """Run ``turns`` user turns (the last asks about part 1); one row of figures per model call."""
    agent = create_agent(
        llm,
        tools=[read_log],
        system_prompt="You are an operations assistant. Use read_log to read the server log. Answer briefly.",
        middleware=[steer_tool_choice],
    )
    questions = [f"Read part {k} of the log and say which service is busiest." for k in range(1, turns)]
    questions.append("Question about part 1 of the log, which you read first: what did the backup job alert say? Quote it.")
    rows = []
    echo("turn call  prompt  reused  kept/layer  ratio  prefill_s  what")
    for turn, question in enumerate(questions, start=1):
        before = history.fitted_messages(llm.client, max_new_tokens=llm.max_tokens or 256)
        state = agent.invoke({"messages": [*before, HumanMessage(question)]})
        new = state["messages"][len(before) :]
        history.add_messages(new)
        for j, m in enumerate((m for m in new if isinstance(m, AIMessage)), start=1):
            meta = m.response_metadata
            row = {
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
            rows.append(row)
            what = f"tool call {m.tool_calls[0]['name']}({m.tool_calls[0]['args']})" if m.tool_calls else repr(m.content.strip()[:70])
            reused = row["reused_prompt_tokens"]
            echo(
                f"{turn:4d} {j:4d} {row['prompt_tokens']:7d} {'n/a' if reused is None else reused:>7} {row['kept_tokens']:11d} "
                f"{row['compression_ratio']:6.2f} {row['prefill_seconds']:10.1f}  {what}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--budget", type=int, default=512, help="SnapKV budget (KV entries kept per layer and head)")
    parser.add_argument("--memory", default=None, help="SQLite file of the agent memory (default: a temporary one)")
    args = parser.parse_args()

    llm = ChatSnapKV(model="default", max_tokens=40, compression=f"snapkv:budget={args.budget}")
    db = args.memory or str(Path(tempfile.mkdtemp()) / "agent.sqlite3")
    history = SnapKVChatMessageHistory(AgentMemory(db), "long-log")
    history.clear()
    print(f"agent memory: {db}; compression snapkv:budget={args.budget}")
    started = time.perf_counter()
    run_session(llm, history, args.turns)
    messages = history.messages
    tool_tokens = sum(llm.client.count_tokens(m.content, chat=False) for m in messages if isinstance(m, ToolMessage))
    final = [m for m in messages if isinstance(m, AIMessage)][-1].content.strip()
    print(f"\nFinal answer: {final}")
    print(f"Expected (from part 1): {SECRET}; code E-4471 in the answer: {'E-4471' in final}")
    print(
        f"{len(messages)} messages stored verbatim; tool logs {tool_tokens} tokens in all vs SnapKV budget {args.budget}; {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
