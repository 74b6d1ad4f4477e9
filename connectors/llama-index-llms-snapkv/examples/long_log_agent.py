"""An AgentWorkflow over a long history: 20 turns, a tool that returns a long log, a question about its start.

    HF_HUB_OFFLINE=1 python connectors/llama-index-llms-snapkv/examples/long_log_agent.py [--turns 20] [--budget 512]

The LlamaIndex twin of ``connectors/langchain-snapkv/examples/long_log_agent.py``: an
``AgentWorkflow`` with one ``FunctionAgent`` (``SnapKVLLM``, a ``read_log`` tool) runs each turn.
Turns 1..N-1 ask it to read the next part of a server log (~200 tokens each; together many
times the SnapKV budget); the last turn asks about a detail only part 1 holds. Every message,
tool logs included, is kept verbatim in ``SnapKVMemory`` (the core agent memory, SQLite), and
each turn's prompt starts with the previous turn's, so the engine's prefix cache reuses it:
per model call the example prints prompt tokens, reused prefix tokens, KV entries kept per
layer and the compression ratio.

The 135M embedded model does not decide on its own when to call a tool (see the tool
decisions table in eval/agents/RESULTS.md), so "read part k" turns set LlamaIndex's own
``initial_tool_choice="read_log"``; the call's arguments are the model's, under the engine's
constrained decoding, and the answer after the tool result is under ``tool_choice="auto"``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent, ToolCallResult
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.tools import FunctionTool
from llama_index.llms.snapkv import SnapKVLLM, SnapKVMemory

SERVICES = ["billing", "search", "auth", "mailer", "reports", "storage", "gateway", "scheduler", "cache", "audit"]
SECRET = "the backup job failed with error code E-4471"


def log_part(part: int) -> str:
    """Part ``part`` of a made-up server log: ~200 tokens; part 1 holds the one alert that matters."""
    lines = []
    for i in range(8):
        service = SERVICES[(part + i) % len(SERVICES)]
        lines.append(f"{part % 24:02d}:{i * 4:02d}:17 INFO {service}: handled {100 + 37 * i + part} requests, p95 {12 + i} ms")
        if part == 1 and i == 5:
            lines.append(f"01:{i * 4:02d}:55 ALERT backup: {SECRET}")
    return "\n".join(lines)


def read_log(part: int) -> str:
    """Read one part of the server log (parts are numbered from 1)."""
    return log_part(part)


CALLS: list[dict] = []  # every LLM chat call's compact report (usage, reused prefix, kept KV), in order


class LLMCalls(BaseEventHandler):
    """Appends each LLM chat call's report to ``CALLS``."""

    @classmethod
    def class_name(cls) -> str:
        return "LLMCalls"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            CALLS.append(dict(event.response.additional_kwargs))


get_dispatcher().add_event_handler(LLMCalls())


def questions(turns: int) -> list[str]:
    asks = [f"Read part {k} of the log and say which service is busiest." for k in range(1, turns)]
    return asks + ["Question about part 1 of the log, which you read first: what did the backup job alert say? Quote it."]


async def run_session(llm: SnapKVLLM, memory: SnapKVMemory, turns: int = 20, echo=print) -> list[dict]:
    """Run ``turns`` user turns (the last asks about part 1); one row of figures per model call."""
    agent = FunctionAgent(
        name="ops",
        description="Reads the server log and answers about it.",
        tools=[FunctionTool.from_defaults(fn=read_log)],
        llm=llm,
        system_prompt="You are an operations assistant. Use read_log to read the server log. Answer briefly.",
    )
    workflow = AgentWorkflow(agents=[agent], root_agent="ops")
    rows: list[dict] = []
    echo("turn call  prompt  reused  kept/layer  ratio  prefill_s  what")
    for turn, question in enumerate(questions(turns), start=1):
        agent.initial_tool_choice = "read_log" if question.startswith("Read part") else None
        first_call = len(CALLS)
        handler = workflow.run(user_msg=question, memory=memory)
        tools = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        result = await handler
        for call, stats in enumerate(CALLS[first_call:], start=1):
            tool = tools[call - 1] if call <= len(tools) else None
            row = {
                "turn": turn,
                "call": call,
                "prompt_tokens": stats.get("prompt_tokens"),
                "reused_prompt_tokens": stats.get("reused_prompt_tokens") or 0,
                "kept_tokens": (stats.get("kept_tokens_per_layer") or [0])[0],
                "compression_ratio": stats.get("compression_ratio", 1.0),
                "prefill_seconds": stats.get("prefill_seconds", 0.0),
                "tool_call": {"name": tool.tool_name, "args": tool.tool_kwargs} if tool else None,
                "text": "" if tool else str(result.response.content or ""),
            }
            rows.append(row)
            what = f"tool call {tool.tool_name}({tool.tool_kwargs})" if tool else repr(row["text"].strip()[:70])
            echo(
                f"{turn:4d} {call:4d} {row['prompt_tokens']:7d} {row['reused_prompt_tokens']:>7} {row['kept_tokens']:11d} "
                f"{row['compression_ratio']:6.2f} {row['prefill_seconds']:10.1f}  {what}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--budget", type=int, default=512, help="SnapKV budget (KV entries kept per layer and head)")
    parser.add_argument("--memory", default=None, help="SQLite file of the agent memory (default: a temporary one)")
    args = parser.parse_args()

    llm = SnapKVLLM(model="default", max_new_tokens=40, compression=f"snapkv:budget={args.budget}")
    db = args.memory or str(Path(tempfile.mkdtemp()) / "agent.sqlite3")
    memory = SnapKVMemory.from_defaults(llm=llm, path=db, thread_id="long-log")
    memory.reset()
    print(f"agent memory: {db}; compression snapkv:budget={args.budget}")
    started = time.perf_counter()
    rows = asyncio.run(run_session(llm, memory, args.turns))
    stored = memory.get_all()
    tool_tokens = sum(llm.engine.count_tokens(str(m.content), chat=False) for m in stored if m.role.value == "tool")
    final = rows[-1]["text"].strip()
    later = [r for r in rows if r["turn"] > 1]
    reused = sum(r["reused_prompt_tokens"] or 0 for r in later) / max(1, sum(r["prompt_tokens"] for r in later))
    print(f"\nFinal answer: {final}")
    print(f"Expected (from part 1): {SECRET}; code E-4471 in the answer: {'E-4471' in final}")
    print(f"{len(stored)} messages stored verbatim; tool logs {tool_tokens} tokens in all vs SnapKV budget {args.budget}")
    print(f"prompt tokens reused from the prefix cache after turn 1: {reused:.0%}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
