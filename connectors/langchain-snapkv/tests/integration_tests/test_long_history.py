"""The long-history create_agent example (examples/long_log_agent.py), 3 turns on the embedded model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from langchain_snapkv import ChatSnapKV, SnapKVChatMessageHistory

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_log_agent.py"


def test_create_agent_reads_each_part_and_reuses_each_kind_of_calls_prefix(tmp_path):
    spec = importlib.util.spec_from_file_location("langchain_long_log_agent_embedded", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    llm = ChatSnapKV(model="default", max_tokens=40, compression="snapkv:budget=512")
    history = SnapKVChatMessageHistory(str(tmp_path / "agent.sqlite3"), "long-log")
    rows = example.run_session(llm, history, turns=3, echo=lambda *_: None)
    calls = [r["tool_calls"][0] for r in rows if r["tool_calls"]]
    assert [(c["name"], c["args"]) for c in calls] == [("read_log", {"part": 1}), ("read_log", {"part": 2})]  # the model's arguments
    assert all(r["text"].strip() for r in rows if not r["tool_calls"])
    stored = history.messages
    assert [m.content for m in stored if isinstance(m, ToolMessage)] == [example.read_log(1), example.read_log(2)]
    assert sum(isinstance(m, AIMessage) for m in stored) == len(rows)
    # each call starts with the previous call of its kind (tool_choice="none" leaves the tools out of
    # the answering calls' prompts); the cache reuses a stored prompt once it is half the new one
    answers = [r for r in rows if r["turn"] < 3 and not r["tool_calls"]]
    assert answers[1]["reused_prompt_tokens"] == answers[0]["prompt_tokens"]
    assert rows[-1]["reused_prompt_tokens"] == rows[-3]["prompt_tokens"]  # turn 3 (tools listed) after turn 2's call
