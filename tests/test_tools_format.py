"""The call format without a model: grammars fed by hand, stream parsing, prompt rendering."""

from __future__ import annotations

import json
import random

import pytest
import torch

from snapkv_rag.engine.prompts import fallback_messages, render_prompt, template_supports_tools
from snapkv_rag.errors import InvalidPromptError, StructuredOutputError
from snapkv_rag.tools import ToolCall, ToolCallDelta, ToolCallStream, build_output_spec, format_call, parse_tool_calls, split_calls
from snapkv_rag.tools.constraints import BatchConstraint, GrammarTokenizer, closed_objects, grammar_for, unpack_bitmask

INT_TOOL = {
    "type": "function",
    "function": {
        "name": "magic_function",
        "description": "Magic.",
        "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
    },
}
ENUM_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def grammar_tokenizer(smollm_tokenizer):
    return GrammarTokenizer(smollm_tokenizer, len(smollm_tokenizer), [smollm_tokenizer.eos_token_id])


def run_text(grammar_tokenizer, tokenizer, spec, text):
    """Feed ``text`` token by token; return (accepted all, complete at the end, allowed ids after)."""
    constraint = BatchConstraint.build(grammar_tokenizer, [spec])
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        logits = constraint.mask(torch.zeros(1, grammar_tokenizer.vocab_size))
        if not torch.isfinite(logits[0, token]):
            return False, False, None
        constraint.advance([token])
    logits = constraint.mask(torch.zeros(1, grammar_tokenizer.vocab_size))
    return True, constraint.complete(0), torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_required_grammar_accepts_only_schema_valid_calls(grammar_tokenizer, smollm_tokenizer):
    spec = build_output_spec([INT_TOOL, ENUM_TOOL], "required")
    eos = smollm_tokenizer.eos_token_id
    ok, complete, allowed = run_text(grammar_tokenizer, smollm_tokenizer, spec, format_call("magic_function", {"input": 3}))
    assert ok and complete and allowed == [eos]  # only EOS may follow one call
    ok, complete, _ = run_text(grammar_tokenizer, smollm_tokenizer, spec, format_call("weather", {"city": "Zürich", "unit": "c"}))
    assert ok and complete
    for bad in (
        format_call("magic_function", {"input": "3"}),  # wrong type
        format_call("weather", {"city": "x", "unit": "k"}),  # not in the enum
        format_call("weather", {"city": "x", "extra": 1}),  # closed object
        format_call("other", {}),  # not offered
        "Sure! " + format_call("magic_function", {"input": 3}),  # text before a forced call
        '<tool_call>\n{"name":"magic_function","arguments":{"input":3}}\n</tool_call>',  # not the compact format
    ):
        assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, bad)[0], bad


def test_auto_grammar_allows_text_and_constrains_a_started_call(grammar_tokenizer, smollm_tokenizer):
    spec = build_output_spec([INT_TOOL], "auto")
    ok, complete, _ = run_text(grammar_tokenizer, smollm_tokenizer, spec, "Just an answer, with <tags> and {braces}.")
    assert ok and complete
    ok, complete, _ = run_text(grammar_tokenizer, smollm_tokenizer, spec, "Let me check. " + format_call("magic_function", {"input": 7}))
    assert ok and complete
    ok, complete, _ = run_text(grammar_tokenizer, smollm_tokenizer, spec, "Let me check. <tool_call>\n")
    assert ok and not complete  # once the marker is out, only a call can finish the output
    assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, 'x <tool_call>\n{"name": "magic_function", "arguments": {"input": 1.5}}')[0]
    assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, "x <tool_call>\nhello")[0]


def test_auto_grammar_with_a_response_format_is_json_or_calls(grammar_tokenizer, smollm_tokenizer):
    spec = build_output_spec([INT_TOOL], "auto", response_format={"type": "json_object"})
    assert run_text(grammar_tokenizer, smollm_tokenizer, spec, '{"answer": "yes"}')[:2] == (True, True)
    assert run_text(grammar_tokenizer, smollm_tokenizer, spec, format_call("magic_function", {"input": 7}))[:2] == (True, True)
    # Prose is neither JSON nor a call: refused at its first token, never a dead end later.
    assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, "Let me check. ")[0]
    assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, "Let me check. " + format_call("magic_function", {"input": 7}))[0]


def test_json_grammar_and_closed_objects(grammar_tokenizer, smollm_tokenizer):
    spec = build_output_spec(response_format={"type": "json_object"})
    assert run_text(grammar_tokenizer, smollm_tokenizer, spec, '{"any": [1, {"thing": null}]}')[:2] == (True, True)
    assert not run_text(grammar_tokenizer, smollm_tokenizer, spec, "[1, 2]")[0]
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "additionalProperties": True}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is True  # an explicit choice is kept
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]["a"]


def test_constraint_leaves_unconstrained_rows_alone(grammar_tokenizer):
    constraint = BatchConstraint.build(grammar_tokenizer, [build_output_spec(), build_output_spec(response_format={"type": "json_object"})])
    logits = torch.randn(2, grammar_tokenizer.vocab_size)
    before = logits.clone()
    constraint.mask(logits)
    assert torch.equal(logits[0], before[0])
    assert int(torch.isfinite(logits[1]).sum()) < 10
    assert BatchConstraint.build(grammar_tokenizer, [build_output_spec()]) is None


