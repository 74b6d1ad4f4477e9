"""The engine never crashes an agent (issue 28): a repeated call collapses to one and ends the
turn, parallel calls are capped, and running out of tokens after complete calls returns them.

A tiny random model under the call grammar stands in for SmolLM2, which wrote the same
``<tool_call>`` again and again under LlamaIndex's FunctionAgent until max_new_tokens ran out.
"""

from __future__ import annotations

import pytest
from conftest import terse_bias, tiny_tool_engine

from snapkv_rag.errors import StructuredOutputError
from snapkv_rag.tools import ToolCallDelta, ToolCallStream, format_call


@pytest.fixture(scope="module")
def tool_engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


def fn(name, parameters):
    return {"type": "function", "function": {"name": name, "description": "", "parameters": parameters}}


ONE_CALL = fn("ping", {"type": "object", "properties": {"host": {"enum": ["a"]}}, "required": ["host"]})  # one possible call
INTEGER = fn("f", {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]})


def deltas_to_calls(events) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                calls[e.index] = [e.name, ""]
            else:
                calls[e.index][1] += e.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


# ----------------------------------------------------------------------------- the stream parser
def test_a_repeated_call_is_dropped_from_the_stream_and_flagged():
    stream = ToolCallStream()
    block = format_call("ping", {"host": "a"})
    events = stream.feed("Let me check.\n" + block + "\n")
    events += stream.feed(block[:20])
    assert not stream.duplicate
    events += stream.feed(block[20:] + "\n") + stream.finish()
    assert stream.duplicate and stream.completed == 1 and len(stream.ids) == 1
    assert deltas_to_calls(events) == [("ping", '{"host": "a"}')]


def test_a_later_call_is_held_until_complete_and_an_unfinished_one_never_announced():
    stream = ToolCallStream()
    events = stream.feed(format_call("f", {"input": 1}) + "\n")
    events += stream.feed(format_call("f", {"input": 2})[:-12])  # the second call, not yet closed
    assert deltas_to_calls(events) == [("f", '{"input": 1}')]
    events += stream.finish()
    assert stream.dropped_tail and deltas_to_calls(events) == [("f", '{"input": 1}')]


def test_distinct_parallel_calls_all_stream():
    stream = ToolCallStream()
    text = "\n".join(format_call("f", {"input": i}) for i in range(3))
    events = [e for piece in (text[i : i + 7] for i in range(0, len(text), 7)) for e in stream.feed(piece)] + stream.finish()
    assert deltas_to_calls(events) == [("f", f'{{"input": {i}}}') for i in range(3)]
    assert not stream.duplicate and not stream.dropped_tail and len(stream.ids) == 3


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("seed", range(6))
def test_repeated_calls_collapse_and_end_the_turn(tool_engine, seed):
    kwargs = dict(tools=[ONE_CALL], tool_choice="required", parallel_tool_calls=True, max_new_tokens=120, temperature=1.0, seed=seed)
    result = tool_engine.generate("Go.", **kwargs)
    assert result.finish_reason == "tool_calls" and [c.name for c in result.tool_calls] == ["ping"]
    events = list(tool_engine.stream("Go.", **kwargs))
    assert deltas_to_calls(events) == [("ping", '{"host": "a"}')]


@pytest.fixture(scope="module")
def looping_engine(smollm_tokenizer):
    """Like SmolLM2 under FunctionAgent: after a call it would rather write another than stop."""
    bias = terse_bias(smollm_tokenizer)
    bias[smollm_tokenizer.eos_token_id] = -20.0
    return tiny_tool_engine(smollm_tokenizer, bias=bias)


def test_the_repeat_path_is_taken(looping_engine):
    """The model writes the call again; the repeat is dropped, the turn ends, the stats say so."""
    flagged = []
    for seed in range(4):
        result = looping_engine.generate(
            "Go.", tools=[ONE_CALL], tool_choice="required", parallel_tool_calls=True, max_new_tokens=120, temperature=1.0, seed=seed
        )
        flagged.append(result.stats.duplicate_tool_calls)
        assert len(result.tool_calls) == 1
    assert all(flagged)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_parallel_calls_are_capped(tool_engine, limit):
    for seed in range(4):
        result = tool_engine.generate(
            "Go.",
            tools=[INTEGER],
            tool_choice="required",
            parallel_tool_calls=True,
            max_tool_calls=limit,
            max_new_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        assert 1 <= len(result.tool_calls) <= limit


def test_out_of_tokens_after_a_complete_call_returns_the_complete_calls(looping_engine):
    dropped = 0
    for budget in range(12, 120, 4):
        try:
            result = looping_engine.generate(
                "Go.",
                tools=[INTEGER],
                tool_choice="required",
                parallel_tool_calls=True,
                max_tool_calls=5,
                max_new_tokens=budget,
                temperature=1.0,
                seed=1,
            )
        except StructuredOutputError as exc:  # cut inside the first call: nothing complete to return
            assert "before the structured output was complete" in str(exc)
            continue
        assert result.finish_reason == "tool_calls" and result.tool_calls
        dropped += result.stats.tool_call_tail_dropped
    assert dropped, "no budget ended inside a later call; the test did not exercise the path"


def test_a_first_call_cut_off_is_still_an_error(tool_engine):
    with pytest.raises(StructuredOutputError, match="max_new_tokens"):
        tool_engine.generate("Go.", tools=[INTEGER], tool_choice="required", parallel_tool_calls=True, max_new_tokens=5)


def test_bad_max_tool_calls_is_one_clear_error(tool_engine):
    with pytest.raises(StructuredOutputError, match="max_tool_calls"):
        tool_engine.generate("Go.", tools=[INTEGER], max_tool_calls=0)
