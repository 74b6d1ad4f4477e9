"""The OpenAI wire format: requests validated into engine keywords, results into responses.

No HTTP here (see :mod:`.app`), so every rule can be tested on plain dicts. Requests follow
OpenAI's Chat Completions, Completions and Embeddings APIs. A field the engine cannot honour
(``n > 1``, log-probabilities, penalties, images) is one clear error, never silently ignored;
fields that only label a request (``user``, ``metadata``, ``store`` ...) are accepted and
ignored. Extensions: ``compression``, a policy spec (``"snapkv:budget=512"``, ``"full"``)
that overrides the server's default for this request; ``reuse_segments``, texts of the
prompt (the documents a client stuffed) whose K/V the server stores once and reuses at any
position later, with ``recompute`` (0-1) the share recomputed (see :mod:`snapkv_rag.reuse.blending`);
``keep_texts``, texts of the prompt (document labels) that the compression never evicts;
``prompt_lookup_num_tokens``, draft tokens looked up in the prompt per decode forward (exact,
greedy only; :mod:`snapkv_rag.engine.lookup`); vLLM's ``ignore_eos``, ``min_tokens`` and
``cache_salt`` (prompt K/V reused only between requests of one salt and one API key); ``keep_context``
(the prompt before the last user message's last paragraph compressed without it and kept, so a
follow-up over the same documents, or the conversation's next turn, reads only what it adds;
:mod:`snapkv_rag.reuse.kept_contexts`, namespaced like the prefix cache). Field types and ranges are declared as pydantic
models (:class:`CompletionFields`, :class:`ChatFields`); the first violation is one 400 naming
its field. Every response carries the engine's stats for it under ``snapkv``.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator, model_validator

from ..engine.requests import MAX_CACHE_SALT_CHARS
from ..engine.sampling import MAX_DRAFT_TOKENS
from ..errors import (
    EmptyPromptError,
    InvalidPromptError,
    PromptTooLongError,
    SnapKVRagError,
    StructuredOutputError,
)
from ..tools.calls import ToolCallDelta


class APIError(Exception):
    """An error response: HTTP ``status``, OpenAI's ``{"error": {...}}`` body and any ``headers``
    (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# The engine's argument names that the wire spells otherwise.
_WIRE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def prompt_param(kind: str) -> str:
    """The request field that holds a ``kind`` request's prompt (``"chat"``, ``"completion"`` or ``"responses"``)."""
    return {"chat": "messages", "responses": "input"}.get(kind, "prompt")


def from_engine_error(exc: BaseException, kind: str = "chat") -> APIError:
    """The engine's own input errors, as 400s naming the field at fault (the error's ``param``);
    anything else is a 500."""
    if isinstance(exc, APIError):  # already the answer (from a Ray Serve replica, say)
        return exc
    prompt_field = prompt_param(kind)
    if isinstance(exc, PromptTooLongError):
        return invalid(str(exc), prompt_field, "context_length_exceeded")
    if isinstance(exc, (EmptyPromptError, InvalidPromptError)):
        return invalid(str(exc), prompt_field)
    if isinstance(exc, SnapKVRagError):
        param = _WIRE_NAMES.get(exc.param, exc.param) if exc.param is not None else None
        message = str(exc)
        for engine_name, wire_name in _WIRE_NAMES.items():  # the names the client sent
            message = message.replace(engine_name, wire_name)
        # an output that failed (cut off by max_tokens) names no field
        return invalid(message, param, "structured_output_error" if isinstance(exc, StructuredOutputError) else None)
    if isinstance(exc, RecursionError):
        return invalid("the request is nested too deeply")
    # A bug, not bad input: the client gets an id to quote, the log gets the exception (its text
    # may hold a prompt's words, a path or another request's state, so it stays out of the answer).
    incident = f"error-{uuid.uuid4().hex[:16]}"
    logging.getLogger("snapkv_rag.server").error("%s: %s", incident, type(exc).__name__, exc_info=exc)
    return APIError(500, f"the server failed on this request; its log has the details under {incident}", type="server_error", code=incident)


# Labels of a request that change nothing in what the engine computes.
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
# Fields the engine cannot honour: accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
_WHY = {
    "n": "one choice per request is supported; send n requests (or use different seeds)",
    "functions": "the deprecated 'functions' API is not supported; use 'tools'",
    "function_call": "the deprecated 'function_call' is not supported; use 'tool_choice'",
}


def _check_fields(body: Mapping[str, Any], accepted: set[str]) -> None:
    for key in body:
        if key in accepted or key in IGNORED:
            continue
        if key in _NEUTRAL:
            neutral = _NEUTRAL[key]
            allowed = neutral if isinstance(neutral, tuple) else (None, neutral)
            if body[key] not in allowed:
                raise invalid(f"{key}={body[key]!r} is not supported by this server: {_WHY.get(key, 'leave it unset')}", key, "unsupported_parameter")
            continue
        raise invalid(f"Unrecognized request argument supplied: {key}", key, "unrecognized_argument")


@dataclass
class ParsedRequest:
    """What a completion request asks the engine for."""

    kind: str  # "chat", "completion" or "responses" (a chat request answered as a Responses API response)
    model: str
    prompt: Any  # messages (chat) or a string (completion)
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, stop, seed, ignore_eos, min_new_tokens, reuse_segments, recompute
    max_tokens: int | None = None
    constraints: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, parallel_tool_calls, response_format
    compression: str | None = None  # the request's own spec, or None for the server's default

    def engine_kwargs(self, max_new_tokens: int, compression: Any) -> dict[str, Any]:
        chat = {"chat": False} if self.kind == "completion" else {}
        return {"max_new_tokens": max_new_tokens, "compression": compression, **self.sampling, **self.constraints, **chat}


_COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "compression",
    "reuse_segments",
    "recompute",
    "keep_texts",
    "ignore_eos",
    "min_tokens",  # vLLM's extensions, which benchmark clients send
    "prompt_lookup_num_tokens",
    "cache_salt",  # vLLM's: prompt K/V reused only between requests with the same salt (and API key)
    "keep_context",
}
MAX_REUSE_SEGMENTS = 1024
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt"}


