"""``SnapKVLLM``: a LlamaIndex ``FunctionCallingLLM`` over :class:`snapkv_rag.Engine`.

Every method calls the engine's own generation path (``generate``/``stream``/``agenerate``/
``astream``); this module only translates LlamaIndex's types onto the engine's and back.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, cast

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent, LLMStructuredPredictStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import process_streaming_objects
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.tools import BaseTool, FunctionTool
from llama_index.core.types import PydanticProgramMode

from snapkv_rag import Engine, GenerationResult, ToolCallDelta
from snapkv_rag.errors import PromptTooLongError
from snapkv_rag.integrations import as_policy, can_roll, check_kv_reuse, resolve_kv_reuse, reuse_kwargs, segment_store_at, shared_engine

from .messages import assistant_message, result_message, result_summary, to_engine_messages, tool_selections

dispatcher = get_dispatcher(__name__)


def response_format_for(output_cls: type[BaseModel]) -> dict[str, Any]:
    """The engine's ``response_format`` for a pydantic class (its JSON Schema, strict)."""
    return {"type": "json_schema", "json_schema": {"name": output_cls.__name__, "schema": output_cls.model_json_schema(), "strict": True}}


def as_tool(tool: BaseTool | Callable[..., Any]) -> BaseTool:
    """A LlamaIndex tool, or a plain function made one (as FunctionAgent does with its tools)."""
    return tool if isinstance(tool, BaseTool) else FunctionTool.from_defaults(fn=tool)


def engine_tool_choice(tool_choice: Any, tool_required: bool) -> str | dict[str, Any]:
    """LlamaIndex's ``tool_choice``/``tool_required`` as the engine's ``tool_choice``."""
    if tool_choice == "any":  # Anthropic's and Bedrock's spelling of "required"
        tool_choice = "required"
    if tool_choice is None or tool_choice == "auto":
        return "required" if tool_required else "auto"
    if tool_choice == "none":
        if tool_required:
            raise ValueError("tool_required=True asks for a tool call, tool_choice='none' forbids one")
        return tool_choice
    if isinstance(tool_choice, str) and tool_choice != "required":
        return {"type": "function", "function": {"name": tool_choice}}
    return tool_choice


