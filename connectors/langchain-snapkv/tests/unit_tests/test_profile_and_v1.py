"""ChatSnapKV as langchain-core 1.x reads a chat model: its profile, v1 content blocks, tool-call
arguments streamed as the constrained decoder writes them, and usage in streams."""

from __future__ import annotations

import json
import threading

from langchain_core.messages import AIMessage

from langchain_snapkv import ChatSnapKV


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def _aggregate(chunks):
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    return full


def test_profile_reports_the_engine_window_and_what_it_supports(tiny_engine):
    profile = ChatSnapKV(engine=tiny_engine).profile
    assert profile["max_input_tokens"] == profile["max_output_tokens"] == tiny_engine.context_length
    assert profile["tool_calling"] and profile["tool_choice"] and profile["tool_call_streaming"]
    assert profile["structured_output"] and profile["text_inputs"] and profile["text_outputs"]
    assert not (profile["image_inputs"] or profile["pdf_inputs"] or profile["audio_inputs"] or profile["reasoning_output"])
    assert profile["name"] == "tiny-llama"


def test_a_model_by_name_gets_its_window_when_it_loads_and_a_given_profile_stays(tiny_engine, monkeypatch):
    from snapkv_rag import Engine
    from snapkv_rag.engine import shared

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda model, **kwargs: tiny_engine))
    shared.clear_shared_engines()
    try:
        llm = ChatSnapKV(model="some/model")
        assert llm.profile["tool_calling"] and "max_input_tokens" not in llm.profile  # not on this machine, nothing loaded yet
        _ = llm.client
        assert llm.profile["max_input_tokens"] == tiny_engine.context_length
        given = ChatSnapKV(model="some/model", profile={"max_input_tokens": 100})
        _ = given.client
        assert given.profile == {"max_input_tokens": 100}
    finally:
        shared.clear_shared_engines()


def test_a_model_directory_shows_its_window_before_anything_loads(tmp_path, monkeypatch):
    """Middleware that budgets by the profile (summarization at a fraction of max_input_tokens)
    reads it when it is created, before the first call would load the engine."""
    from snapkv_rag import Engine
    from snapkv_rag.testing import tiny_config

    config = tiny_config("llama", 64, context=777)
    config.save_pretrained(tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("the profile must not load the model")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(no_loading))
    llm = ChatSnapKV(model=str(tmp_path))
    assert llm.profile["max_input_tokens"] == llm.profile["max_output_tokens"] == 777
    from langchain.agents.middleware import SummarizationMiddleware

    SummarizationMiddleware(model=llm, trigger=("fraction", 0.8), keep=("fraction", 0.3))  # raises without the limits


def test_v1_output_has_tool_call_blocks_and_the_provider(tool_engine):
    llm = ChatSnapKV(engine=tool_engine, max_tokens=60, compression=None, output_version="v1").bind_tools([multiply], tool_choice="any")
    msg = llm.invoke("What is 6 times 7?")
    assert isinstance(msg, AIMessage) and isinstance(msg.content, list)
    (block,) = [b for b in msg.content if b["type"] == "tool_call"]
    assert block["name"] == "multiply" and block["args"] == msg.tool_calls[0]["args"] and block["id"] == msg.tool_calls[0]["id"]
    assert msg.response_metadata["model_provider"] == "snapkv" and msg.response_metadata["output_version"] == "v1"
    chunks = list(llm.stream("What is 6 times 7?"))
    assert all(c.response_metadata["model_provider"] == "snapkv" for c in chunks)
    assert any(b["type"] == "tool_call_chunk" for c in chunks for b in c.content)
    full = _aggregate(chunks)
    assert [b["args"] for b in full.content_blocks if b["type"] == "tool_call"] == [full.tool_calls[0]["args"]]
    assert full.usage_metadata["output_tokens"] > 0 and full.response_metadata["model_provider"] == "snapkv"


def test_tool_call_arguments_reach_the_stream_before_the_call_is_complete(tool_engine, monkeypatch):
    """The decoder is held at its step after the first argument characters, until the LangChain
    consumer has them: a stream that held tool calls back until they were complete would see
    them only after the call closed (the wait's timeout only keeps such a stream from hanging)."""
    from snapkv_rag.tools import ToolCallDelta, ToolCallStream

    feed = ToolCallStream.feed
    streams: list[ToolCallStream] = []
    consumer_has_args = threading.Event()

    def held_feed(self, piece):
        if streams and streams[0] is self and not consumer_has_args.is_set():
            consumer_has_args.wait(timeout=20)
            consumer_has_args.set()  # held once
        out = feed(self, piece)
        if not streams and any(isinstance(e, ToolCallDelta) and e.arguments for e in out):
            streams.append(self)  # the next step waits for the consumer
        return out

    monkeypatch.setattr(ToolCallStream, "feed", held_feed)
    llm = ChatSnapKV(engine=tool_engine, max_tokens=60, compression=None).bind_tools([multiply], tool_choice="any")
    chunks, calls_complete_at_first_args = [], None
    for chunk in llm.stream("What is 6 times 7?"):
        chunks.append(chunk)
        if calls_complete_at_first_args is None and any(part["args"] for part in chunk.tool_call_chunks):
            calls_complete_at_first_args = streams[0].completed
            consumer_has_args.set()
    assert calls_complete_at_first_args == 0
    first = next(part["args"] for c in chunks for part in c.tool_call_chunks if part["args"])
    (call,) = _aggregate(chunks).tool_calls
    whole = json.dumps(call["args"])
    assert call["name"] == "multiply" and whole.startswith(first) and first != whole


def test_usage_rides_on_the_last_chunk_unless_stream_usage_is_off(tiny_engine):
    llm = ChatSnapKV(engine=tiny_engine, max_tokens=6, compression=None)
    chunks = list(llm.stream("Hello"))
    assert [c.usage_metadata is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert not any(c.usage_metadata for c in llm.stream("Hello", stream_usage=False))
    quiet = ChatSnapKV(engine=tiny_engine, max_tokens=6, compression=None, stream_usage=False)
    assert not any(c.usage_metadata for c in quiet.stream("Hello"))
    assert quiet.invoke("Hello", stream_usage=False).usage_metadata["output_tokens"] > 0  # a whole message keeps its usage