# --------------------------------------------------------------------------- request models
Number = StrictFloat  # ints are accepted, booleans and strings are not


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


class CompletionFields(BaseModel):
    """The fields of ``/v1/completions`` (and, with :class:`ChatFields`, of chat): OpenAI's, this
    server's extensions (``compression``, ``reuse_segments``, ``recompute``, ``keep_texts``) and vLLM's
    (``ignore_eos``, ``min_tokens``). Unknown and unsupported fields are refused before this
    (:func:`_check_fields`), with OpenAI's codes."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr = Field(min_length=1)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    compression: StrictStr | None = None  # a policy spec such as 'snapkv:budget=1024' or 'full'
    reuse_segments: list[StrictStr] | None = Field(default=None, max_length=MAX_REUSE_SEGMENTS)
    recompute: Number | None = Field(default=None, ge=0, le=1)
    keep_texts: list[StrictStr] | None = Field(default=None, max_length=MAX_REUSE_SEGMENTS)
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    prompt_lookup_num_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's: reuse only within the salt
    keep_context: StrictBool | None = None  # compress the prompt before its last paragraph once, keep it for follow-ups

    @field_validator("temperature", "top_p", "recompute", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, stop: Any) -> Any:
        if stop is not None and not isinstance(stop, (str, list)):
            raise ValueError("stop must be a non-empty string or a list of at most 4 of them")
        return stop

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (not all(stops) or len(stops) > 4):
            raise ValueError("stop must be a non-empty string or a list of at most 4 of them")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        return self

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling keywords this request sets."""
        out: dict[str, Any] = {}
        for key in ("temperature", "top_p", "recompute"):
            if getattr(self, key) is not None:
                out[key] = float(getattr(self, key))
        for key in ("stop", "seed", "reuse_segments", "keep_texts", "cache_salt"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.keep_context:
            out["keep_context"] = True
        if self.min_tokens is not None:
            out["min_new_tokens"] = self.min_tokens
        if self.prompt_lookup_num_tokens:
            out["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        return out


class ChatFields(CompletionFields):
    messages: Any = None  # checked by chat_messages (roles, ids, tool results) for OpenAI-shaped errors
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: Any = None  # checked by the engine's tool validation (typed errors, param "tools")
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: StrictBool | None = None


_HINTS = {"model": " (GET /v1/models lists what this server serves)"}
_UNION_TAGS = {"str", "int", "float", "bool", "list[str]"}


def _validated(model: type[CompletionFields], body: Mapping[str, Any]) -> Any:
    """``body`` as ``model``; the first violation as one 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = str(error["loc"][0]) if error["loc"] else None
        # the path to the value (list indices, unknown keys), without the union member tried ("str", "list[str]")
        where = ".".join(str(part) for i, part in enumerate(error["loc"]) if i == 0 or isinstance(part, int) or part not in _UNION_TAGS)
        message = error["msg"].removeprefix("Value error, ")
        raise invalid(f"{where}: {message}" + _HINTS.get(field or "", ""), field) from None


def _common(body: Any, kind: str, accepted: set[str]) -> tuple[ParsedRequest, Any]:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    _check_fields(body, accepted)
    fields = _validated(ChatFields if kind == "chat" else CompletionFields, body)
    include_usage = bool(fields.stream_options is not None and fields.stream_options.include_usage)
    request = ParsedRequest(kind, fields.model, None, bool(fields.stream), include_usage, fields.sampling(), compression=fields.compression)
    if fields.compression is not None:
        check_request_compression(fields.compression)
    return request, fields


def check_request_compression(spec: str) -> None:
    """A request's ``compression``, parsed before anything runs: an invalid spec is a 400 here, and
    a spec naming LESS ``kernels=`` is refused before any path is opened (the file a request names
    is the server's file system; the operator picks kernels with the server's --compression)."""
    from ..compression import parse_compression
    from ..compression.less.policy import LESS

    try:
        policy = parse_compression(spec)
    except SnapKVRagError as exc:
        raise invalid(str(exc), "compression") from None
    if isinstance(policy, LESS) and policy.kernels is not None:
        raise invalid(
            "a request cannot name LESS kernels (kernels=...): they are files on the server; use less:base=...,budget=N "
            "(the kernels shipped for this model), or ask the operator to start the server with --compression less:...,kernels=PATH",
            "compression",
            "unsupported_parameter",
        )


def text_content(content: Any, where: str, *, kinds: tuple[str, ...] = ("text",), param: str = "messages") -> str | None:
    """A message's content: a string, null, or a list of text parts of ``kinds`` (joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            shown = kind if kind else type(part).__name__
            raise invalid(f"{where}.content[{j}] is a {shown!r} part; this model reads text parts only", param, "unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


# Keys an assistant reply carries that are not history (``refusal``, ``annotations``), or that
# were refused above (``function_call``, ``audio``).
_DROPPED_KEYS = {"refusal", "annotations", "function_call", "audio"}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the engine's: text parts joined, ``developer`` read as ``system``,
    response-only keys dropped, then checked by the agent memory's own message validator
    (roles, ids, call shapes); a tool result must answer a call of an earlier assistant
    message, as OpenAI requires."""
    from ..agents.messages import validate_message

    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise invalid(f"{where} must be an object with 'role' and 'content'", "messages")
        if message.get("function_call") is not None or message.get("audio") is not None:
            raise invalid(f"{where}: 'function_call' and 'audio' are not supported; use 'tool_calls'", "messages", "unsupported_parameter")
        if "metadata" in message:  # the memory's validator takes it; OpenAI messages have none
            raise invalid(f"{where} has unknown keys ['metadata']", "messages")
        if message.get("name") == "":  # OpenAI's rule; the memory allows a blank name
            raise invalid(f"{where}.name must not be empty", "messages")
        converted = {k: v for k, v in message.items() if k not in _DROPPED_KEYS and v is not None}
        if converted.get("role") == "developer":
            converted["role"] = "system"
        converted["content"] = text_content(message.get("content"), where)
        try:
            checked, _ = validate_message(converted, i)
        except InvalidPromptError as exc:
            raise invalid(str(exc), "messages") from None
        call_ids.update(call["id"] for call in checked.get("tool_calls", ()))
        if checked["role"] == "tool" and checked["tool_call_id"] not in call_ids:
            raise invalid(f"{where} is a tool result for {checked['tool_call_id']!r}, which no earlier assistant message called", "messages")
        out.append(checked)
    return out


# The most JSON text a request's tools or response_format may hold: a grammar is compiled from
# them, whose cost grows with the schema (a 0.7 MB anyOf took 7 s of CPU before its 400).
MAX_SCHEMA_CHARS = 65_536


def _check_schema_sizes(body: Any) -> None:
    if not isinstance(body, Mapping):
        return
    for key in ("tools", "response_format"):
        if body.get(key) is None:
            continue
        try:
            size = len(json.dumps(body[key], separators=(",", ":")))
        except (TypeError, ValueError, RecursionError):
            raise invalid(f"{key} is not a JSON value this server reads", key) from None
        if size > MAX_SCHEMA_CHARS:
            raise invalid(f"{key} has {size:,} characters of JSON; this server compiles at most {MAX_SCHEMA_CHARS:,}", key, "schema_too_large")


def parse_chat_request(body: Any) -> ParsedRequest:
    _check_schema_sizes(body)  # before any schema is validated or compiled
    request, fields = _common(body, "chat", CHAT_FIELDS)
    request.prompt = chat_messages(fields.messages)
    request.max_tokens = fields.max_completion_tokens if fields.max_completion_tokens is not None else fields.max_tokens
    for key in ("tools", "tool_choice", "response_format"):
        if getattr(fields, key) is not None:
            request.constraints[key] = getattr(fields, key)
    if "tool_choice" in request.constraints and not request.constraints.get("tools"):
        raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
    if fields.parallel_tool_calls is not None:
        request.constraints["parallel_tool_calls"] = fields.parallel_tool_calls
    if request.constraints.get("response_format") == {"type": "text"}:
        del request.constraints["response_format"]
    return request


def parse_completion_request(body: Any) -> ParsedRequest:
    request, fields = _common(body, "completion", COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt must be a string (or a list of one string); token-id prompts and several prompts per request are not supported", "prompt")
    request.prompt = prompt
    request.max_tokens = fields.max_tokens
    return request


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on an embeddings request's list


def parse_embedding_request(body: Any) -> tuple[str, list[str], str]:
    """``(model, texts, encoding_format)``."""
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    _check_fields(body, {"model", "input", "encoding_format", "dimensions"})
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (GET /v1/models lists what this server serves)", "model")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise invalid("input must be a string or a non-empty list of strings (token-id input is not supported)", "input")
    if any(not t.strip() for t in texts):
        raise invalid("input must not contain empty strings", "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise invalid(f"input has {len(texts)} texts; send at most {MAX_EMBEDDING_INPUTS} per request (as OpenAI)", "input", "too_many_inputs")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid(f"encoding_format must be 'float' or 'base64', got {encoding!r}", "encoding_format")
    if body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: the embedder's size is fixed", "dimensions", "unsupported_parameter")
    return model, texts, encoding


# --------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return {"chat": "chatcmpl-", "responses": "resp_"}.get(kind, "cmpl-") + uuid.uuid4().hex


def fingerprint() -> str:
    from .._version import __version__

    return f"snapkv-rag-{__version__}"


def _usage(result) -> dict[str, int]:
    return result.usage.to_dict()


def _finish_reason(result) -> str:
    return "stop" if result.finish_reason == "cancelled" else result.finish_reason


def completion_response(request: ParsedRequest, request_id: str, created: int, model: str, result) -> dict[str, Any]:
    stats = result.stats.to_dict()
    if request.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": result.text if (result.text or not result.tool_calls) else None, "refusal": None}
        if result.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in result.tool_calls]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(result)}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": _finish_reason(result)}
        kind = "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint(),
        "choices": [choice],
        "usage": _usage(result),
        "snapkv": stats,
    }


class ChunkWriter:
    """Server-sent events for one streamed request: the chunks OpenAI clients expect."""

    def __init__(self, request: ParsedRequest, request_id: str, model: str):
        self.request = request
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.chat = request.kind == "chat"
        self._calls_seen: set[int] = set()

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": fingerprint(),
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _choice(self, delta: dict[str, Any] | str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> str | None:
        """Chat streams open with the role, as OpenAI's do."""
        return self._chunk([self._choice({"role": "assistant", "content": ""})]) if self.chat else None

    def piece(self, piece: Any) -> str:
        if isinstance(piece, ToolCallDelta):
            call: dict[str, Any] = {"index": piece.index}
            if piece.index not in self._calls_seen:
                self._calls_seen.add(piece.index)
                call.update(id=piece.id, type="function", function={"name": piece.name, "arguments": piece.arguments or ""})
            else:
                call["function"] = {"arguments": piece.arguments}
            return self._chunk([self._choice({"tool_calls": [call]})])
        return self._chunk([self._choice({"content": piece} if self.chat else piece)])

    def closing(self, result) -> list[str]:
        stats = result.stats.to_dict()
        out = [self._chunk([self._choice({} if self.chat else "", _finish_reason(result))], snapkv=stats)]
        if self.request.include_usage:  # the usage chunk is then the last one: it carries the stats too
            out.append(self._chunk([], usage=_usage(result), snapkv=stats))
        out.append("data: [DONE]\n\n")
        return out

    @staticmethod
    def error(exc: APIError) -> str:
        return f"data: {json.dumps(exc.body())}\n\n"


def embedding_response(model: str, vectors: Any, encoding: str, prompt_tokens: int) -> dict[str, Any]:
    """The response body; ``vectors`` ``[n, d]`` (an array or lists). Float vectors stay numpy
    rows: :func:`json_bytes` writes them ~15x faster than ``json`` writes lists of floats."""
    import numpy as np

    array = np.asarray(vectors, dtype=np.float32)
    data = []
    for i, vector in enumerate(array):
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if encoding == "base64" else vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def json_bytes(content: Any) -> bytes:
    """``content`` as compact JSON, numpy arrays as lists (float32 at its shortest round-trip digits)."""
    import orjson

    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
