"""Validate agent messages into the one shape the memory stores and the engine renders.

The shape is OpenAI's chat format, which is also what transformers' chat templates take:

- ``{"role": "system" | "user", "content": str}``
- ``{"role": "assistant", "content": str, "tool_calls": [{"id", "type": "function",
  "function": {"name", "arguments"}}]}`` (``tool_calls`` optional; ``content`` may be
  ``None``/absent when there are tool calls and is stored as ``""``, which is how the engine
  renders ``None`` anyway)
- ``{"role": "tool", "content": str, "tool_call_id": str, "name": str}``

``arguments`` is kept exactly as given: a JSON string (OpenAI) or a mapping (what many
chat templates expect). Any message may carry ``name`` (a string); ``metadata`` (a JSON
mapping) is stored with the message and returned by ``AgentMemory.history`` but never
rendered. Any other key is an error, so a typo cannot silently drop data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidPromptError

ROLES = ("system", "user", "assistant", "tool")
_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", "metadata"}


def _bad(index: int, what: str) -> InvalidPromptError:
    return InvalidPromptError(f"message {index}: {what}")


def _tool_call(index: int, j: int, call: Any) -> dict[str, Any]:
    where = f"tool_calls[{j}]"
    if not isinstance(call, Mapping):
        raise _bad(index, f"{where} must be a mapping {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    unknown = set(call) - {"id", "type", "function"}
    if unknown:
        raise _bad(index, f"{where} has unknown keys {sorted(unknown)}")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(index, f"{where}.id must be a non-empty string")
    kind = call.get("type", "function")
    if kind != "function":
        raise _bad(index, f"{where}.type must be 'function', got {kind!r}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise _bad(index, f"{where}.function must be a mapping with 'name' and 'arguments'")
    unknown = set(fn) - {"name", "arguments"}
    if unknown:
        raise _bad(index, f"{where}.function has unknown keys {sorted(unknown)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(index, f"{where}.function.name must be a non-empty string")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        try:
            arguments = json.loads(json.dumps(dict(arguments)))
        except (TypeError, ValueError) as exc:
            raise _bad(index, f"{where}.function.arguments is not JSON-serialisable: {exc}") from None
    elif not isinstance(arguments, str):
        raise _bad(index, f"{where}.function.arguments must be a JSON string or a mapping, got {type(arguments).__name__}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def validate_message(msg: Any, index: int = 0) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(message, metadata)`` in the stored shape, or :class:`InvalidPromptError`.

    Cross-message rules (a tool result must answer a known call) are checked by the store.
    """
    if not isinstance(msg, Mapping):
        raise _bad(index, f"must be a mapping with 'role' and 'content', got {type(msg).__name__}")
    unknown = set(msg) - _KEYS
    if unknown:
        raise _bad(index, f"unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    role = msg.get("role")
    if role not in ROLES:
        raise _bad(index, f"role {role!r}; expected one of {list(ROLES)}")
    content = msg.get("content")
    tool_calls = msg.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise _bad(index, f"only assistant messages carry tool_calls, not {role!r}")
    if content is None and role == "assistant" and tool_calls:
        content = ""
    if not isinstance(content, str):
        raise _bad(index, f"content must be a string, got {type(content).__name__}")
    out: dict[str, Any] = {"role": role, "content": content}
    if tool_calls is not None:
        if isinstance(tool_calls, (str, bytes)) or not isinstance(tool_calls, Sequence):
            raise _bad(index, "tool_calls must be a list")
        calls = [_tool_call(index, j, c) for j, c in enumerate(tool_calls)]
        ids = [c["id"] for c in calls]
        if len(set(ids)) != len(ids):
            raise _bad(index, f"tool call ids repeat within the message: {ids}")
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(index, "a tool message needs tool_call_id, the id of the call it answers")
        out["tool_call_id"] = call_id
    elif "tool_call_id" in msg:
        raise _bad(index, f"only tool messages carry tool_call_id, not {role!r}")
    if "name" in msg and msg["name"] is not None:
        if not isinstance(msg["name"], str):
            raise _bad(index, f"name must be a string, got {type(msg['name']).__name__}")
        out["name"] = msg["name"]
    metadata = msg.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise _bad(index, f"metadata must be a mapping, got {type(metadata).__name__}")
        try:
            metadata = json.loads(json.dumps(dict(metadata)))
        except (TypeError, ValueError) as exc:
            raise _bad(index, f"metadata is not JSON-serialisable: {exc}") from None
    return out, metadata
