"""Turn a prompt string or a list of chat messages into token ids, exactly once.

Rules:
- chat messages always go through the tokenizer's chat template (with the generation prompt);
- a plain string is wrapped as one user message when the model has a chat template, unless
  ``chat=False`` asks for raw completion;
- the resulting ids carry exactly one BOS when the model uses one: the template's own BOS
  is not doubled by the tokenizer, and a tokenizer that adds BOS to plain text gets it back
  when a template lacks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import EmptyPromptError, InvalidPromptError

Message = Mapping[str, Any]
PromptLike = str | Sequence[Message]

_ROLES = {"system", "user", "assistant", "tool"}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validate chat messages (dicts or objects with ``role``/``content``) into plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidPromptError("messages must be a list of {'role': ..., 'content': ...} mappings")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            role, content = msg.get("role"), msg.get("content")
            extra = {k: v for k, v in msg.items() if k not in ("role", "content")}
        else:
            role, content = getattr(msg, "role", None), getattr(msg, "content", None)
            extra = {k: getattr(msg, k) for k in ("tool_calls", "tool_call_id", "name") if getattr(msg, k, None) is not None}
        if extra.get("tool_calls"):
            if role != "assistant":
                raise InvalidPromptError(f"message {i} has tool_calls but role {role!r}; only assistant messages carry them")
            extra["tool_calls"] = [_normalize_tool_call(c, i) for c in extra["tool_calls"]]
        elif "tool_calls" in extra:
            del extra["tool_calls"]
        if role not in _ROLES:
            raise InvalidPromptError(f"message {i} has role {role!r}; expected one of {sorted(_ROLES)}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidPromptError(f"message {i} content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content, **extra})
    if not any(m["content"].strip() or m.get("tool_calls") for m in out if m["role"] != "system"):
        raise EmptyPromptError("the conversation has no non-empty user or assistant message")
    return out


def _normalize_tool_call(call: Any, i: int) -> dict[str, Any]:
    """An earlier call in any common shape -> ``{"id", "type": "function", "function": {"name", "arguments": dict}}``.

    Accepts :class:`~snapkv_rag.tools.ToolCall`, OpenAI dicts (arguments as a JSON string or
    a dict) and flat dicts ``{"id", "name", "arguments" | "args"}`` (LangChain's shape).
    """
    if not isinstance(call, Mapping):
        call = {"id": getattr(call, "id", None), "name": getattr(call, "name", None), "arguments": getattr(call, "arguments", None)}
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = fn.get("name")
    arguments = fn.get("arguments", fn.get("args"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidPromptError(f"message {i} has a tool call whose arguments are not JSON: {arguments[:100]!r}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not isinstance(arguments, Mapping):
        raise InvalidPromptError(f"message {i} has a malformed tool call {call!r}")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": dict(arguments)}}


# --------------------------------------------------------------------------- tools
_PROBE_TOOL = "snapkv_rag_probe_tool"
_TOOL_SUPPORT: dict[tuple[int, str], bool] = {}


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools`` (probed once per tokenizer and template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    key = (id(tokenizer), str(template))
    if key not in _TOOL_SUPPORT:
        probe = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {"type": "object", "properties": {}}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False, add_generation_prompt=True)
            _TOOL_SUPPORT[key] = _PROBE_TOOL in text
        except Exception:  # a template that raises on tools does not support them
            _TOOL_SUPPORT[key] = False
    return _TOOL_SUPPORT[key]


def template_renders_tool_role(tokenizer) -> bool:
    """Whether the template renders a ``tool`` message's content as is (else tool results go in a user turn)."""
    key = (id(tokenizer), "tool-role:" + str(getattr(tokenizer, "chat_template", None)))
    if key not in _TOOL_SUPPORT:
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": _PROBE_TOOL}]
        try:
            _TOOL_SUPPORT[key] = _PROBE_TOOL in tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:
            _TOOL_SUPPORT[key] = False
    return _TOOL_SUPPORT[key]


FALLBACK_TOOL_PROMPT = """You can call the following tools. Their JSON signatures are inside <tools></tools>:
<tools>
{tools}
</tools>
To call a tool, reply with only this block (the arguments must match the tool's parameters):
<tool_call>
{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
A tool's result comes back inside <tool_response></tool_response>. When you do not need a tool, answer in plain text."""


def fallback_messages(messages: list[dict[str, Any]], tools: Sequence[Any], tool_role: str = "tool") -> list[dict[str, Any]]:
    """Rewrite a tool conversation for a template without tool support (plain roles only).

    - the tools and the call format go into the system message (appended to an existing one);
    - an assistant message's ``tool_calls`` become ``<tool_call>`` blocks in its content,
      exactly as the engine writes them;
    - ``tool`` messages become ``<tool_response>`` blocks with role ``tool_role``: ``"tool"``
      where the template renders that role (SmolLM2's does, and its answers use the result
      far more reliably so), else ``"user"``, and then consecutive results are merged into
      one message so user/assistant turns still alternate.

    Appending messages only appends to the rendering (with ``tool_role="tool"``), so
    consecutive prompts of an agent loop share their prefix.
    """
    from ..tools.calls import dump_json, format_call

    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or [] if c.get("id")}
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"), "")
            block = "<tool_response>\n" + dump_json({"name": name, "content": m["content"]}) + "\n</tool_response>"
            if tool_role == "user" and out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": tool_role, "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = "\n".join(dump_json(t.to_openai()) for t in tools)
        instructions = FALLBACK_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + instructions).strip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def tokenizer_adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def _single_bos(ids: list[int], tokenizer, wants_bos: bool) -> list[int]:
    bos = tokenizer.bos_token_id
    if bos is None:
        return ids
    while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if wants_bos and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def _rendered_text(tokenizer, prompt: PromptLike, chat: bool | None, tools: Sequence[Any] = ()) -> tuple[str, bool]:
    """The prompt as text before tokenization, and whether the tokenizer should add special tokens.

    ``tools`` (:class:`~snapkv_rag.tools.ToolSpec` objects) go through the chat template when
    it supports them (``apply_chat_template(tools=...)``), else into the system message in
    the documented fallback format (:func:`fallback_messages`), which also renders earlier
    tool calls and tool results for such templates.
    """
    if isinstance(prompt, bytes):
        raise InvalidPromptError("prompt must be str or a list of messages, not bytes; decode it first")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise EmptyPromptError("the prompt is empty")
        use_chat = has_template if chat is None else chat
        if use_chat and not has_template:
            raise InvalidPromptError("chat=True but this tokenizer has no chat template")
        if not use_chat and tools:
            raise InvalidPromptError("tools need a chat template; chat=False (raw completion) cannot render them")
        if not use_chat:
            return prompt, True
        messages = [{"role": "user", "content": prompt}]
    else:
        if chat is False:
            raise InvalidPromptError("chat=False needs a string prompt, not messages")
        if not has_template:
            raise InvalidPromptError("this tokenizer has no chat template; pass a plain string prompt")
        messages = normalize_messages(prompt)
    if template_supports_tools(tokenizer):
        extra = {"tools": [t.to_openai() for t in tools]} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra), False
    if tools or _has_tool_turns(messages):
        messages = fallback_messages(messages, tools, "tool" if template_renders_tool_role(tokenizer) else "user")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False


