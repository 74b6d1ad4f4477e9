"""ChatSnapKV on tiny random engines: messages, metadata, streams, async, tools, structured output."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel, Field

from langchain_snapkv import ChatSnapKV, from_engine_messages, to_engine_messages

LONG = " ".join(f"Fact {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


def test_message_translation_round_trip():
    msgs = [
        SystemMessage("be brief"),
        HumanMessage([{"type": "text", "text": "add "}, "1 and 2"]),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="c1", name="add"),
        AIMessage([{"type": "text", "text": "It is 3."}, {"type": "tool_use", "id": "x", "name": "add", "input": {}}]),
    ]
    dicts = to_engine_messages(msgs)
    assert dicts[1] == {"role": "user", "content": "add 1 and 2"}
    assert dicts[2]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert dicts[3] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert dicts[4] == {"role": "assistant", "content": "It is 3."}
    back = from_engine_messages(dicts)
    assert back[2].tool_calls[0]["args"] == {"a": 1, "b": 2} and back[3].tool_call_id == "c1"
    with pytest.raises(ValueError, match="image"):
        to_engine_messages([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])


def test_invalid_compression_fails_at_construction(tiny_engine):
    # pydantic wraps the engine's InvalidCompressionError (a ValueError) in a ValidationError
    with pytest.raises(ValueError, match="budget must be an integer"):
        ChatSnapKV(engine=tiny_engine, compression="snapkv:budget=-3")
    with pytest.raises(TypeError, match="snapkv_rag.Engine"):
        ChatSnapKV(engine=object())


def test_invoke_carries_usage_and_compression_stats(tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=8, compression="snapkv:budget=64,window=8")
    msg = llm.invoke(LONG)
    assert isinstance(msg, AIMessage) and msg.response_metadata["finish_reason"] in ("stop", "length")
    usage = msg.usage_metadata
    assert usage["input_tokens"] > 64 and usage["output_tokens"] <= 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = msg.response_metadata
    assert meta["model_name"] == "tiny-llama" and meta["model_provider"] == "snapkv"
    assert meta["compression"]["method"] == "snapkv" and meta["kept_tokens"] == 64
    assert meta["compression_ratio"] > 1 and meta["prefill_seconds"] >= 0
    assert meta["prompt_tokens"] == usage["input_tokens"]
    # Per-call override of compression (and of the sampling fields).
    full = llm.invoke(LONG, compression="full", max_tokens=3)
    assert full.response_metadata["compression"] is None
    assert full.response_metadata["kept_tokens"] == full.usage_metadata["input_tokens"]
    assert full.usage_metadata["output_tokens"] <= 3
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.invoke("hi", bogus=1)


def test_stream_matches_invoke_and_ends_with_usage(tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=12, compression=None)
    expected = llm.invoke("Hello world")
    chunks = list(llm.stream("Hello world"))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata is not None
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == expected.content
    # The same prompt a second time reuses more of it from the engine's prefix cache.
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert {k: full.usage_metadata[k] for k in counts} == {k: expected.usage_metadata[k] for k in counts}
    assert full.usage_metadata["input_token_details"]["cache_read"] > expected.usage_metadata["input_token_details"]["cache_read"]
    assert full.response_metadata["finish_reason"] == expected.response_metadata["finish_reason"]


async def test_async_paths_match_sync(tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=10, compression="snapkv:budget=64")
    expected = llm.invoke(LONG)
    got = await llm.ainvoke(LONG)
    assert got.content == expected.content and got.usage_metadata == expected.usage_metadata
    chunks = [c async for c in llm.astream(LONG)]
    assert chunks[-1].chunk_position == "last"
    assert "".join(c.content for c in chunks) == expected.content
    assert chunks[-1].response_metadata["kept_tokens"] == 64


def test_stop_sequences_from_field_and_call(tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=30, compression=None, temperature=0)
    text = llm.invoke("Hello").content
    if len(text) > 4:
        stop = text[2:4]
        assert stop not in llm.invoke("Hello", stop=[stop]).content
        assert stop not in ChatSnapKV(engine=tiny_engine, max_tokens=30, compression=None, stop=[stop]).invoke("Hello").content


def test_ls_params_and_model_override(tiny_engine, monkeypatch):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=5, stop=["x"], temperature=0.5)
    assert llm._get_ls_params() == {
        "ls_provider": "snapkv",
        "ls_model_name": "tiny-llama",
        "ls_model_type": "chat",
        "ls_temperature": 0.5,
        "ls_max_tokens": 5,
        "ls_stop": ["x"],
    }
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"
    import snapkv_rag.engine.shared as shared

    monkeypatch.setattr(shared, "shared_engine", lambda model, **kw: tiny_engine)
    assert llm.invoke("hi", model="elsewhere").response_metadata["model_name"] == "tiny-llama"


def test_engines_by_name_are_shared(tiny_engine, monkeypatch):
    from snapkv_rag import Engine
    from snapkv_rag.engine import shared

    loads = []

    def load(model, **kwargs):
        loads.append((model, kwargs))
        return tiny_engine

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(load))
    shared.clear_shared_engines()
    a, b = ChatSnapKV(model="some/model", max_tokens=2), ChatSnapKV(model="some/model", temperature=0.3)
    assert loads == []  # nothing loads at construction
    assert a.client is b.client is tiny_engine and len(loads) == 1
    _ = ChatSnapKV(model="some/model", prefix_cache_bytes=0).client  # the property loads the engine
    assert loads[-1] == ("some/model", {"device": None, "dtype": None, "prefix_cache_bytes": 0})
    shared.clear_shared_engines()


# ----------------------------------------------------------------------------- tools and structured output
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the name")
    age: int


def test_bind_tools_forced_call_matches_schema(tool_engine):
    llm = ChatSnapKV(engine=tool_engine, max_tokens=60, compression=None)
    msg = llm.bind_tools([multiply], tool_choice="any").invoke("What is 6 times 7?")
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    (call,) = msg.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values()) and call["id"]
    # By name, and streamed as tool_call_chunks that aggregate into the same kind of call.
    chunks = list(llm.bind_tools([multiply, Person], tool_choice="Person").stream("Who?"))
    assert any(c.tool_call_chunks for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    (streamed,) = full.tool_calls
    assert streamed["name"] == "Person" and set(streamed["args"]) == {"name", "age"}
    Person(**streamed["args"])


def test_tool_conversation_renders(tool_engine):
    llm = ChatSnapKV(engine=tool_engine, max_tokens=5, compression=None).bind_tools([multiply], tool_choice="none")
    msgs = [
        HumanMessage("6 times 7?"),
        AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("42", tool_call_id="c1"),
    ]
    msg = llm.invoke(msgs)
    assert not msg.tool_calls and msg.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_pydantic(tool_engine, method):
    llm = ChatSnapKV(engine=tool_engine, max_tokens=60, compression=None)
    structured = llm.with_structured_output(Person, method=method)
    assert isinstance(structured.invoke("Describe someone."), Person)
    last = None
    for last in structured.stream("Describe someone."):
        assert isinstance(last, Person)
    assert last is not None


def test_structured_output_dict_schema_include_raw_and_json_mode(tool_engine):
    llm = ChatSnapKV(engine=tool_engine, max_tokens=60, compression=None)
    schema = {
        "title": "city",
        "description": "A city.",
        "type": "object",
        "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
        "required": ["name", "size"],
    }
    out = llm.with_structured_output(schema, include_raw=True).invoke("A city?")
    assert set(out) == {"raw", "parsed", "parsing_error"} and out["parsing_error"] is None
    assert set(out["parsed"]) == {"name", "size"} and isinstance(out["raw"], AIMessage)
    assert json.loads(out["raw"].content) == out["parsed"]
    free = llm.with_structured_output(method="json_mode").invoke("Any JSON object.")
    assert isinstance(free, dict)
    with pytest.raises(ValueError, match="needs a schema"):
        llm.with_structured_output(None)


async def test_an_async_stream_left_early_stops_generating(tiny_engine):
    """A consumer that leaves ``astream`` after two chunks (and closes it, as ``async with``
    or ``aclosing`` do) stops the engine: no decode step runs after it."""
    import asyncio
    from contextlib import aclosing

    llm = ChatSnapKV(engine=tiny_engine, max_tokens=250)
    forwards = []
    hook = tiny_engine.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        async with aclosing(llm.astream(LONG, ignore_eos=True)) as chunks:
            seen = 0
            async for _ in chunks:
                seen += 1
                if seen == 2:
                    break
        at_exit = len(forwards)
        await asyncio.sleep(1.0)
        # the cancel lands at the next step boundary: a step already running may finish; 250 without the close
        assert len(forwards) <= at_exit + 2 and len(forwards) < 50
    finally:
        hook.remove()


def test_prompt_lookup_drafts_keep_the_greedy_reply(tiny_engine):
    plain = ChatSnapKV(engine=tiny_engine, max_tokens=24, compression="full").invoke(LONG, ignore_eos=True)
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=24, compression="full", prompt_lookup_num_tokens=4)
    drafted = llm.invoke(LONG, ignore_eos=True)
    assert drafted.content == plain.content
    assert drafted.response_metadata["snapkv_stats"]["drafts"]["prompt_lookup_num_tokens"] == 4
    assert plain.response_metadata["snapkv_stats"]["drafts"] is None
    per_call = llm.invoke(LONG, ignore_eos=True, prompt_lookup_num_tokens=2)
    assert per_call.content == plain.content and per_call.response_metadata["snapkv_stats"]["drafts"]["prompt_lookup_num_tokens"] == 2


def test_keep_context_asks_follow_ups_of_one_kept_context(tiny_engine):
    tiny_engine.kept_contexts.clear()
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=3, compression="expected:budget=32,window=8", keep_context=True)
    first = llm.invoke(f"{LONG}\n\nWhat does fact 3 say?")
    second = llm.invoke(f"{LONG}\n\nWhat does fact 7 say?")
    assert (first.response_metadata["context_reuse"], second.response_metadata["context_reuse"]) == ("stored", "reused")
    assert second.response_metadata["reused_prompt_tokens"] > second.usage_metadata["input_tokens"] // 2
