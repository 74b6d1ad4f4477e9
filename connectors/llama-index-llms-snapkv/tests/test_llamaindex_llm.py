"""SnapKVLLM on tiny random models: every LLM method sync and async, streaming deltas,
metadata, callbacks, per-call compression, tool calls and structured output."""

from __future__ import annotations

import asyncio
import json

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.snapkv import SnapKVLLM
from llama_index.llms.snapkv.messages import to_engine_messages
from pydantic import BaseModel
from snapkv_root_conftest import terse_bias, tiny_tool_engine

from snapkv_rag.compression import DEFAULT_COMPRESSION
from snapkv_rag.errors import PromptTooLongError

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 12) + " What does the fox do?"


@pytest.fixture(scope="module")
def llm(engine):
    return SnapKVLLM(engine, max_new_tokens=6)


@pytest.fixture(scope="module")
def tool_llm(smollm_tokenizer):
    return SnapKVLLM(tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer)), max_new_tokens=60)


def magic(input: int) -> str:
    """Applies a magic function to an input."""
    return str(input * 7 + 1)


MAGIC = FunctionTool.from_defaults(fn=magic)
USER = [ChatMessage(role="user", content="What is magic(3)?")]


def test_metadata_tells_the_truth(engine):
    llm = SnapKVLLM(engine, max_new_tokens=32)
    meta = llm.metadata
    assert meta.context_window == engine.context_length == 512
    assert meta.num_output == 32 and meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == engine.name
    assert SnapKVLLM(engine, context_window=300).metadata.context_window == 300
    with pytest.raises(ValueError):
        SnapKVLLM(engine, context_window=10_000, compression="full")  # the full cache cannot read past the window
    assert SnapKVLLM(engine, context_window=10_000).metadata.context_window == 10_000  # the default rolls past it
    with pytest.raises(ValueError):
        SnapKVLLM(engine, compression="nonsense:budget=1")


def test_complete_and_chat_are_the_engines_greedy_outputs(llm, engine):
    expected = engine.generate("Hello world", max_new_tokens=6, compression=DEFAULT_COMPRESSION)
    r = llm.complete("Hello world")
    assert r.text == expected.text
    assert r.raw["usage"]["completion_tokens"] == expected.usage.completion_tokens
    assert r.additional_kwargs["prompt_tokens"] == expected.usage.prompt_tokens
    assert r.additional_kwargs["compression"] == expected.stats.compression  # default: the one default compression
    c = llm.chat([ChatMessage(role="user", content="Hello world")])
    assert c.message.role == MessageRole.ASSISTANT and c.message.content == expected.text
    assert c.raw["finish_reason"] == c.additional_kwargs["finish_reason"]


def test_per_call_compression_override_and_stats(engine):
    llm = SnapKVLLM(engine, compression="snapkv:budget=32,window=8", max_new_tokens=4)
    r = llm.complete(LONG)
    assert r.additional_kwargs["kept_tokens_per_layer"] == [32, 32]
    assert r.additional_kwargs["compression"]["method"] == "snapkv" and r.additional_kwargs["compression_ratio"] > 1
    full = llm.complete(LONG, compression=None)
    assert full.additional_kwargs["compression"] is None
    assert full.additional_kwargs["kept_tokens_per_layer"][0] == full.additional_kwargs["prompt_tokens"]
    other = llm.chat([ChatMessage(role="user", content=LONG)], compression="streamingllm:budget=24")
    assert other.additional_kwargs["kept_tokens_per_layer"] == [24, 24]


def test_kept_entries_in_fewer_bits_per_call(engine):
    llm = SnapKVLLM(engine, compression="snapkv:budget=200,window=8", max_new_tokens=4)
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 30) + " What does the fox do?"
    wide, narrow = llm.complete(prompt), llm.complete(prompt, compression="snapkv:budget=200,window=8,kv_bits=8")
    assert narrow.additional_kwargs["compression"]["kv_bits"] == 8
    assert narrow.additional_kwargs["kept_tokens_per_layer"] == wide.additional_kwargs["kept_tokens_per_layer"]
    assert narrow.additional_kwargs["prompt_kv_bytes_kept"] < wide.additional_kwargs["prompt_kv_bytes_kept"]


