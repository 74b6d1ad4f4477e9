"""``POST /v1/responses``: OpenAI's Responses API, the subset vLLM and Ollama serve, over the same engine call.

A request is read into the chat form the engine takes (:func:`parse_responses_request`): ``input`` (a string
or a list of messages, ``function_call`` and ``function_call_output`` items), ``instructions`` (a system
message first), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``tools`` (function tools),
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_schema``, ``json_object``: the
grammar guarantees the shape) and the server's extensions (``compression``, ``cache_salt``...). Nothing is
stored: ``previous_response_id`` and ``conversation`` are refused with a 400 that says to send the
conversation in ``input``. The answer is a ``response`` object (:func:`response_body`) or, streamed, its
events (:class:`ResponseEventWriter`: ``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..tools.calls import ToolCallDelta
from .protocol import CHAT_FIELDS, IGNORED, APIError, ParsedRequest, invalid, parse_chat_request, text_content

# The chat fields a Responses request may carry under its own name (or the same one), and the
# server's extensions it passes through as they are.
_RENAMED = {"max_output_tokens": "max_tokens", "text": "response_format", "input": "messages"}
_EXTENSIONS = {"compression", "reuse_segments", "recompute", "keep_texts", "seed", "stop", "ignore_eos", "min_tokens", "prompt_lookup_num_tokens", "cache_salt"}
RESPONSES_FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    *_EXTENSIONS,
}
# Accepted only with the value that asks for nothing this server does.
_NEUTRAL_RESPONSES: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "include": (None, []),
    "reasoning": (None, {}),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),
}
_STATELESS = "this server stores no responses or conversations; send the whole conversation in input"
_CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def parse_responses_request(body: Any) -> ParsedRequest:
    """A Responses request as the engine's chat request (``kind == "responses"``); 400s name the Responses field."""
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    _check_responses_fields(body)
    chat = {key: value for key, value in body.items() if key in RESPONSES_FIELDS and key not in ("input", "instructions", "tools", "tool_choice", "text")}
    chat = {_RENAMED.get(key, key): value for key, value in chat.items()}
    chat["messages"] = input_messages(body.get("input"), body.get("instructions"))
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat["response_format"] = chat_response_format(body["text"])
    try:
        request = parse_chat_request(chat)
    except APIError as exc:
        raise _in_responses_terms(exc) from None
    request.kind = "responses"
    request.include_usage = True  # response.completed always carries the usage
    return request


def _check_responses_fields(body: Mapping[str, Any]) -> None:
    for key, value in body.items():
        if key in RESPONSES_FIELDS or key in IGNORED:
            continue
        if key in ("previous_response_id", "conversation"):
            if value is None:
                continue
            raise invalid(f"{key} is not supported: {_STATELESS}", key, "unsupported_parameter")
        if key in _NEUTRAL_RESPONSES:
            if value not in _NEUTRAL_RESPONSES[key]:
                raise invalid(f"{key}={value!r} is not supported by this server; leave it unset", key, "unsupported_parameter")
            continue
        if key in CHAT_FIELDS:
            raise invalid(f"{key} is a Chat Completions field; the Responses API names it otherwise (see the API reference)", key, "unrecognized_argument")
        raise invalid(f"Unrecognized request argument supplied: {key}", key, "unrecognized_argument")


def _in_responses_terms(exc: APIError) -> APIError:
    param = _CHAT_TO_RESPONSES_PARAM.get(exc.param or "", exc.param)
    message = str(exc.message)
    for chat_name, name in _CHAT_TO_RESPONSES_PARAM.items():
        message = message.replace(f"{chat_name}[", f"{name}[").replace(f"{chat_name}:", f"{name}:")
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type)


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of ``input_text``/``output_text`` parts (joined by newlines)."""
    text = text_content(content, where, kinds=("input_text", "output_text", "text"), param="input")
    if text is None:
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    return text


def input_messages(items: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """``input`` (and ``instructions``) as chat messages: consecutive ``function_call`` items become one
    assistant message's ``tool_calls``, a ``function_call_output`` a tool message."""
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}", "input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise invalid(
                f"{where} is a {kind!r} item; this server reads messages, function_call and function_call_output items", "input", "unsupported_parameter"
            )
    return messages


