"""The long-history AgentWorkflow example (examples/long_log_agent.py), short, on a tiny random model."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from llama_index.llms.snapkv import SnapKVLLM, SnapKVMemory
from snapkv_root_conftest import terse_bias, tiny_tool_engine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "long_log_agent.py"


def _example():
    spec = importlib.util.spec_from_file_location("llamaindex_long_log_agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_workflow_keeps_every_tool_log_and_reuses_each_turns_prefix(smollm_tokenizer, tmp_path):
    example = _example()
    llm = SnapKVLLM(tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer)), max_new_tokens=60, compression="snapkv:budget=96")
    memory = SnapKVMemory.from_defaults(llm=llm, path=str(tmp_path / "agent.sqlite3"), thread_id="t")
    rows = asyncio.run(example.run_session(llm, memory, turns=3, echo=lambda *_: None))
    # turns 1-2: the forced read_log call, then an answer under "auto"; turn 3: an answer
    assert [(r["turn"], r["tool_call"] is not None) for r in rows][:2] == [(1, True), (1, False)]
    assert [r["turn"] for r in rows if r["tool_call"]] == [1, 2]
    assert all(r["tool_call"]["name"] == "read_log" for r in rows if r["tool_call"])
    stored = memory.get_all()
    tool_messages = [str(m.content) for m in stored if m.role.value == "tool"]
    assert tool_messages == [example.read_log(r["tool_call"]["args"]["part"]) for r in rows if r["tool_call"]]  # verbatim
    # each call's prompt starts with the previous call's, so from turn 2 on (where the history
    # is most of the prompt) it comes from the cache
    assert rows[0]["reused_prompt_tokens"] == 0
    later = [r for r in rows if r["turn"] > 1]
    assert later and all(r["reused_prompt_tokens"] > 0.5 * r["prompt_tokens"] for r in later)
    prompts = [r["prompt_tokens"] for r in rows]
    assert prompts == sorted(prompts) and prompts[-1] > 96 and rows[-1]["kept_tokens"] == 96
