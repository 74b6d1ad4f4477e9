"""create_agent(ChatSnapKV(...)) over the core agent memory, on a tiny random model (the example's session)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from langchain_core.messages import AIMessage, ToolMessage

from langchain_snapkv import ChatSnapKV, SnapKVChatMessageHistory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_log_agent.py"


def _example():
    spec = importlib.util.spec_from_file_location("long_log_agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_session_keeps_every_tool_log_and_compresses(tool_engine, tmp_path):
    example = _example()
    llm = ChatSnapKV(engine=tool_engine, max_tokens=40, compression="snapkv:budget=96")
    history = SnapKVChatMessageHistory(str(tmp_path / "agent.sqlite3"), "t")
    rows = example.run_session(llm, history, turns=3, echo=lambda *_: None)
    # Turns 1-2: a forced read_log call, then an answer with tool_choice="none"; turn 3: an answer.
    assert [(r["turn"], bool(r["tool_calls"])) for r in rows] == [(1, True), (1, False), (2, True), (2, False), (3, False)]
    assert all(r["tool_calls"][0]["name"] == "read_log" for r in rows if r["tool_calls"])
    messages = history.messages
    tools = [m for m in messages if isinstance(m, ToolMessage)]
    calls = [m.tool_calls[0] for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    assert [t.content for t in tools] == [example.read_log(c["args"]["part"]) for c in calls]  # verbatim
    assert [t.tool_call_id for t in tools] == [c["id"] for c in calls]
    # The prompt grows turn by turn, past the budget, and SnapKV keeps 96 entries per layer.
    prompts = [r["prompt_tokens"] for r in rows]
    assert prompts == sorted(prompts) and prompts[-1] > 96
    assert rows[-1]["kept_tokens"] == 96 and rows[-1]["compression_ratio"] > 1