def chat_tools(tools: Any) -> list[Any]:
    """Responses function tools (``{"type": "function", "name", "parameters"...}``) in the chat form."""
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise invalid(f"tools[{i}] is a {kind!r} tool; this server runs function tools only", "tools", "unsupported_parameter")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "name": ...}`` in the chat form."""
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str):
        return choice
    raise invalid(f"tool_choice must be 'auto', 'none', 'required' or a function choice, got {choice!r}", "tool_choice", "unsupported_parameter")


def chat_response_format(text: Any) -> dict[str, Any]:
    """``text.format`` as the chat ``response_format``."""
    if not isinstance(text, Mapping) or set(text) - {"format", "verbosity"}:
        raise invalid("text must be an object with 'format'", "text")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, Mapping):
        raise invalid("text.format must be an object", "text")
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise invalid(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {fmt.get('type')!r}", "text")


# --------------------------------------------------------------------------- answers
def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(result) -> dict[str, Any]:
    usage = result.usage
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.stats.reused_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def _shell(request: ParsedRequest, response_id: str, created: int, model: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    c = request.constraints
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": c.get("parallel_tool_calls", True),
        "tool_choice": _responses_tool_choice(c.get("tool_choice", "auto")),
        "tools": [_responses_tool(tool) for tool in c.get("tools") or []],
        "temperature": request.sampling.get("temperature"),
        "top_p": request.sampling.get("top_p"),
        "max_output_tokens": request.max_tokens,
        "incomplete_details": None,
        "error": None,
        "store": False,
    }


def _responses_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool.get("function", {})
    return {
        "type": "function",
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        "strict": function.get("strict"),
    }


def _responses_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping):
        return {"type": "function", "name": choice.get("function", {}).get("name")}
    return choice


def _finished(body: dict[str, Any], result) -> dict[str, Any]:
    if result.finish_reason == "length":
        body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        body["status"] = "completed"
    body["usage"] = _usage(result)
    body["snapkv"] = result.stats.to_dict()
    return body


def response_body(request: ParsedRequest, response_id: str, created: int, model: str, result) -> dict[str, Any]:
    """The ``response`` object of a finished, unstreamed request."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    output = []
    if result.text or not result.tool_calls:
        output.append(_message_item(_item_id("msg"), result.text, status))
    for call in result.tool_calls:
        arguments = call.to_openai()["function"]["arguments"]
        output.append(_call_item(_item_id("fc"), call.id, call.name, arguments, "completed"))
    return _finished(_shell(request, response_id, created, model, "in_progress", output), result)


class ResponseEventWriter:
    """Server-sent events of one streamed Responses request, in the order OpenAI's clients expect:
    ``response.created``, ``response.in_progress``, per output item ``response.output_item.added``, its
    text deltas (``response.output_text.delta``) or argument deltas (``response.function_call_arguments.delta``)
    and their closing events, then ``response.completed`` (or ``incomplete``) with the whole response."""

    def __init__(self, request: ParsedRequest, response_id: str, model: str):
        self.request = request
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the output so far, in order
        self._text: dict[str, Any] | None = None  # the message item being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _response(self, status: str) -> dict[str, Any]:
        return _shell(self.request, self.id, self.created, self.model, status, [dict(item) for item in self._items])

    def opening(self) -> str:
        return self._event("response.created", response=self._response("in_progress")) + self._event(
            "response.in_progress", response=self._response("in_progress")
        )

    def piece(self, piece: Any) -> str:
        if isinstance(piece, ToolCallDelta):
            return self._call_piece(piece)
        out = ""
        if self._text is None:
            self._text = _message_item(_item_id("msg"), "", "in_progress")
            self._text["content"] = []
            self._items.append(self._text)
            index = len(self._items) - 1
            out += self._event("response.output_item.added", output_index=index, item=dict(self._text, content=[]))
            out += self._event(
                "response.content_part.added",
                item_id=self._text["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
            self._text["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        self._text["content"][0]["text"] += piece
        return out + self._event(
            "response.output_text.delta", item_id=self._text["id"], output_index=self._items.index(self._text), content_index=0, delta=piece, logprobs=[]
        )

    def _call_piece(self, piece: ToolCallDelta) -> str:
        out = self._close_text("completed")
        item = self._calls.get(piece.index)
        if item is None:
            item = _call_item(_item_id("fc"), piece.id or _item_id("call"), piece.name or "", "", "in_progress")
            self._calls[piece.index] = item
            self._items.append(item)
            out += self._event("response.output_item.added", output_index=len(self._items) - 1, item=dict(item))
        if piece.arguments:
            item["arguments"] += piece.arguments
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=self._items.index(item), delta=piece.arguments)
        return out

    def _close_text(self, status: str) -> str:
        if self._text is None:
            return ""
        item, self._text = self._text, None
        index = self._items.index(item)
        part = item["content"][0]
        item["status"] = status
        return (
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[])
            + self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part))
            + self._event("response.output_item.done", output_index=index, item=dict(item))
        )

    def closing(self, result) -> list[str]:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        out = [self._close_text(status)] if self._text is not None else []
        if not self._items:  # nothing was generated: the answer is still one (empty) message
            out.append(self.piece("") + self._close_text(status))
        for item in self._calls.values():
            item["status"] = "completed"
            index = self._items.index(item)
            out.append(
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=item["arguments"])
            )
            out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        final = _finished(self._response(status), result)
        out.append(self._event(f"response.{final['status']}", response=final))
        return out

    def error(self, exc: APIError) -> str:
        error = exc.body()["error"]
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
