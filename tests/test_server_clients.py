"""LangChain's ChatOpenAI and LlamaIndex's OpenAILike, unchanged, against ``snapkv-rag serve``.

The README says both work by pointing their base URL at the server; these tests hold it to
that on a tiny random model (the grammar makes its tool calls and JSON valid): plain and
streamed replies equal the engine's own, tool calls and structured output parse.
"""

from __future__ import annotations

import asyncio

import langchain_openai
import pytest
from conftest import running, terse_bias, tiny_tool_engine
from llama_index.llms import openai_like
from pydantic import BaseModel

from snapkv_rag.server import ServerConfig

COMPRESSION = "snapkv:budget=64"
QUESTION = " ".join(f"Note {i}: the tide table for pier {i} is posted at noon." for i in range(20)) + " When is the tide table posted?"


def magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input + 2


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


@pytest.fixture(scope="module")
def base_url(engine):
    with running(ServerConfig(engine, model_id="tiny", compression=COMPRESSION, embedder=None)) as url:
        yield url + "/v1"


def test_langchain_chat_openai(base_url, engine):
    llm = langchain_openai.ChatOpenAI(base_url=base_url, api_key="unused", model="tiny", max_tokens=16, temperature=0, max_retries=0)
    direct = engine.generate([{"role": "user", "content": QUESTION}], max_new_tokens=16, compression=COMPRESSION)
    reply = llm.invoke(QUESTION)
    assert reply.content == direct.text and reply.usage_metadata["input_tokens"] == direct.usage.prompt_tokens
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == direct.text
    assert asyncio.run(llm.ainvoke(QUESTION)).content == direct.text
    call = llm.bind_tools([magic_function], tool_choice="required").bind(max_tokens=80).invoke("What is magic_function(3)?")
    assert [c["name"] for c in call.tool_calls] == ["magic_function"] and isinstance(call.tool_calls[0]["args"]["input"], int)
    for method in ("json_schema", "function_calling"):  # json_mode asks for any object, not this schema
        city = llm.with_structured_output(City, method=method).bind(max_tokens=80).invoke("Describe Paris.")
        assert isinstance(city, City), method


def test_llamaindex_openai_like(base_url, engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    llm = openai_like.OpenAILike(
        api_base=base_url,
        api_key="unused",
        model="tiny",
        is_chat_model=True,
        is_function_calling_model=True,
        max_tokens=16,
        temperature=0,
        context_window=2048,
        max_retries=0,
    )
    direct = engine.generate([{"role": "user", "content": QUESTION}], max_new_tokens=16, temperature=0.0, compression=COMPRESSION)
    messages = [ChatMessage(role="user", content=QUESTION)]
    assert llm.chat(messages).message.content == direct.text
    assert "".join(r.delta or "" for r in llm.stream_chat(messages)) == direct.text
    llm.max_tokens = 80  # room for the call
    response = llm.chat_with_tools([FunctionTool.from_defaults(fn=magic_function)], user_msg="What is magic_function(3)?", tool_required=True)
    calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert [c.tool_name for c in calls] == ["magic_function"] and isinstance(calls[0].tool_kwargs["input"], int)


def test_langchain_init_chat_model_and_the_responses_api(base_url, engine):
    """init_chat_model with a base URL, usage in streams, and ChatOpenAI over POST /v1/responses."""
    from langchain.chat_models import init_chat_model

    direct = engine.generate([{"role": "user", "content": QUESTION}], max_new_tokens=16, compression=COMPRESSION)
    llm = init_chat_model("openai:tiny", base_url=base_url, api_key="unused", max_tokens=16, temperature=0, max_retries=0, stream_usage=True)
    chunks = list(llm.stream(QUESTION))
    assert "".join(c.content for c in chunks) == direct.text
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks) == direct.usage.completion_tokens
    responses = langchain_openai.ChatOpenAI(
        base_url=base_url, api_key="unused", model="tiny", max_tokens=16, temperature=0, max_retries=0, use_responses_api=True
    )
    reply = responses.invoke(QUESTION)
    assert reply.text == direct.text and reply.usage_metadata["output_tokens"] == direct.usage.completion_tokens
    assert "".join(c.text for c in responses.stream(QUESTION)) == direct.text
    roomy = responses.model_copy(update={"max_tokens": 80})  # room for a call or an object
    call = roomy.bind_tools([magic_function], tool_choice="required").invoke("What is magic_function(3)?")
    assert [c["name"] for c in call.tool_calls] == ["magic_function"] and isinstance(call.tool_calls[0]["args"]["input"], int)
    city = roomy.with_structured_output(City, method="json_schema").invoke("Describe Paris.")
    assert isinstance(city, City)
