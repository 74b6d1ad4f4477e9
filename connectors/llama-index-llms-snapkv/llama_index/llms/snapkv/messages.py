"""Translation between LlamaIndex chat types and the engine's OpenAI-shaped messages and results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json

from snapkv_rag import GenerationResult
from snapkv_rag.errors import InvalidPromptError

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}


def _call_dict(block: ToolCallBlock) -> dict[str, Any]:
    return {
        "id": block.tool_call_id or "",
        "type": "function",
        "function": {"name": block.tool_name, "arguments": block.tool_kwargs},
    }


def to_engine_message(message: ChatMessage, index: int = 0) -> dict[str, Any]:
    """One LlamaIndex message as ``{"role", "content", ["tool_calls"], ["tool_call_id"], ["name"]}``.

    Text blocks are joined with newlines; :class:`ToolCallBlock` s (or OpenAI-style
    ``additional_kwargs["tool_calls"]``) become ``tool_calls``; a tool message's
    ``additional_kwargs["tool_call_id"]`` (and ``name``) are kept. Images, audio and other
    non-text blocks raise :class:`InvalidPromptError` (the engine is text-only).
    """
    role = _ROLES.get(MessageRole(message.role))
    if role is None:
        raise InvalidPromptError(f"message {index} has role {message.role!r}, which the engine cannot render")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append(_call_dict(block))
        elif isinstance(block, ThinkingBlock):
            continue
        else:
            raise InvalidPromptError(f"message {index} has a {block.block_type!r} block; the engine takes text only")
    if not calls and message.additional_kwargs.get("tool_calls"):
        calls = [dict(c) for c in message.additional_kwargs["tool_calls"]]
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if calls and role == "assistant":
        out["tool_calls"] = calls
    if role == "tool":
        call_id = message.additional_kwargs.get("tool_call_id")
        if call_id:
            out["tool_call_id"] = call_id
        name = message.additional_kwargs.get("name") or message.additional_kwargs.get("tool_name")
        if isinstance(name, str) and name:
            out["name"] = name
    return out


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [to_engine_message(m, i) for i, m in enumerate(messages)]


def from_engine_message(message: dict[str, Any]) -> ChatMessage:
    """An engine/agent-memory message back as a LlamaIndex :class:`ChatMessage`."""
    blocks: list[Any] = [TextBlock(text=message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        blocks.append(ToolCallBlock(tool_call_id=call.get("id"), tool_name=fn["name"], tool_kwargs=arguments))
    extra: dict[str, Any] = {}
    if message.get("tool_call_id"):
        extra["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        extra["name"] = message["name"]
    return ChatMessage(role=MessageRole(message["role"]), blocks=blocks, additional_kwargs=extra)


def result_summary(result: GenerationResult) -> dict[str, Any]:
    """The compact per-call report put in ``additional_kwargs``: usage, finish reason, compression."""
    stats = result.stats
    return {
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "total_tokens": result.usage.total_tokens,
        "compression": stats.compression,
        "kept_tokens_per_layer": list(stats.kept_tokens_per_layer),
        "compression_ratio": stats.compression_ratio,
        "prompt_kv_bytes_kept": stats.prompt_kv_bytes_kept,
        "prompt_kv_bytes_full": stats.prompt_kv_bytes_full,
        "reused_prompt_tokens": getattr(stats, "reused_prompt_tokens", getattr(result, "reused_prompt_tokens", None)),
        "context_reuse": getattr(stats, "context_reuse", None),
        "prefill_seconds": stats.prefill_seconds,
        "decode_ms_per_token": stats.decode_ms_per_token,
    }


def _openai_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id or "", "type": "function", "function": {"name": name, "arguments": text}}


def assistant_message(text: str, calls: Sequence[tuple[str | None, str, Any]] = ()) -> ChatMessage:
    """An assistant message: a text block, then one :class:`ToolCallBlock` per ``(id, name, arguments)``.

    The calls are also in ``additional_kwargs["tool_calls"]`` (OpenAI-shaped): core's streamed
    structured outputs (``FunctionCallingProgram.stream_call``) look for tool calls only there.
    """
    blocks: list[Any] = [TextBlock(text=text)]
    blocks += [ToolCallBlock(tool_call_id=cid, tool_name=name, tool_kwargs=args) for cid, name, args in calls]
    extra = {"tool_calls": [_openai_call(*call) for call in calls]} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def result_message(result: GenerationResult) -> ChatMessage:
    return assistant_message(result.text, [(c.id, c.name, c.arguments) for c in result.tool_calls])


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """Every tool call of ``message``; arguments still streaming (a JSON prefix) are parsed partially."""
    calls = [(b.tool_call_id, b.tool_name, b.tool_kwargs) for b in message.blocks if isinstance(b, ToolCallBlock)]
    if not calls:
        for c in message.additional_kwargs.get("tool_calls") or []:
            fn = c.get("function", c)
            calls.append((c.get("id"), fn.get("name"), fn.get("arguments", {})))
    return [ToolSelection(tool_id=call_id or "", tool_name=name, tool_kwargs=_arguments_dict(arguments)) for call_id, name, arguments in calls]


def _arguments_dict(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a dict: JSON text parsed (partially while it streams), anything else {}."""
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            try:
                arguments = parse_partial_json(text)
            except (ValueError, json.JSONDecodeError):
                arguments = {}
    return arguments if isinstance(arguments, dict) else {}
