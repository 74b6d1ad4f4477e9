"""The four OpenAI clients hold one scripted conversation with the server on the embedded model:
a required tool call, its result sent back, a structured answer, and a streamed answer with usage.

The tiny-model tests (test_server_clients.py) check replies equal the engine's own; this one checks
that the real model, behind the real routes, keeps each client's contract end to end: the call names
the tool with arguments that parse, the tool result is accepted as the next turn, the structured
answer validates, and a stream ends with its usage.
"""

from __future__ import annotations

import json

import langchain_openai
import openai
import pytest
from conftest import running
from pydantic import BaseModel

from snapkv_rag.server import ServerConfig

pytestmark = pytest.mark.integration

TIMETABLE = "Harbor ferry timetable: the first ferry leaves Pier 2 at 6:40 a.m.; the last at 11:15 p.m."
QUESTION = "When does the first ferry leave? Use the timetable tool."
TOOL = {
    "type": "function",
    "function": {
        "name": "ferry_timetable",
        "description": "The harbor ferry timetable.",
        "parameters": {"type": "object", "properties": {"pier": {"type": "integer"}}, "required": ["pier"]},
    },
}


class Departure(BaseModel):
    pier: int
    time: str


def ferry_timetable(pier: int) -> str:
    """The harbor ferry timetable."""
    return TIMETABLE


@pytest.fixture(scope="module")
def base_url(embedded_engine):
    with running(ServerConfig(embedded_engine, model_id="smollm2", embedder=None)) as url:
        yield url + "/v1"


def _schema_format():
    return {"type": "json_schema", "json_schema": {"name": "Departure", "schema": Departure.model_json_schema()}}


def test_the_openai_sdk_chat_and_responses(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=[TOOL], tool_choice="required", max_tokens=48, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "ferry_timetable" and isinstance(json.loads(call.function.arguments)["pier"], int)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": TIMETABLE}]
    structured = client.chat.completions.create(model="smollm2", messages=messages, response_format=_schema_format(), max_tokens=48, temperature=0)
    Departure.model_validate_json(structured.choices[0].message.content)
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    responses_tool = {"type": "function", **TOOL["function"]}
    called = client.responses.create(model="smollm2", input=QUESTION, tools=[responses_tool], tool_choice="required", max_output_tokens=48)
    (function_call,) = [item for item in called.output if item.type == "function_call"]
    assert function_call.name == "ferry_timetable" and isinstance(json.loads(function_call.arguments)["pier"], int)
    follow_up = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": function_call.call_id, "name": function_call.name, "arguments": function_call.arguments},
        {"type": "function_call_output", "call_id": function_call.call_id, "output": TIMETABLE},
    ]
    answer = client.responses.create(
        model="smollm2",
        input=follow_up,
        text={"format": {"type": "json_schema", "name": "Departure", "schema": Departure.model_json_schema()}},
        max_output_tokens=48,
    )
    Departure.model_validate_json(answer.output_text)
    events = list(client.responses.create(model="smollm2", input=follow_up, max_output_tokens=32, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens > 0
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip()


@pytest.mark.parametrize("route", ["chat_openai", "init_chat_model"])
def test_langchain_clients(base_url, route):
    from langchain.chat_models import init_chat_model
    from langchain_core.messages import HumanMessage, ToolMessage

    options = dict(base_url=base_url, api_key="unused", max_tokens=48, temperature=0, max_retries=0, stream_usage=True)
    llm = langchain_openai.ChatOpenAI(model="smollm2", **options) if route == "chat_openai" else init_chat_model("openai:smollm2", **options)
    call = llm.bind_tools([ferry_timetable], tool_choice="required").invoke(QUESTION)
    (tool_call,) = call.tool_calls
    assert tool_call["name"] == "ferry_timetable" and isinstance(tool_call["args"]["pier"], int)
    history = [HumanMessage(QUESTION), call, ToolMessage(ferry_timetable(**tool_call["args"]), tool_call_id=tool_call["id"])]
    assert isinstance(llm.with_structured_output(Departure, method="json_schema").invoke(history), Departure)
    chunks = list(llm.stream(history))
    assert "".join(c.text for c in chunks).strip()
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks) > 0


def test_llamaindex_openai_like(base_url):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        api_base=base_url, api_key="unused", model="smollm2", is_chat_model=True, is_function_calling_model=True,
        max_tokens=48, temperature=0, context_window=8192, max_retries=0,
    )  # fmt: skip
    tool = FunctionTool.from_defaults(fn=ferry_timetable)
    response = llm.chat_with_tools([tool], user_msg=QUESTION, tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert selection.tool_name == "ferry_timetable" and isinstance(selection.tool_kwargs["pier"], int)
    history = [
        ChatMessage(role="user", content=QUESTION),
        response.message,
        ChatMessage(role="tool", content=ferry_timetable(**selection.tool_kwargs), additional_kwargs={"tool_call_id": selection.tool_id}),
    ]
    departure = llm.as_structured_llm(Departure).chat(history).raw
    assert isinstance(departure, Departure)
    streamed = list(llm.stream_chat(history))
    assert "".join(r.delta or "" for r in streamed).strip()