def render_prompt(tokenizer, prompt: PromptLike, *, chat: bool | None = None, tools: Sequence[Any] = ()) -> list[int]:
    """Token ids for ``prompt``; see the module docstring for the rules (and :func:`_rendered_text` for ``tools``)."""
    text, add_special = _rendered_text(tokenizer, prompt, chat, tools)
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    return _single_bos(list(ids), tokenizer, tokenizer_adds_bos(tokenizer))


def segment_spans(
    tokenizer,
    prompt: PromptLike,
    segments: Sequence[str] | Callable[[str], Sequence[str]],
    n_tokens: int,
    *,
    chat: bool | None = None,
    tools: Sequence[Any] = (),
) -> list[tuple[int, int]]:
    """Token spans of ``segments`` (texts that appear in the prompt; or a function choosing them
    from the rendered prompt's text) within the ``n_tokens`` ids :func:`render_prompt` gives;
    see :func:`snapkv_rag.reuse.blending.segment_token_spans`."""
    from ..reuse.blending import segment_token_spans

    text, add_special = _rendered_text(tokenizer, prompt, chat, tools)
    if callable(segments):
        segments = segments(text)
    offsets = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)["offset_mapping"]
    # render_prompt only adds or drops a BOS at the front: count that difference as a shift
    return segment_token_spans(offsets, text, segments, shift=n_tokens - len(offsets))


def text_token_spans(
    tokenizer, prompt: PromptLike, texts: Sequence[str], n_tokens: int, *, chat: bool | None = None, tools: Sequence[Any] = ()
) -> list[tuple[int, int]]:
    """The token span of each of ``texts`` (its first occurrence) in the ``n_tokens`` ids of the
    rendered prompt, in the order given; ``(0, 0)`` for a text not found."""
    from ..reuse.blending import segment_token_spans

    text, add_special = _rendered_text(tokenizer, prompt, chat, tools)
    offsets = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)["offset_mapping"]
    shift = n_tokens - len(offsets)
    return [(found or [(0, 0)])[0] for found in (segment_token_spans(offsets, text, [t], shift) for t in texts)]


def last_paragraph(text: str) -> str:
    """The text after the last blank line (the whole text when it has none), stripped."""
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return paragraphs[-1].strip() if paragraphs else ""


def default_question(prompt: PromptLike) -> str:
    """Where the question sits by convention: the last paragraph of the last user message."""
    if isinstance(prompt, str):
        return last_paragraph(prompt)
    users = [m for m in normalize_messages(prompt) if m["role"] == "user" and m["content"].strip()]
    return last_paragraph(users[-1]["content"]) if users else ""


def question_tail_tokens(
    tokenizer, prompt: PromptLike, *, chat: bool | None = None, question: str | None = None, tools: Sequence[Any] = (), with_space: bool = False
) -> int | None:
    """How many trailing prompt tokens the question and everything after it take.

    ``question``: the question's text as it appears in the prompt (its last occurrence is
    used); by default :func:`default_question`. Counts the chat template's tail too (end of
    turn, assistant header). None when the question text is not found in the rendered prompt.
    ``with_space``: the whitespace right before the question counts as the question's, so the tokens
    before it are the same whatever the question's first word (a tokenizer may or may not join a
    space to it).
    """
    text, add_special = _rendered_text(tokenizer, prompt, chat, tools)
    needle = (question if question is not None else default_question(prompt)).strip()
    start = text.rfind(needle) if needle else -1
    if start < 0:
        return None
    if with_space:
        start = len(text[:start].rstrip())
    encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    # The first token that reaches into the question; counted from the end, so a BOS
    # adjusted at the front by render_prompt does not shift it.
    for index, (_, end) in enumerate(offsets):
        if end > start:
            return len(offsets) - index
    return None