def test_stream_complete_and_stream_chat_deltas(llm, engine):
    expected = engine.generate("Hello world", max_new_tokens=6).text
    chunks = list(llm.stream_complete("Hello world"))
    assert "".join(c.delta for c in chunks) == expected and chunks[-1].text == expected
    assert chunks[-1].raw["stats"]["kept_tokens_per_layer"] and chunks[-1].delta == ""
    for earlier, later in zip(chunks, chunks[1:]):
        assert later.text.startswith(earlier.text)
    chat_chunks = list(llm.stream_chat([ChatMessage(role="user", content="Hello world")]))
    assert "".join(c.delta for c in chat_chunks) == expected
    assert chat_chunks[-1].message.content == expected and "kept_tokens_per_layer" in chat_chunks[-1].additional_kwargs


def test_async_methods(llm, engine):
    expected = engine.generate("Hello world", max_new_tokens=6).text
    messages = [ChatMessage(role="user", content="Hello world")]

    async def main():
        a = await llm.acomplete("Hello world")
        b = await llm.achat(messages)
        c = [x async for x in await llm.astream_complete("Hello world")]
        d = [x async for x in await llm.astream_chat(messages)]
        return a, b, c, d

    a, b, c, d = asyncio.run(main())
    assert a.text == b.message.content == expected
    assert "".join(x.delta for x in c) == expected and c[-1].raw["text"] == expected
    assert "".join(x.delta for x in d) == expected and d[-1].message.content == expected
    assert d[-1].additional_kwargs["completion_tokens"] == a.additional_kwargs["completion_tokens"]


def test_callbacks_fire_for_every_method(engine):
    handler = LlamaDebugHandler()
    llm = SnapKVLLM(engine, max_new_tokens=3, callback_manager=CallbackManager([handler]))
    messages = [ChatMessage(role="user", content="Hi")]
    llm.complete("Hi")
    llm.chat(messages)
    list(llm.stream_complete("Hi"))
    list(llm.stream_chat(messages))

    async def main():
        await llm.acomplete("Hi")
        await llm.achat(messages)
        [x async for x in await llm.astream_complete("Hi")]
        [x async for x in await llm.astream_chat(messages)]

    asyncio.run(main())
    pairs = handler.get_event_pairs(CBEventType.LLM)
    assert len(pairs) == 8 and all(len(p) == 2 for p in pairs)


def test_context_window_below_the_models_is_enforced(engine):
    llm = SnapKVLLM(engine, context_window=60, max_new_tokens=8)
    with pytest.raises(PromptTooLongError):
        llm.complete(LONG)
    assert llm.complete("Hi").text is not None


def test_context_window_above_the_models_needs_a_rolling_policy(engine):
    """A window larger than the model's is allowed when the compression rolls (the engine reads the
    prompt a chunk at a time); the prompt past the model's 512 tokens then answers."""
    rolling = "snapkv:budget=64,window=16,rolling=128"
    llm = SnapKVLLM(engine, compression=rolling, context_window=4000, max_new_tokens=4)
    assert llm.metadata.context_window == 4000
    prompt = "word " * 1500
    assert engine.count_tokens(prompt) > engine.context_length
    response = llm.complete(prompt)
    assert response.raw["stats"]["policy_stats"]["rolled_chunks"] > 1
    with pytest.raises(PromptTooLongError):
        llm.complete("word " * 5000)  # past its own context_window of 4000
    with pytest.raises(ValueError, match="rolling="):
        SnapKVLLM(engine, compression="full", context_window=4000)
    by_rule = SnapKVLLM(engine, compression="snapkv:budget=64,window=16", context_window=4000, max_new_tokens=4)  # no rolling= named
    assert by_rule.complete(prompt).raw["stats"]["policy_stats"]["rolled_chunks"] > 1


