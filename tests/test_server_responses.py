"""``POST /v1/responses`` driven by the official ``openai`` client: text, instructions, streaming events,
function tools (and their results sent back), structured output and the errors, each answer checked
against the engine called directly with the same chat messages (tiny random model, real SmolLM2 tokenizer)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import running, terse_bias, tiny_tool_engine
from pydantic import BaseModel

from snapkv_rag.server import ServerConfig

POLICY = "snapkv:budget=64"
MAGIC = {
    "type": "function",
    "name": "magic_function",
    "description": "Applies a magic function.",
    "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
}
CHAT_MAGIC = {"type": "function", "function": {k: v for k, v in MAGIC.items() if k != "type"}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}}, "required": ["city", "year"]}


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


@pytest.fixture(scope="module")
def base_url(engine):
    with running(ServerConfig(engine, model_id="tiny", compression=POLICY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_text_and_instructions_answer_as_the_engine_does(client, engine):
    response = client.responses.create(model="tiny", input="Say something.", instructions="Be brief.", max_output_tokens=8)
    direct = engine.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}], max_new_tokens=8, compression=POLICY)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == direct.text and response.output[0].type == "message"
    assert response.status == ("incomplete" if direct.finish_reason == "length" else "completed")
    assert response.usage.input_tokens == direct.usage.prompt_tokens and response.usage.output_tokens == direct.usage.completion_tokens
    assert response.model_extra["snapkv"]["compression"]["method"] == "snapkv"


def test_a_streamed_response_sends_its_events_in_order_and_the_same_text(client, engine):
    events = list(client.responses.create(model="tiny", input="Say something.", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == engine.generate([{"role": "user", "content": "Say something."}], max_new_tokens=8, compression=POLICY).text
    assert final.usage.output_tokens > 0 and "response.output_item.done" in kinds


def test_a_function_call_streams_its_arguments_before_it_is_done_and_its_result_goes_back(client, engine):
    messages = [{"role": "user", "content": "What is magic(3)?"}]
    response = client.responses.create(model="tiny", input=messages, tools=[MAGIC], tool_choice="required", max_output_tokens=40)
    direct = engine.generate(messages, tools=[CHAT_MAGIC], tool_choice="required", max_new_tokens=40, compression=POLICY)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "magic_function" and json.loads(call.arguments) == direct.tool_calls[0].arguments
    events = list(client.responses.create(model="tiny", input=messages, tools=[MAGIC], tool_choice="required", max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    first_delta = kinds.index("response.function_call_arguments.delta")
    assert first_delta < kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == direct.tool_calls[0].arguments
    history = [*messages, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
    answer = client.responses.create(model="tiny", input=history, tools=[MAGIC], tool_choice="none", max_output_tokens=6)
    chat = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
        },
    ]
    chat.append({"role": "tool", "tool_call_id": call.call_id, "content": "42"})
    assert answer.output_text == engine.generate(chat, tools=[CHAT_MAGIC], tool_choice="none", max_new_tokens=6, compression=POLICY).text


class Place(BaseModel):
    city: str
    year: int


def test_structured_output_follows_the_schema(client):
    text = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model="tiny", input="Where and when?", text=text, max_output_tokens=60)
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    parsed = client.responses.parse(model="tiny", input="Where and when?", text_format=Place, max_output_tokens=80)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Place)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"input": "hi", "messages": []}, "messages", "unrecognized_argument"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input", "unsupported_parameter"),
        ({"input": []}, "input", None),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", None),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", None),
        ({"input": "word " * 3000, "compression": "full"}, "input", "context_length_exceeded"),
    ],
)
def test_bad_requests_get_one_error_naming_the_responses_field(base_url, body, param, code):
    response = httpx.post(base_url + "/v1/responses", json={"model": "tiny", **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and error["code"] == code, error
