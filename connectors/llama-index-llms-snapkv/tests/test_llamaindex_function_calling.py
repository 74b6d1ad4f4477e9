"""SnapKVLLM as llama-index-core 0.14 drives a FunctionCallingLLM: ``tool_required``, ``tool_choice``
through ``FunctionCallingProgram``, structured outputs (whole and streamed) and FunctionAgent.

A tiny random model writes garbage text; the engine's grammar still guarantees the structure
(a call to an offered tool with schema-valid arguments, JSON that validates), which is what these check.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.llms.function_calling import _supports_tool_required
from llama_index.core.program import FunctionCallingProgram
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.core.types import PydanticProgramMode
from llama_index.llms.snapkv import SnapKVLLM
from pydantic import BaseModel
from snapkv_root_conftest import terse_bias, tiny_tool_engine


class City(BaseModel):
    name: str
    population: int


def magic(input: int) -> str:
    """Applies a magic function to an input."""
    return str(input * 7 + 1)


MAGIC = FunctionTool.from_defaults(fn=magic)
USER = [ChatMessage(role="user", content="What is magic(3)?")]
CITY_PROMPT = PromptTemplate("Describe the city {city}.")


@pytest.fixture(scope="module")
def llm(smollm_tokenizer):
    return SnapKVLLM(tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer)), max_new_tokens=60)


@pytest.fixture
def engine_options(llm, monkeypatch):
    """The options of every engine call the test makes (the calls themselves still run)."""
    seen: list[dict] = []
    for method in ("generate", "stream", "agenerate", "astream"):
        real = getattr(llm.engine, method)

        def spy(prompt, _real=real, **options):
            seen.append(options)
            return _real(prompt, **options)

        monkeypatch.setattr(llm.engine, method, spy)
    return seen


def test_tool_required_is_declared_so_core_neither_drops_it_nor_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="llama_index.core.llms.function_calling"):
        assert _supports_tool_required(SnapKVLLM, True)
    assert not caplog.records


@pytest.mark.parametrize("tool_choice", [None, "auto", "any", "required"])
def test_tool_required_forces_a_call_through_the_grammar(llm, engine_options, tool_choice):
    response = llm.chat_with_tools([MAGIC], chat_history=USER, tool_required=True, tool_choice=tool_choice)
    assert engine_options[-1]["tool_choice"] == "required"
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "magic" and isinstance(call.tool_kwargs["input"], int)


def test_a_plain_function_is_a_tool(llm):
    response = llm.chat_with_tools([magic], chat_history=USER, tool_required=True)
    assert llm.get_tool_calls_from_response(response)[0].tool_name == "magic"


def test_tool_required_contradicting_tool_choice_none_is_refused(llm):
    with pytest.raises(ValueError, match="tool_required"):
        llm.chat_with_tools([MAGIC], chat_history=USER, tool_required=True, tool_choice="none")


def test_without_tool_required_auto_stays_auto(llm, engine_options):
    llm.chat_with_tools([MAGIC], chat_history=USER, max_new_tokens=4)
    assert engine_options[-1]["tool_choice"] == "auto"


def test_get_tool_calls_from_response_without_a_call(llm):
    answer = llm.chat_with_tools([MAGIC], chat_history=USER, tool_choice="none", max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one tool call"):
        llm.get_tool_calls_from_response(answer)
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []


def test_function_calling_program_passes_its_tool_choice(llm, engine_options):
    program = FunctionCallingProgram.from_defaults(output_cls=City, prompt=CITY_PROMPT, llm=llm, tool_choice="City")
    assert isinstance(program(city="Paris"), City)
    assert engine_options[-1]["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    assert isinstance(asyncio.run(program.acall(city="Paris")), City)


def test_function_calling_program_streams_partial_objects_then_the_object(llm, engine_options):
    program = FunctionCallingProgram.from_defaults(output_cls=City, prompt=CITY_PROMPT, llm=llm, tool_choice="required")
    objects = list(program.stream_call(city="Paris"))
    assert engine_options[-1]["tool_choice"] == "required"
    assert len(objects) > 1 and isinstance(objects[-1], City)


def test_structured_predict_decodes_under_the_json_schema(llm, engine_options):
    city = llm.structured_predict(City, CITY_PROMPT, city="Paris")
    assert isinstance(city, City)
    assert engine_options[-1]["response_format"]["json_schema"]["schema"] == City.model_json_schema()
    assert "tools" not in engine_options[-1]
    assert isinstance(asyncio.run(llm.astructured_predict(City, CITY_PROMPT, city="Paris")), City)


def test_another_program_mode_is_honoured(llm, engine_options):
    by_tool = SnapKVLLM(llm.engine, max_new_tokens=60, pydantic_program_mode=PydanticProgramMode.FUNCTION)
    assert isinstance(by_tool.structured_predict(City, CITY_PROMPT, city="Paris"), City)
    assert engine_options[-1]["tools"][0]["function"]["name"] == "City" and "response_format" not in engine_options[-1]


def test_stream_structured_predict_yields_partials_then_a_valid_object(llm, engine_options):
    streamed = list(llm.stream_structured_predict(City, CITY_PROMPT, city="Paris"))
    assert engine_options[-1]["response_format"]["json_schema"]["name"] == "City" and "tools" not in engine_options[-1]
    assert isinstance(streamed[-1], City)
    assert any(o.name is not None and o.population is None for o in streamed)  # a field arrives before the object ends
    assert streamed[-1] == llm.structured_predict(City, CITY_PROMPT, city="Paris")  # greedy: the same object

    async def collect():
        return [obj async for obj in await llm.astream_structured_predict(City, CITY_PROMPT, city="Paris")]

    assert asyncio.run(collect())[-1] == streamed[-1]


def test_structured_llm_chats_and_streams_schema_valid_json(llm):
    sllm = llm.as_structured_llm(City)
    ask = [ChatMessage(role="user", content="Describe Paris.")]
    whole = sllm.chat(ask)
    assert isinstance(whole.raw, City) and City.model_validate_json(whole.message.content) == whole.raw
    chunks = list(sllm.stream_chat(ask))
    assert isinstance(chunks[-1].raw, City) and City.model_validate_json(chunks[-1].message.content) == chunks[-1].raw

    async def astream():
        return [c async for c in await sllm.astream_chat(ask)]

    assert isinstance(asyncio.run(astream())[-1].raw, City)


def _run_agent(agent: FunctionAgent, question: str):
    async def run():
        handler = agent.run(question)
        calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        return await handler, calls

    return asyncio.run(run())


@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_calls_its_tool_with_valid_arguments(llm, streaming):
    agent = FunctionAgent(tools=[MAGIC], llm=llm, initial_tool_choice="magic", streaming=streaming)
    result, calls = _run_agent(agent, "What is magic(3)?")
    assert calls and calls[0].tool_name == "magic" and not calls[0].tool_output.is_error
    assert calls[0].tool_output.content == magic(**calls[0].tool_kwargs)
    assert result.tool_calls[0].tool_name == "magic"


def test_function_agent_structured_response_validates(llm):
    agent = FunctionAgent(tools=[MAGIC], llm=llm, initial_tool_choice="magic", output_cls=City)
    result, _ = _run_agent(agent, "What is magic(3)? Then name a city.")
    assert City.model_validate(result.structured_response)
