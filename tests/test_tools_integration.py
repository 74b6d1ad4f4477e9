"""Tool calling on the real embedded SmolLM2-135M-Instruct (its template has no tool support,
so the fallback format is rendered and the call is constrained by the grammar)."""

from __future__ import annotations

import json

import pytest

from snapkv_rag import ToolCallDelta

pytestmark = pytest.mark.integration

MAGIC = {
    "type": "function",
    "function": {
        "name": "magic_function",
        "description": "Applies a magic function to an input.",
        "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the value of magic_function(3)?"}]


def test_required_call_then_answer_from_the_tool_result(embedded_engine):
    result = embedded_engine.generate(QUESTION, tools=[MAGIC], tool_choice="required", max_new_tokens=40)
    assert result.finish_reason == "tool_calls"
    (call,) = result.tool_calls
    assert call.name == "magic_function" and call.arguments == {"input": 3}

    follow_up = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call.id, "content": "22"},
    ]
    answer = embedded_engine.generate(follow_up, tools=[MAGIC], tool_choice="auto", max_new_tokens=40)
    assert answer.tool_calls == [] and answer.finish_reason == "stop"
    assert "22" in answer.text


def test_streamed_call_matches_and_json_output_parses(embedded_engine):
    stream = embedded_engine.stream(QUESTION, tools=[MAGIC], tool_choice="required", max_new_tokens=40)
    deltas = [p for p in stream if isinstance(p, ToolCallDelta)]
    assert deltas[0].name == "magic_function" and deltas[0].id == stream.result.tool_calls[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == {"input": 3}

    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "capital",
            "strict": True,
            "schema": {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}, "required": ["country", "capital"]},
        },
    }
    result = embedded_engine.generate("What is the capital of France? Answer in JSON.", response_format=fmt, max_new_tokens=40)
    assert set(result.parsed) == {"country", "capital"} and "Paris" in result.parsed["capital"]