def test_unpack_bitmask_bit_order():
    words = torch.tensor([[0b101, -1 << 31]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]


def test_grammar_text_is_stable():
    grammar = grammar_for(build_output_spec([INT_TOOL], "required"))
    assert 'call_0: "{\\"name\\": \\"magic_function\\", \\"arguments\\": " args_0 "}"' in grammar
    assert grammar_for(build_output_spec([INT_TOOL], "none")) is None


# ------------------------------------------------------------------ parsing and streaming
TEXT = "Let me check. " + format_call("magic_function", {"input": 3}) + "\n" + format_call("weather", {"city": '東京 "}\n</tool_call>"', "unit": "c"})


def test_split_calls_handles_markers_inside_strings():
    parsed = split_calls(TEXT)
    assert parsed.text == "Let me check. "
    assert parsed.calls == [("magic_function", {"input": 3}), ("weather", {"city": '東京 "}\n</tool_call>"', "unit": "c"})]
    with pytest.raises(StructuredOutputError):
        split_calls('<tool_call>\n{"name": "f", "arguments": {')


def test_parse_tool_calls_validates_against_the_schema():
    spec = build_output_spec([INT_TOOL], "required")
    text, calls = parse_tool_calls(format_call("magic_function", {"input": 3}), spec, ["call_x"])
    assert calls == [ToolCall("call_x", "magic_function", {"input": 3})] and text == ""
    with pytest.raises(StructuredOutputError, match="schema"):
        parse_tool_calls(format_call("magic_function", {"input": "three"}), spec)
    with pytest.raises(StructuredOutputError, match="not offered"):
        parse_tool_calls(format_call("nope", {}), spec)
    with pytest.raises(StructuredOutputError, match="forces a call"):
        parse_tool_calls("plain text", spec)


@pytest.mark.parametrize("seed", range(20))
def test_stream_parser_reassembles_under_any_split(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 40))) if seed else list(range(1, len(TEXT)))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    parser = ToolCallStream()
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    text = "".join(e for e in events if isinstance(e, str))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert text == "Let me check. "
    names = [(d.index, d.name) for d in deltas if d.name is not None]
    assert names == [(0, "magic_function"), (1, "weather")]
    for index, expected in ((0, {"input": 3}), (1, {"city": '東京 "}\n</tool_call>"', "unit": "c"})):
        assert json.loads("".join(d.arguments for d in deltas if d.index == index)) == expected
    assert [d.id for d in deltas if d.id] == parser.ids


# ------------------------------------------------------------------ rendering
def test_fallback_renders_tools_calls_and_results(smollm_tokenizer):
    assert not template_supports_tools(smollm_tokenizer)
    spec = build_output_spec([INT_TOOL])
    call = ToolCall("call_1", "magic_function", {"input": 3})
    messages = [
        {"role": "user", "content": "What is magic_function(3)?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22"},
        {"role": "tool", "tool_call_id": "call_1", "content": "again"},
    ]
    text = smollm_tokenizer.decode(render_prompt(smollm_tokenizer, messages, tools=spec.tools))
    assert text.startswith("<|im_start|>system\nYou can call the following tools.")
    assert '"name": "magic_function"' in text and '<tool_call>\n{"name": "<tool name>"' in text
    assert "<|im_start|>assistant\n" + format_call("magic_function", {"input": 3}) + "<|im_end|>" in text
    # each result keeps its own tool turn, so appending a message only appends to the rendering
    assert (
        '<|im_start|>tool\n<tool_response>\n{"name": "magic_function", "content": "22"}\n</tool_response><|im_end|>\n'
        '<|im_start|>tool\n<tool_response>\n{"name": "magic_function", "content": "again"}\n</tool_response><|im_end|>'
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    # OpenAI-shaped earlier calls (arguments as a JSON string) render the same way
    openai_shaped = [messages[0], {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]}, messages[2]]
    assert format_call("magic_function", {"input": 3}) in smollm_tokenizer.decode(render_prompt(smollm_tokenizer, openai_shaped))


def test_fallback_merges_into_an_existing_system_message_and_uses_user_role_when_asked():
    spec = build_output_spec([INT_TOOL])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "magic_function", "arguments": {"input": 1}}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "a", "content": "6"},
    ]
    out = fallback_messages(messages, spec.tools, tool_role="user")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results merged: turns alternate
    assert out[3]["content"].count("<tool_response>") == 2
    assert out[0]["content"].startswith("Be brief.\n\nYou can call")
    assert out[2]["content"].startswith("ok\n<tool_call>")


def test_template_with_tool_support_renders_through_the_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert template_supports_tools(tok)
    spec = build_output_spec([INT_TOOL])
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [ToolCall("i", "magic_function", {"input": 2})]}]
    text = tok.decode(render_prompt(tok, messages, tools=spec.tools))
    assert "TOOLS:magic_function;" in text and 'CALL magic_function {"input": 2}' in text
    assert "You can call the following tools" not in text


def test_tools_need_a_chat_template(smollm_tokenizer):
    with pytest.raises(InvalidPromptError):
        render_prompt(smollm_tokenizer, "hi", chat=False, tools=build_output_spec([INT_TOOL]).tools)
    with pytest.raises(InvalidPromptError):
        render_prompt(
            smollm_tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{oops"}]}]
        )