def test_messages_translate_tool_calls_and_tool_results():
    history = [
        ChatMessage(role="user", content="What is magic(3)?"),
        ChatMessage(role="assistant", blocks=[TextBlock(text=""), ToolCallBlock(tool_call_id="c1", tool_name="magic", tool_kwargs={"input": 3})]),
        ChatMessage(role="tool", content="22", additional_kwargs={"tool_call_id": "c1", "name": "magic"}),
        ChatMessage(
            role="assistant",
            content="",
            additional_kwargs={"tool_calls": [{"id": "c2", "type": "function", "function": {"name": "magic", "arguments": '{"input": 4}'}}]},
        ),
    ]
    out = to_engine_messages(history)
    assert out[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "magic", "arguments": {"input": 3}}}]
    assert out[2] == {"role": "tool", "content": "22", "tool_call_id": "c1", "name": "magic"}
    assert out[3]["tool_calls"][0]["function"]["arguments"] == '{"input": 4}'


def test_forced_tool_call_parses_into_tool_selections(tool_llm):
    response = tool_llm.chat_with_tools([MAGIC], chat_history=USER, tool_required=True)
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    (sel,) = tool_llm.get_tool_calls_from_response(response)
    assert sel.tool_name == "magic" and isinstance(sel.tool_kwargs, dict) and isinstance(sel.tool_kwargs["input"], int)
    assert sel.tool_id == response.raw["tool_calls"][0]["id"]
    named = tool_llm.chat_with_tools([MAGIC], chat_history=USER, tool_choice="magic")
    assert tool_llm.get_tool_calls_from_response(named)[0].tool_name == "magic"
    with pytest.raises(ValueError):
        tool_llm.get_tool_calls_from_response(tool_llm.chat(USER, max_new_tokens=3))
    assert tool_llm.get_tool_calls_from_response(tool_llm.chat(USER, max_new_tokens=3), error_on_no_tool_call=False) == []


def test_streamed_tool_call_partials_then_the_validated_call(tool_llm):
    chunks = list(tool_llm.stream_chat_with_tools([MAGIC], chat_history=USER, tool_required=True))
    partial = [tool_llm.get_tool_calls_from_response(c, error_on_no_tool_call=False) for c in chunks]
    assert any(p and p[0].tool_name == "magic" for p in partial[:-1])  # the name arrives before the end
    (final,) = partial[-1]
    assert final.tool_kwargs == chunks[-1].raw["tool_calls"][0]["arguments"]
    streamed_args = [b.tool_kwargs for b in chunks[-2].message.blocks if isinstance(b, ToolCallBlock)][0]
    assert json.loads(streamed_args) == final.tool_kwargs

    async def main():
        gen = await tool_llm.astream_chat_with_tools([MAGIC], chat_history=USER, tool_required=True)
        return [c async for c in gen]

    achunks = asyncio.run(main())
    assert tool_llm.get_tool_calls_from_response(achunks[-1])[0].tool_name == "magic"


def test_tool_result_round_trip_renders(tool_llm):
    call = tool_llm.chat_with_tools([MAGIC], chat_history=USER, tool_required=True)
    (sel,) = tool_llm.get_tool_calls_from_response(call)
    follow = [*USER, call.message, ChatMessage(role="tool", content=magic(**sel.tool_kwargs), additional_kwargs={"tool_call_id": sel.tool_id})]
    prompt = to_engine_messages(follow)
    rendered = tool_llm.engine.tokenizer.decode(
        __import__("snapkv_rag.engine.prompts", fromlist=["render_prompt"]).render_prompt(tool_llm.engine.tokenizer, prompt)
    )
    assert "<tool_response>" in rendered and magic(**sel.tool_kwargs) in rendered
    answer = tool_llm.chat_with_tools([MAGIC], chat_history=follow, tool_choice="none", max_new_tokens=4)
    assert answer.additional_kwargs["finish_reason"] in ("stop", "length")