class _StreamState:
    """Accumulates streamed text pieces and tool-call deltas into LlamaIndex messages."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[list[Any]] = []  # [id, name, arguments text so far]

    def add(self, piece: str | ToolCallDelta) -> str:
        if isinstance(piece, ToolCallDelta):
            while len(self.calls) <= piece.index:
                self.calls.append([None, "", ""])
            call = self.calls[piece.index]
            if piece.id is not None:
                call[0] = piece.id
            if piece.name is not None:
                call[1] = piece.name
            call[2] += piece.arguments
            return ""
        self.text += piece
        return piece

    def message(self) -> ChatMessage:
        return assistant_message(self.text, [tuple(c) for c in self.calls])

    def chunk(self, delta: str, piece: Any) -> ChatResponse:
        raw = {"tool_call_delta": piece.to_dict()} if isinstance(piece, ToolCallDelta) else None
        return ChatResponse(message=self.message(), delta=delta, raw=raw)


class SnapKVLLM(FunctionCallingLLM):
    """A local model with a SnapKV-compressed KV cache, as a LlamaIndex function-calling LLM.

    ``SnapKVLLM(engine)`` wraps an existing :class:`~snapkv_rag.Engine`;
    ``SnapKVLLM(model="default")`` loads
    (once per model, device, dtype and prefix-cache bound, then shared) the embedded
    SmolLM2-135M-Instruct or any model path / hub id. ``compression`` is the default policy of
    every call (``"default"``: the toolkit's one default compression, ``snapkv_rag.compression.DEFAULT_COMPRESSION``;
    None or ``"full"``: the full cache) and can be overridden per call with ``compression=...``.
    A prompt past the model's window is read rolled where the policy can roll (the one rule).
    Each response carries the engine's full result (``raw``: text, tool
    calls, usage, stats) and a compact report in ``additional_kwargs`` (kept tokens per
    layer, compression ratio, prompt/completion tokens, reused prefix tokens).
    """

    model: str = Field(default="default", description="Model name, path or hub id ('default' = embedded SmolLM2).")
    compression: Any = Field(
        default="default", description="Default compression policy or spec string ('default': the toolkit's one default); None = full cache."
    )
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens to generate per call (num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy.")
    context_window: int = Field(default=0, description="Prompt + output tokens per call; default: the model's context.")
    prefix_cache_bytes: int | None = Field(default=None, description="Prefix-cache bound of a loaded engine (None = engine default).")
    device: str | None = Field(default=None)
    dtype: str | None = Field(default=None)
    prompt_lookup_num_tokens: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Draft tokens looked up in the prompt per decode forward (0: off); greedy output unchanged, "
        "fewer forwards when answers copy the retrieved text.",
    )
    generate_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other engine options (top_p, stop, seed).")
    keep_context: bool = Field(
        default=False,
        description="Compress the prompt before its question once, without the question, and keep it: a follow-up over "
        "the same documents or chat history (a chat engine's next turn) reads only what it adds (the engine's keep_context; "
        "node K/V reuse is then off). Question-agnostic policies (expected:, kvzip:) suit it.",
    )
    kv_reuse: str | None = Field(
        default=None,
        description="'chunks': nodes a TokenBudgetPostprocessor (or SnapKVMemory) offered are reused as stored K/V wherever "
        "they sit in a prompt; 'prefix': only an identical prompt prefix; 'off': every prompt prefilled whole; "
        "None: the engine's recommended_kv_reuse ('chunks'; 'prefix' for the embedded model).",
    )
    kv_dir: str | None = Field(default=None, description="Where chunk K/V are stored (None: the engine's memory).")

    _engine: Engine = PrivateAttr()

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        model: str = "default",
        compression: Any = "default",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        context_window: int | None = None,
        prefix_cache_bytes: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        callback_manager: CallbackManager | None = None,
        **kwargs: Any,
    ) -> None:
        if engine is None:
            engine = shared_engine(model, device=device, dtype=dtype, prefix_cache_bytes=prefix_cache_bytes)
        elif prefix_cache_bytes is not None or device is not None or dtype is not None:
            raise ValueError("prefix_cache_bytes, device and dtype configure a loaded engine; set them on the Engine you pass")
        else:
            model = engine.name
        policy = as_policy(compression)  # an invalid spec fails here, not at the first call
        check_kv_reuse(kwargs.get("kv_reuse"))
        limit = engine.context_length
        if context_window is None:
            context_window = limit or 4096
        elif context_window <= max_new_tokens or (limit is not None and context_window > limit and not can_roll(policy)):
            raise ValueError(
                f"context_window={context_window} must exceed max_new_tokens={max_new_tokens} and be at most the model's {limit} "
                "(or the compression is a sparse policy, which reads prompts past the window a chunk at a time: rolling=)"
            )
        super().__init__(
            model=model,
            compression=compression,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            context_window=context_window,
            prefix_cache_bytes=prefix_cache_bytes,
            device=device,
            dtype=dtype,
            generate_kwargs=dict(generate_kwargs or {}),
            callback_manager=callback_manager,
            **kwargs,
        )
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "SnapKVLLM"

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._engine.name,
            system_role=MessageRole.SYSTEM,
        )

    # ------------------------------------------------------------------ token counting
    def tokenize(self, text: str) -> list[int]:
        """The LLM's tokens of plain ``text`` (no special tokens); usable as ``Settings.tokenizer``."""
        return self._engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    # ------------------------------------------------------------------ the engine call
    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        options: dict[str, Any] = {"compression": self.compression, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature}
        if self.keep_context:
            options["keep_context"] = True
        else:
            options.update(reuse_kwargs(resolve_kv_reuse(self.kv_reuse, self._engine), "offered", segment_store_at(self.kv_dir)))
        if self.prompt_lookup_num_tokens:
            options["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        options.update(self.generate_kwargs)
        kwargs = dict(kwargs)
        if "max_tokens" in kwargs:
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        for key in ("formatted", "allow_parallel_tool_calls", "tool_required", "verbose"):
            kwargs.pop(key, None)
        if not kwargs.get("tools"):
            kwargs.pop("tools", None)
            kwargs.pop("tool_choice", None)
            kwargs.pop("parallel_tool_calls", None)
        options.update(kwargs)
        return options

    def _check_window(self, prompt: Any, options: dict[str, Any]) -> None:
        """Enforce ``context_window`` when it is set below the model's own context."""
        limit = self._engine.context_length
        if limit is not None and self.context_window == limit:
            return  # the engine enforces its own context
        n = self._engine.count_tokens(prompt, chat=options.get("chat"), tools=options.get("tools"))
        if n + options["max_new_tokens"] > self.context_window:
            raise PromptTooLongError(n, options["max_new_tokens"], self.context_window)

    def _prompt_for(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        return to_engine_messages(self._extend_messages(list(messages)))

    @staticmethod
    def _chat_response(result: GenerationResult) -> ChatResponse:
        return ChatResponse(message=result_message(result), raw=result.to_dict(), additional_kwargs=result_summary(result))

    # ------------------------------------------------------------------ chat (the engine's calls)
    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, options = self._prompt_for(messages), self._options(kwargs)
        self._check_window(prompt, options)
        return self._chat_response(self._engine.generate(prompt, **options))

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, options = self._prompt_for(messages), self._options(kwargs)
        self._check_window(prompt, options)
        stream = self._engine.stream(prompt, **options)

        def gen() -> ChatResponseGen:
            state = _StreamState()
            try:
                for piece in stream:
                    yield state.chunk(state.add(piece), piece)
                final = self._chat_response(stream.result)
                yield ChatResponse(message=final.message, raw=final.raw, additional_kwargs=final.additional_kwargs, delta="")
            finally:
                stream.close()  # a consumer that stops early cancels generation

        return gen()

    async def _achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, options = self._prompt_for(messages), self._options(kwargs)
        self._check_window(prompt, options)
        return self._chat_response(await self._engine.agenerate(prompt, **options))

    async def _astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, options = self._prompt_for(messages), self._options(kwargs)
        self._check_window(prompt, options)
        stream = self._engine.astream(prompt, **options)

        async def gen() -> ChatResponseAsyncGen:
            state = _StreamState()
            try:
                async for piece in stream:
                    yield state.chunk(state.add(piece), piece)
                final = self._chat_response(stream.result)
                yield ChatResponse(message=final.message, raw=final.raw, additional_kwargs=final.additional_kwargs, delta="")
            finally:
                await stream.aclose()  # a consumer that stops early cancels generation

        return gen()

    # ------------------------------------------------------------------ public: chat, and completion derived from it
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, **kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, **kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return await self._astream_chat(messages, **kwargs)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self._chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self._stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self._achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self._astream_chat)(prompt, **kwargs)

    # ------------------------------------------------------------------ tools
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool | Callable[..., Any]],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``tools`` as OpenAI function specs for the engine's constrained tool calling.

        ``tool_choice``: ``"auto"``, ``"required"`` (or ``"any"``), ``"none"``, a tool name (that
        tool is forced) or an OpenAI choice mapping. ``tool_required=True`` makes the grammar
        force a call: ``"required"`` unless a tool is named.
        """
        specs = [as_tool(tool).metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if specs:
            out.update(tools=specs, tool_choice=engine_tool_choice(tool_choice, tool_required), parallel_tool_calls=allow_parallel_tool_calls)
        return out

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any) -> list[ToolSelection]:
        """The response's tool calls; a streamed chunk's unfinished arguments are parsed partially."""
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none (finish_reason {response.additional_kwargs.get('finish_reason')!r})")
        return selections

    # ------------------------------------------------------------------ structured output
    def _decodes_structure(self) -> bool:
        """Structured outputs are decoded under their JSON Schema unless another program mode was asked for."""
        return self.pydantic_program_mode == PydanticProgramMode.DEFAULT

    def _structured_chat_args(self, output_cls: type[BaseModel], prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> dict[str, Any]:
        return {"messages": prompt.format_messages(llm=self, **prompt_args), "response_format": response_format_for(output_cls)}

    @staticmethod
    def _structured_result(output_cls: type[BaseModel], response: ChatResponse) -> BaseModel:
        return output_cls.model_validate(cast(dict[str, Any], response.raw)["parsed"])

    @dispatcher.span
    def structured_predict(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        """An ``output_cls`` instance decoded under its JSON Schema (the engine's ``response_format``)."""
        if not self._decodes_structure():
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        response = self.chat(**self._structured_chat_args(output_cls, prompt, prompt_args), **(llm_kwargs or {}))
        result = self._structured_result(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        if not self._decodes_structure():
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        response = await self.achat(**self._structured_chat_args(output_cls, prompt, prompt_args), **(llm_kwargs or {}))
        result = self._structured_result(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    # stream_structured_predict and astream_structured_predict (core's, with their events) read these two
    def _structured_stream_call(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Generator[Any, None, None]:
        if not self._decodes_structure():
            return super()._structured_stream_call(output_cls, prompt, llm_kwargs, **prompt_args)  # type: ignore[arg-type]
        chunks = self.stream_chat(**self._structured_chat_args(output_cls, prompt, prompt_args), **(llm_kwargs or {}))
        return _streamed_objects(output_cls, chunks)

    async def _structured_astream_call(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> AsyncGenerator[Any, None]:
        if not self._decodes_structure():
            return await super()._structured_astream_call(output_cls, prompt, llm_kwargs, **prompt_args)  # type: ignore[arg-type]
        chunks = await self.astream_chat(**self._structured_chat_args(output_cls, prompt, prompt_args), **(llm_kwargs or {}))
        return _astreamed_objects(output_cls, chunks)


def _partial_object(output_cls: type[BaseModel], chunk: ChatResponse, current: BaseModel | None) -> BaseModel:
    """The object so far from a chunk's unfinished JSON (fields not yet written are None)."""
    return process_streaming_objects(chunk, output_cls, cur_objects=[current] if current is not None else None)  # type: ignore[return-value]


def _streamed_objects(output_cls: type[BaseModel], chunks: ChatResponseGen) -> Generator[BaseModel, None, None]:
    """A partial object per streamed piece, then the engine's validated ``parsed`` value as ``output_cls``."""
    current = None
    for chunk in chunks:
        if chunk.raw is not None and "parsed" in chunk.raw:
            yield output_cls.model_validate(chunk.raw["parsed"])
        elif chunk.delta:
            current = _partial_object(output_cls, chunk, current)
            yield current


async def _astreamed_objects(output_cls: type[BaseModel], chunks: ChatResponseAsyncGen) -> AsyncGenerator[BaseModel, None]:
    current = None
    async for chunk in chunks:
        if chunk.raw is not None and "parsed" in chunk.raw:
            yield output_cls.model_validate(chunk.raw["parsed"])
        elif chunk.delta:
            current = _partial_object(output_cls, chunk, current)
            yield current
