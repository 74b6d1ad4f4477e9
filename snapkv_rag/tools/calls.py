"""Tool calling and structured output: request types, the call format, parsing and streaming.

The engine always writes a tool call in one format (the Hermes/Qwen convention), whatever
renders the prompt::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The JSON line is compact, with ``", "`` and ``": "`` separators and ``name`` before
``arguments``; constrained decoding (:mod:`snapkv_rag.tools.constraints`) makes the model write
exactly that, with arguments that match the tool's JSON Schema. This module validates the
request (``tools``, ``tool_choice``, ``response_format``), parses finished text into
:class:`ToolCall` objects (validated again with ``jsonschema``), and turns streamed text into
plain ``str`` pieces plus :class:`ToolCallDelta` events.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import StructuredOutputError

# At most this many calls in one turn with parallel_tool_calls; then the turn ends. A small model
# with parallel calls allowed can write call after call until max_new_tokens runs out.
DEFAULT_MAX_TOOL_CALLS = 5
CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
MARKER = "<tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def dump_json(value: Any) -> str:
    """The one JSON serialization the call format uses (what the grammar forces)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments: ``{"name": "<name>", "arguments": ``."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call block, exactly as constrained decoding writes it."""
    return CALL_OPEN + call_prefix(name) + dump_json(dict(arguments)) + "}" + CALL_CLOSE


# --------------------------------------------------------------------------- public types
@dataclass(frozen=True)
class ToolCall:
    """A parsed, schema-validated call. ``arguments`` is a dict, never a JSON string."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI message form (``arguments`` as a JSON string), as assistant messages carry it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": dump_json(self.arguments)}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of a tool call.

    The first delta of call ``index`` carries its ``id`` and ``name`` (``arguments == ""``);
    later ones carry consecutive fragments of the arguments' JSON text (``id``/``name`` None).
    Concatenating the fragments of one index gives ``json.dumps(call.arguments)`` in the call
    format. This maps onto LangChain's ``tool_call_chunks`` (``name``, ``args``, ``id``,
    ``index``) and LlamaIndex's tool-call blocks.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class OutputSpec:
    """What one row of a call must produce. ``mode``: text, tools or json."""

    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"  # "auto", "required", "none" or "function" (then ``forced`` names it)
    forced: str | None = None
    parallel_tool_calls: bool = False
    json_schema: dict[str, Any] | None = None  # response_format, as a schema ({"type": "object"} for json_object)
    schema_name: str | None = None
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS  # with parallel_tool_calls: calls per turn at most

    @property
    def call_limit(self) -> int:
        return self.max_tool_calls if self.parallel_tool_calls else 1

    @property
    def renders_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_tools(self) -> bool:
        return self.renders_tools

    @property
    def constrained(self) -> bool:
        return self.calls_tools or self.json_schema is not None

    @property
    def callable_tools(self) -> tuple[ToolSpec, ...]:
        if self.forced is not None:
            return tuple(t for t in self.tools if t.name == self.forced)
        return self.tools

    def tool(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)


TEXT = OutputSpec()


# --------------------------------------------------------------------------- validation
def check_schema(schema: Any, what: str) -> dict[str, Any]:
    """A JSON Schema that ``jsonschema`` accepts, else :class:`StructuredOutputError`."""
    import jsonschema

    param = "response_format" if what.startswith("response_format") else "tools"
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(f"{what} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    schema = dict(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise StructuredOutputError(f"{what} is not a valid JSON Schema: {exc.message}", param=param) from None
    return schema


def _tool_spec(raw: Any, i: int) -> ToolSpec:
    if isinstance(raw, ToolSpec):
        return raw
    if not isinstance(raw, Mapping):
        raise StructuredOutputError(f"tools[{i}] must be a mapping like {{'type': 'function', 'function': {{...}}}}", param="tools")
    if raw.get("type", "function") != "function":
        raise StructuredOutputError(f"tools[{i}] has type {raw.get('type')!r}; only 'function' tools are supported", param="tools")
    fn = raw.get("function", raw if "name" in raw else None)
    if not isinstance(fn, Mapping):
        raise StructuredOutputError(f"tools[{i}] has no 'function' mapping", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise StructuredOutputError(f"tools[{i}] name {name!r} must be 1-64 characters of letters, digits, '_', '-' or '.'", param="tools")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise StructuredOutputError(f"tool {name!r} description must be a string", param="tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    params = check_schema(params, f"parameters of tool {name!r}")
    if params.get("type", "object") != "object":
        raise StructuredOutputError(f"parameters of tool {name!r} must describe an object (type 'object')", param="tools")
    return ToolSpec(name, description, params)


def _response_schema(response_format: Any) -> tuple[dict[str, Any] | None, str | None]:
    if response_format is None:
        return None, None
    if not isinstance(response_format, Mapping):
        raise StructuredOutputError("response_format must be {'type': 'json_object'} or {'type': 'json_schema', ...}", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"type": "object"}, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise StructuredOutputError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}", param="response_format")
        return check_schema(spec["schema"], "response_format schema"), spec.get("name")
    raise StructuredOutputError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'", param="response_format")


def build_output_spec(
    tools: Sequence[Any] | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    parallel_tool_calls: bool = False,
    max_tool_calls: int | None = None,
) -> OutputSpec:
    """Validate one row's request; raises :class:`StructuredOutputError` on anything malformed."""
    if max_tool_calls is None:
        max_tool_calls = DEFAULT_MAX_TOOL_CALLS
    if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 1:
        raise StructuredOutputError(f"max_tool_calls must be a positive integer, got {max_tool_calls!r}", param="max_tool_calls")
    if tools is None:
        tools = ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise StructuredOutputError("tools must be a list of function specs", param="tools")
    specs = tuple(_tool_spec(t, i) for i, t in enumerate(tools))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise StructuredOutputError(f"tool names must be unique, got {names}", param="tools")
    if not isinstance(parallel_tool_calls, bool):
        raise StructuredOutputError("parallel_tool_calls must be True or False", param="parallel_tool_calls")
    forced = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required", "none"):
            raise StructuredOutputError(f"tool_choice must be 'auto', 'required', 'none' or a function choice, got {tool_choice!r}", param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        forced = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(forced, str):
            raise StructuredOutputError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if forced not in names:
            raise StructuredOutputError(f"tool_choice names {forced!r}, which is not among the tools {names}", param="tool_choice")
        choice = "function"
    else:
        raise StructuredOutputError(f"tool_choice must be a string or a mapping, got {type(tool_choice).__name__}", param="tool_choice")
    if choice in ("required", "function") and not specs:
        raise StructuredOutputError(f"tool_choice={tool_choice!r} needs at least one tool", param="tool_choice")
    schema, schema_name = _response_schema(response_format)
    if schema is not None and choice in ("required", "function"):
        raise StructuredOutputError("response_format cannot be combined with a tool_choice that forces a call", param="response_format")
    return OutputSpec(specs, choice, forced, parallel_tool_calls, schema, schema_name, max_tool_calls)


def validate_instance(value: Any, schema: dict[str, Any], what: str) -> None:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        raise StructuredOutputError(f"{what} does not match its schema: {exc.message}") from None


# --------------------------------------------------------------------------- parsing finished text
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedOutput:
    text: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def split_calls(text: str) -> ParsedOutput:
    """Split text into the prose outside call blocks and the ``(name, arguments)`` of each block.

    Raises :class:`StructuredOutputError` for a block that is unterminated or not valid JSON.
    """
    prose: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    while True:
        start = text.find(MARKER, pos)
        if start < 0:
            prose.append(text[pos:])
            break
        prose.append(text[pos:start])
        body_start = start + len(MARKER)
        # "}\n</tool_call>" cannot occur inside JSON (strings escape newlines), so it ends the block
        end = text.find("}" + CALL_CLOSE, body_start)
        if end < 0:
            raise StructuredOutputError(f"the output ends inside a tool call: {text[start : start + 200]!r}")
        body = text[body_start : end + 1].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"a tool call is not valid JSON ({exc.msg}): {body[:200]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
            raise StructuredOutputError(f"a tool call must be {{'name': str, 'arguments': object}}, got {body[:200]!r}")
        calls.append((obj["name"], obj["arguments"]))
        pos = end + 1 + len(CALL_CLOSE)
        if text.startswith("\n", pos):  # the separator between blocks is not prose
            pos += 1
    return ParsedOutput("".join(prose), calls)


def complete_calls_text(text: str) -> str | None:
    """``text`` up to the end of its last complete call block (the unfinished one after it
    dropped), or None when it holds no complete call."""
    end = text.rfind("}" + CALL_CLOSE)
    return None if end < 0 else text[: end + 1 + len(CALL_CLOSE)]


def call_key(name: str, arguments: Any) -> str:
    return name + "\x00" + json.dumps(arguments, sort_keys=True)


def parse_tool_calls(text: str, spec: OutputSpec, ids: Sequence[str] = ()) -> tuple[str, list[ToolCall]]:
    """Prose and validated :class:`ToolCall` objects of a finished row (ids reused from streaming).
    Identical calls (same name and arguments) in one turn count once."""
    parsed = split_calls(text)
    calls = []
    seen: set[str] = set()
    unique = []
    for name, arguments in parsed.calls:
        key = call_key(name, arguments)
        if key not in seen:
            seen.add(key)
            unique.append((name, arguments))
    for i, (name, arguments) in enumerate(unique):
        tool = spec.tool(name)
        if tool is None or (spec.forced is not None and name != spec.forced):
            raise StructuredOutputError(f"the model called {name!r}, which it was not offered")
        validate_instance(arguments, tool.parameters, f"arguments of the call to {name!r}")
        calls.append(ToolCall(ids[i] if i < len(ids) else new_call_id(), name, arguments))
    if spec.tool_choice in ("required", "function") and not calls:
        raise StructuredOutputError("tool_choice forces a call but the output holds none", param="tool_choice")
    return parsed.text, calls


def parse_json_output(text: str, spec: OutputSpec) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"the output is not valid JSON ({exc.msg}): {text[:200]!r}") from None
    validate_instance(value, spec.json_schema or {}, "the output")
    return value


# --------------------------------------------------------------------------- streaming
def _partial_suffix(text: str, target: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``target``."""
    for k in range(min(len(target) - 1, len(text)), 0, -1):
        if text.endswith(target[:k]):
            return k
    return 0


class ToolCallStream:
    """Turn a row's released text pieces into ``str`` pieces and :class:`ToolCallDelta` events.

    Text outside call blocks passes through (a tail that may start a marker is held back
    until it is settled); inside a block the name is announced once known, then argument
    fragments follow, never including the block's own closing ``}``.

    The first call streams as it is written. A later call is held until it is complete and
    released only when it is not identical to an earlier one: a repeated call is dropped (and
    ``duplicate`` set, so the engine can end the turn), and an unfinished later call at the
    end of the row (``max_new_tokens``) is never announced.
    """

    _END = "}" + CALL_CLOSE

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._named = False
        self._index = -1
        self._after_call = False
        self.ids: list[str] = []
        self._keys: list[str] = []  # name + arguments of each released call
        self._name = ""
        self._args = ""
        self._id = ""
        self._held: list[ToolCallDelta] | None = None  # events of a later call, until it completes
        self.duplicate = False  # the last call repeated an earlier one (dropped)
        self.completed = 0  # complete calls released
        self.dropped_tail = False  # an unfinished call was cut off at the end

    def _emit(self, out: list, event: ToolCallDelta) -> None:
        (out if self._held is None else self._held).append(event)

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        self._buffer += piece
        out: list[str | ToolCallDelta] = []
        while True:
            before = (self._buffer, self._in_call, self._named)
            if not self._in_call:
                self._text_state(out)
            elif not self._named:
                self._name_state(out)
            else:
                self._args_state(out)
            if (self._buffer, self._in_call, self._named) == before:
                return out

    def finish(self) -> list[str | ToolCallDelta]:
        """Flush what is held back at the end of the row."""
        out: list[str | ToolCallDelta] = []
        if self._in_call:
            self.dropped_tail = True
        if self._buffer:
            if not self._in_call:
                out.append(self._buffer)
            elif self._named and self._held is None:
                out.append(ToolCallDelta(self._index, arguments=self._buffer))
        self._buffer = ""
        self._held = None  # an unfinished later call is never announced
        return out

    def _text_state(self, out: list) -> None:
        if self._after_call:  # one newline separates blocks; it is not prose
            if not self._buffer:
                return
            self._after_call = False
            if self._buffer.startswith("\n"):
                self._buffer = self._buffer[1:]
        start = self._buffer.find(MARKER)
        if start >= 0:
            if start:
                out.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(MARKER) :]
            self._in_call, self._named = True, False
            return
        keep = _partial_suffix(self._buffer, MARKER)
        release = self._buffer[: len(self._buffer) - keep]
        if release:
            out.append(release)
            self._buffer = self._buffer[len(release) :]

    _NAME_RE = re.compile(r'^\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')

    def _name_state(self, out: list) -> None:
        match = self._NAME_RE.match(self._buffer)
        if match:
            self._name, self._args, self._id = json.loads(match.group(1)), "", new_call_id()
            self._held = [] if self.completed else None
            self._emit(out, ToolCallDelta(self._index + 1, id=self._id, name=self._name))
            self._buffer = self._buffer[match.end() :]
            self._named = True

    def _args_state(self, out: list) -> None:
        end = self._buffer.find(self._END)
        if end >= 0:
            if end:
                self._args += self._buffer[:end]
                self._emit(out, ToolCallDelta(self._index + 1, arguments=self._buffer[:end]))
            self._buffer = self._buffer[end + len(self._END) :]
            self._in_call = self._named = False
            self._after_call = True
            self._close_call(out)
            return
        keep = _partial_suffix(self._buffer, self._END)
        release = self._buffer[: len(self._buffer) - keep]
        if release:
            self._args += release
            self._emit(out, ToolCallDelta(self._index + 1, arguments=release))
            self._buffer = self._buffer[len(release) :]

    def _close_call(self, out: list) -> None:
        try:
            key = call_key(self._name, json.loads(self._args))
        except json.JSONDecodeError:
            key = self._name + "\x00" + self._args
        held, self._held = self._held, None
        if key in self._keys:
            self.duplicate = True  # dropped: a model repeating a call would go on repeating it
            return
        self._keys.append(key)
        self._index += 1
        self.completed += 1
        self.ids.append(self._id)
        out.extend(held or ())