class City(BaseModel):
    name: str
    population: int


def test_structured_predict_and_structured_llm_use_json_schema_decoding(tool_llm):
    prompt = PromptTemplate("Describe the city {city}.")
    city = tool_llm.structured_predict(City, prompt, city="Paris")
    assert isinstance(city, City)
    acity = asyncio.run(tool_llm.astructured_predict(City, prompt, city="Paris"))
    assert isinstance(acity, City)
    sllm = tool_llm.as_structured_llm(City)
    r = sllm.chat([ChatMessage(role="user", content="Describe Paris.")])
    assert isinstance(r.raw, City) and City.model_validate_json(r.message.content) == r.raw


def test_model_name_loads_through_the_shared_engine_cache(engine, monkeypatch):
    import llama_index.llms.snapkv.base as base

    asked = []
    monkeypatch.setattr(base, "shared_engine", lambda model, **options: asked.append((model, options)) or engine)
    a = SnapKVLLM(model="some/model", compression="snapkv:budget=64", prefix_cache_bytes=0)
    b = SnapKVLLM(model="some/model", dtype="float32")
    assert a.engine is b.engine is engine and a.model == "some/model"
    assert asked == [
        ("some/model", {"device": None, "dtype": None, "prefix_cache_bytes": 0}),
        ("some/model", {"device": None, "dtype": "float32", "prefix_cache_bytes": None}),
    ]
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        SnapKVLLM(engine, prefix_cache_bytes=1024)


@pytest.mark.parametrize("method", ["astream_chat", "astream_complete"])
def test_an_async_stream_left_early_stops_generating(engine, method):
    """A consumer that leaves an async stream after two chunks and closes it stops the engine."""
    llm = SnapKVLLM(engine, max_new_tokens=300)
    prompt = [ChatMessage(role="user", content="Hello world")] if method == "astream_chat" else "Hello world"
    forwards = []
    hook = engine.model.register_forward_hook(lambda *_: forwards.append(1))

    async def main():
        gen = await getattr(llm, method)(prompt, ignore_eos=True)
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 2:
                break
        await gen.aclose()  # LlamaIndex's callback wrapper closes ours when it is finalised: within a step
        at_exit = len(forwards)
        await asyncio.sleep(1.0)
        return at_exit

    try:
        at_exit = asyncio.run(main())
        assert len(forwards) <= at_exit + 2 and len(forwards) < 50  # 300 steps without the close
    finally:
        hook.remove()


def test_prompt_lookup_drafts_keep_the_greedy_text(engine):
    plain = SnapKVLLM(engine, max_new_tokens=16, generate_kwargs={"ignore_eos": True}).complete(LONG)
    drafted = SnapKVLLM(engine, max_new_tokens=16, prompt_lookup_num_tokens=4, generate_kwargs={"ignore_eos": True}).complete(LONG)
    assert drafted.text == plain.text
    assert drafted.raw["stats"]["drafts"]["prompt_lookup_num_tokens"] == 4
    with pytest.raises(ValueError):
        SnapKVLLM(engine, prompt_lookup_num_tokens=65)


def test_keep_context_lets_a_chats_next_turn_read_only_what_it_adds(engine):
    engine.kept_contexts.clear()
    llm = SnapKVLLM(engine, compression="expected:budget=32,window=8", keep_context=True, max_new_tokens=3)
    docs = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    first = llm.chat([ChatMessage(role="user", content=f"{docs}\n\nWhat does the fox do?")])
    assert first.additional_kwargs["context_reuse"] == "stored"
    turns = [
        ChatMessage(role="user", content=f"{docs}\n\nWhat does the fox do?"),
        ChatMessage(role="assistant", content=first.message.content),
        ChatMessage(role="user", content="And the dog?"),
    ]
    second = llm.chat(turns)
    assert second.additional_kwargs["context_reuse"] == "extended"
    assert second.additional_kwargs["reused_prompt_tokens"] > second.additional_kwargs["prompt_tokens"] // 2
