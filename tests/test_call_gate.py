"""The calibrated call gate under tool_choice="auto" (issue 28), on a tiny random model with the
SmolLM2 tokenizer: what it decides, that the engine then writes exactly that, and where it does not apply."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch
from conftest import terse_bias, tiny_tool_engine

from snapkv_rag.engine.prompts import render_prompt
from snapkv_rag.tools import build_output_spec
from snapkv_rag.tools.call_gate import BACKGROUND_REQUESTS, CallGate, CallScores, decide


def tool(name: str, description: str) -> dict:
    params = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [tool("get_weather", "Weather in a city."), tool("multiply", "Multiply numbers."), tool("search_notes", "Search notes.")]
PROMPT = "What is the weather in Oslo?"
ALWAYS, NEVER = CallGate(threshold=-1e9), CallGate(threshold=1e9)


@contextmanager
def gate(engine, call_gate: CallGate):
    engine.call_gate = call_gate
    try:
        yield
    finally:
        engine.call_gate = None


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


def test_decide_calls_the_best_calibrated_tool_when_it_clears_the_threshold():
    scores = CallScores(marker=-2.0, tools={"a": -10.0, "b": -12.0})
    prior = {"a": -9.0, "b": -15.0}  # a is liked everywhere; b stands out here
    decision = decide(CallGate(threshold=-4.0, marker_weight=1.0), scores, prior)
    assert decision.calibrated == {"a": -1.0, "b": 3.0}
    assert decision.tool == "b" and decision.score == pytest.approx(1.0)
    assert decide(CallGate(threshold=1.5, marker_weight=1.0), scores, prior).tool is None
    assert decide(CallGate(threshold=1.5, marker_weight=0.0), scores, prior).tool == "b"


def test_scores_and_prior_come_from_the_model(engine):
    spec = build_output_spec(TOOLS, "auto")
    row = render_prompt(engine.tokenizer, PROMPT, tools=spec.tools)
    scores = engine.call_scores(row, spec)
    assert set(scores.tools) == {"get_weather", "multiply", "search_notes"}
    assert all(value < scores.marker <= 0 for value in scores.tools.values())  # an opening is the marker and more
    ids = engine.tokenizer('<tool_call>\n{"name": "multiply"', add_special_tokens=False)["input_ids"]
    expected = torch.log_softmax(engine._teacher_force_row(row, ids), -1)[torch.arange(len(ids)), torch.tensor(ids)].sum()
    assert scores.tools["multiply"] == pytest.approx(float(expected), abs=1e-3)

    prior = engine.call_prior(spec)
    background = [engine.call_scores(render_prompt(engine.tokenizer, t, tools=spec.tools), spec).tools["get_weather"] for t in BACKGROUND_REQUESTS]
    assert prior["get_weather"] == pytest.approx(sum(background) / len(background), abs=1e-3)
    engine.call_scorer.scores = None  # cached per tool set: a second call scores nothing
    try:
        assert engine.call_prior(spec) is prior
    finally:
        del engine.call_scorer.scores


def test_a_call_decision_forces_the_chosen_tool(engine):
    with gate(engine, ALWAYS):
        result = engine.generate(PROMPT, tools=TOOLS, max_new_tokens=64)
    decision = result.stats.tool_decision
    assert decision is not None and decision["tool"] in {"get_weather", "multiply", "search_notes"}
    assert decision["tool"] == max(decision["calibrated"], key=decision["calibrated"].get)
    assert [c.name for c in result.tool_calls] == [decision["tool"]]
    assert result.finish_reason == "tool_calls"


def test_a_prose_decision_answers_as_tool_choice_none(engine):
    with gate(engine, NEVER):
        result = engine.generate(PROMPT, tools=TOOLS, max_new_tokens=12)
    assert result.stats.tool_decision["tool"] is None
    assert not result.tool_calls
    plain = engine.generate(PROMPT, tools=TOOLS, tool_choice="none", max_new_tokens=12)
    assert result.text == plain.text  # the same prompt (tools not rendered) and the same greedy reply
    assert result.usage.prompt_tokens == plain.usage.prompt_tokens == engine.count_tokens(PROMPT)


def test_streams_decide_the_same(engine):
    with gate(engine, ALWAYS):
        with engine.stream(PROMPT, tools=TOOLS, max_new_tokens=64) as stream:
            list(stream)
        streamed = stream.result

        async def consume():
            s = engine.astream(PROMPT, tools=TOOLS, max_new_tokens=64)
            async for _ in s:
                pass
            return s.result

        awaited = asyncio.run(consume())
        generated = engine.generate(PROMPT, tools=TOOLS, max_new_tokens=64)
    names = [[c.name for c in r.tool_calls] for r in (streamed, awaited, generated)]
    assert names[0] == names[1] == names[2] and len(names[0]) == 1
    assert streamed.stats.tool_decision == awaited.stats.tool_decision


@pytest.mark.parametrize("options", [{"tool_choice": "required"}, {"tool_choice": "none"}, {"tools": None}, {"response_format": {"type": "json_object"}}])
def test_the_gate_leaves_other_requests_alone(engine, options):
    with gate(engine, NEVER):
        kwargs = {"tools": TOOLS, **options}
        if kwargs["tools"] is None:
            del kwargs["tools"]
        result = engine.generate(PROMPT, max_new_tokens=64, **kwargs)
        batch = engine.generate_batch([PROMPT, "Hi"], tools=TOOLS, tool_choice="required", max_new_tokens=48)
    assert result.stats.tool_decision is None
    if options.get("tool_choice") == "required":
        assert len(result.tool_calls) == 1
    assert all(r.stats.tool_decision is None for r in batch)


def test_without_a_gate_the_model_decides(engine):
    assert engine.call_gate is None  # tiny test models have no fitted gate
    result = engine.generate(PROMPT, tools=TOOLS, max_new_tokens=24)
    assert result.stats.tool_decision is None


def test_the_gate_reads_and_writes_only_the_requests_namespace(engine):
    """A keyed or salted request's gate teacher-forces its prompt, and the tool set's background
    requests, in the request's own prefix-cache namespace (issue 73, defect 2)."""
    spec = build_output_spec(TOOLS, "auto")
    scored = [render_prompt(engine.tokenizer, text, tools=spec.tools) for text in (PROMPT, BACKGROUND_REQUESTS[0])]
    engine.prefix_cache.clear()
    with gate(engine, NEVER):
        engine.generate(PROMPT, tools=TOOLS, max_new_tokens=2, cache_salt="victim")
        assert all(engine.prefix_cache.lookup(row, "victim")[1] == len(row) for row in scored)
        assert all(engine.prefix_cache.lookup(row, "")[1] == 0 for row in scored)  # nothing in the shared namespace
        engine.generate(PROMPT, tools=TOOLS, max_new_tokens=2, cache_salt="attacker")  # its own prior too, not the victim's
        assert all(engine.prefix_cache.lookup(row, "attacker")[1] == len(row) for row in scored)
        engine.generate(PROMPT, tools=TOOLS, max_new_tokens=2, cache_salt="nothing-kept", prefix_cache=False)
        assert all(engine.prefix_cache.lookup(row, "nothing-kept")[1] == 0 for row in scored)
