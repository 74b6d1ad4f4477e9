"""A call checked and rendered before any model work: typed errors only.

Everything :meth:`~snapkv_rag.engine.engine.Engine.stream`, ``generate``, ``generate_batch``
and ``score`` take is validated here and turned into a :class:`~.requests.Request`: the rendered
rows (within the context), sampling, the policy per row, output specs and their compiled
grammars, segment reuse, attention spans and protected texts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..compression import CompressionPolicy, as_policy, fit_to_window
from ..compression.kvzip import REPEAT_PROMPT
from ..compression.runtime import attention_kernel, sliding_layers
from ..errors import EmptyPromptError, InvalidCompressionError, InvalidGenerationParameterError, InvalidPromptError, PromptTooLongError
from ..model.placement import spans_devices
from ..reuse.blending import DEFAULT_RECOMPUTE, RopeShift, SegmentRequest, SegmentReuseUnsupported, segment_anchor
from ..reuse.offered import OFFERED
from ..reuse.prefix_cache import default_prefix_cache_bytes, reuse_tail
from ..reuse.segment_store import SegmentKVStore
from ..tools.call_gate import CallGate, gated
from ..tools.calls import TEXT, OutputSpec
from .prompts import PromptLike, question_tail_tokens, render_prompt, segment_spans, text_token_spans
from .requests import Request, checked_cache_salt, length_buckets, output_specs
from .sampling import GenerationParams

Compression = CompressionPolicy | str | None  # a policy, a spec string, or None for the full cache
OUTPUT_KEYS = ("tools", "tool_choice", "response_format", "parallel_tool_calls", "max_tool_calls")
SEGMENT_KEYS = ("reuse_segments", "segment_store", "recompute")
ATTEND_KEY = "attend_to"
KEEP_KEY = "keep_texts"
SALT_KEY = "cache_salt"
KEEP_CONTEXT_KEY = "keep_context"


def salted_signature(signature: str, salt: str | None) -> str:
    """The chunk store's namespace for ``salt``: the model's signature, or a folder of its own per salt."""
    if salt is None:
        return signature
    return f"{signature}-{hashlib.sha256(salt.encode()).hexdigest()[:16]}"


class EngineLike(Protocol):
    """What preparing a call reads of the engine (:class:`~snapkv_rag.engine.engine.Engine`)."""

    model: Any
    tokenizer: Any
    call_gate: CallGate | None
    segment_store: SegmentKVStore

    @property
    def context_length(self) -> int | None: ...

    @property
    def grammar_tokenizer(self) -> Any: ...

    @property
    def signature(self) -> str: ...

    def rope_shift(self, *, sliding: bool = False) -> RopeShift: ...


def check_rolls(engine: EngineLike) -> None:
    """What a rolling prefill needs of the model: a layer the policy compresses (not every layer a
    sliding window's), and a rotary embedding that moves kept keys (:class:`~snapkv_rag.reuse.blending.RopeShift`)."""
    if all(sliding_layers(engine.model.config)):
        raise InvalidCompressionError("rolling= needs full-attention layers to compress, and every layer of this model keeps a sliding window")
    if spans_devices(engine.model):
        raise InvalidCompressionError("rolling= runs on one device, and this model's layers are spread over several (device_map); read the prompt whole")
    try:
        engine.rope_shift(sliding=True)
    except SegmentReuseUnsupported as exc:
        raise InvalidCompressionError(f"rolling= moves kept keys with the model's rotary embedding, and here it cannot: {exc}") from None


def checked_prefill_chunk_tokens(value: int | None, device: torch.device) -> int:
    """The engine's ``prefill_chunk_tokens``: None for the device's default (2048 on a GPU, 512 on a CPU)."""
    if value is None:
        return 2048 if device.type == "cuda" else 512
    if isinstance(value, bool) or not isinstance(value, int) or not (value == 0 or value >= 16):
        raise ValueError(f"prefill_chunk_tokens must be 0 (whole prompts) or an integer >= 16, got {value!r}")
    return value


def checked_prefix_cache_bytes(value: int | None, device: torch.device) -> int:
    """The engine's ``prefix_cache_bytes``: None for the device's default, 0 disables."""
    if value is None:
        return default_prefix_cache_bytes(device)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefix_cache_bytes must be an integer >= 0 (0 disables) or None, got {value!r}")
    return value


def render_within_context(
    engine: EngineLike,
    prompts: Sequence[PromptLike],
    chat: bool | None,
    new_tokens: int,
    specs: Sequence[OutputSpec] | None = None,
    policy: CompressionPolicy | None = None,
) -> tuple[list[list[int]], CompressionPolicy | None]:
    """Token ids of each prompt and the policy they are read with: rolled past the window where the
    longest does not fit and the policy can roll (:func:`~snapkv_rag.compression.fit_to_window`, the one
    rule). Raises when a prompt plus ``new_tokens`` still exceeds the context (under ``rolling=`` a
    prompt takes at most ``budget + rolling + window`` positions, whatever its length)."""
    specs = specs or [TEXT] * len(prompts)
    rows = [render_prompt(engine.tokenizer, p, chat=chat, tools=s.tools if s.renders_tools else ()) for p, s in zip(prompts, specs)]
    if not rows:
        raise EmptyPromptError("no prompts given")
    limit = engine.context_length
    policy = fit_to_window(policy, max(len(row) for row in rows), new_tokens, limit)
    for row in rows:
        positions = policy.prompt_positions(len(row)) if policy is not None else len(row)
        if limit is not None and positions + new_tokens > limit:
            raise PromptTooLongError(len(row), new_tokens, limit, positions if policy is not None and policy.rolling is not None else None)
    return rows, policy


def prepare_request(
    engine: EngineLike,
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
    salt = checked_cache_salt(sampling.pop(SALT_KEY, None))
    reuse = {k: sampling.pop(k) for k in SEGMENT_KEYS if k in sampling}
    attend_to = sampling.pop(ATTEND_KEY, None)
    keep_texts = sampling.pop(KEEP_KEY, None)
    keep_context = sampling.pop(KEEP_CONTEXT_KEY, False)
    if keep_context:
        check_keep_context(keep_context, per_row, reuse, attend_to, keep_texts)
    for key, value in ((ATTEND_KEY, attend_to), (KEEP_KEY, keep_texts)):
        if per_row and value is not None:
            raise InvalidGenerationParameterError(f"{key} applies to one prompt (generate/stream), not generate_batch", param=key)
    if per_row and reuse.get("reuse_segments") is not None:
        raise InvalidGenerationParameterError("reuse_segments applies to one prompt (generate/stream), not generate_batch", param="reuse_segments")
    options = {k: v for k, v in sampling.items() if k in OUTPUT_KEYS}
    params = GenerationParams.build(**{k: v for k, v in sampling.items() if k not in OUTPUT_KEYS})
    specs = output_specs(len(prompts), options, per_row=per_row)
    if params.ignore_eos and any(s.constrained for s in specs):
        raise InvalidGenerationParameterError("ignore_eos cannot be combined with tools or response_format", param="ignore_eos")
    if params.min_new_tokens and any(s.constrained for s in specs):
        raise InvalidGenerationParameterError("min_new_tokens cannot be combined with tools or response_format", param="min_new_tokens")
    policy = as_policy(compression)
    rows, policy = render_within_context(engine, prompts, chat, params.max_new_tokens, specs, policy)
    if policy is not None and policy.rolling is not None:
        check_rolls(engine)
        if keep_texts is not None:
            raise InvalidGenerationParameterError("keep_texts does not combine with rolling= (kept texts would move with every chunk)", param=KEEP_KEY)
    row_policies = resolve_policy(engine, policy, prompts, chat, questions, specs)
    context_tokens = context_policy = None
    if keep_context:
        question = (questions or [None])[0]
        context_tokens, context_policy = context_split(engine, prompts[0], rows[0], chat, specs[0], policy if keep_context is True else keep_context, question)
        if keep_context is True:
            row_policies = None  # the question is read over the kept context whole
        elif policy is not None and policy.repeats_context:
            raise InvalidCompressionError(f"{policy.name} compresses a kept context: give it as keep_context, not as the question's compression")
    elif policy is not None and policy.repeats_context:
        raise InvalidCompressionError(f"{policy.name} scores a context by the model's repeat of it: ask with keep_context=True")
    row_policy = row_policies[0] if isinstance(row_policies, list) else row_policies
    segments, note = segment_request(engine, prompts[0], rows[0], chat, specs[0], row_policy, reuse, salt) if reuse else (None, None)
    attention, attention_note = attention_spans(engine, prompts[0], rows[0], chat, specs[0], attend_to)
    protected = protected_spans(engine, prompts[0], rows[0], chat, specs[0], keep_texts)
    constraint = grammar(engine, specs, params.max_new_tokens)
    redo = None
    if engine.call_gate is not None and not per_row and len(prompts) == 1 and gated(specs[0]):
        # sampling has lost the segment and attention keys above; put them back for the second preparation
        kept = ((ATTEND_KEY, attend_to), (KEEP_KEY, keep_texts), (SALT_KEY, salt), (KEEP_CONTEXT_KEY, keep_context or None))
        again = {**sampling, **reuse, **{k: v for k, v in kept if v is not None}}

        def redo(tool_choice: Any) -> Request:
            return prepare_request(engine, prompts, compression, chat, {**again, "tool_choice": tool_choice}, questions, prefix_cache=prefix_cache)

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
        attention,
        attention_note,
        protected,
        salt,
        context_tokens,
        context_policy,
    )


def check_keep_context(value: Any, per_row: bool, reuse: dict, attend_to: Any, keep_texts: Any) -> None:
    """``keep_context``: True or a policy (a spec string) for one prompt, alone of the options that place or watch prompt spans."""
    if value is not True and not isinstance(value, (str, CompressionPolicy)):
        raise InvalidGenerationParameterError(f"keep_context must be True, False or a compression policy, got {value!r}", param=KEEP_CONTEXT_KEY)
    if per_row:
        raise InvalidGenerationParameterError("keep_context applies to one prompt (generate/stream), not generate_batch", param=KEEP_CONTEXT_KEY)
    for key, given in (("reuse_segments", reuse.get("reuse_segments")), (ATTEND_KEY, attend_to), (KEEP_KEY, keep_texts)):
        if given is not None:
            reason = f"keep_context does not combine with {key} (the kept context is read once for every question)"
            raise InvalidGenerationParameterError(reason, param=KEEP_CONTEXT_KEY)


def context_split(
    engine: EngineLike, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, compression: Compression, question: str | None
) -> tuple[int, CompressionPolicy]:
    """Where a ``keep_context`` prompt's context ends (the question's first token) and the policy the
    context is read with: ``compression``, its question window left to the context's own end, rolled
    past the model's window where the context does not fit."""
    try:
        policy = as_policy(compression)
    except InvalidCompressionError as exc:
        raise InvalidCompressionError(f"keep_context: {exc}") from None
    if policy is None:
        raise InvalidGenerationParameterError("keep_context keeps a compressed context: give a compression policy", param=KEEP_CONTEXT_KEY)
    tail = question_tail_tokens(engine.tokenizer, prompt, chat=chat, question=question, tools=spec.tools if spec.renders_tools else (), with_space=True)
    if tail is None or tail >= len(row):
        raise InvalidPromptError("keep_context: the question was not found after a context in the prompt (name it with question=)")
    context = len(row) - tail
    if policy.repeats_context:
        repeat = len(engine.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)) + min(context, policy.repeat_chunk)  # type: ignore[attr-defined]
        limit = engine.context_length
        if limit is not None and context + repeat > limit:
            raise InvalidCompressionError(
                f"kvzip: the context ({context} tokens) and one repeated chunk ({repeat} with its prompt) need {context + repeat} "
                f"positions, over the model's {limit}; lower repeat_chunk, shorten the context or use a policy without a repeat (expected:)"
            )
    fitted = fit_to_window(policy, context, 0, engine.context_length) or policy
    return context, fitted.for_prompt(None) if fitted.needs_question_span else fitted


def prepare_batch(
    engine: EngineLike,
    prompts: Sequence[PromptLike],
    compression: Compression = None,
    chat: bool | None = None,
    questions: Sequence[str | None] | None = None,
    prefix_cache: bool = True,
    bucket: bool = True,
    max_batch_size: int | None = None,
    sampling: dict[str, Any] | None = None,
) -> tuple[Request, list[list[int]]]:
    """The validated request and its row groups (``generate_batch``'s arguments)."""
    if isinstance(prompts, str):
        raise TypeError("generate_batch takes a list of prompts; use generate for one")
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1):
        raise InvalidGenerationParameterError(f"max_batch_size must be an integer >= 1 or None, got {max_batch_size!r}", param="max_batch_size")
    request = prepare_request(engine, list(prompts), compression, chat, dict(sampling or {}), questions, per_row=True, prefix_cache=prefix_cache)
    lengths = [len(r) for r in request.rows]
    if getattr(engine, "invariant", False) or (request.policy is not None and (request.policy.ragged_heads or request.policy.rolling is not None)):
        return request, [[i] for i in range(len(lengths))]  # the invariant mode, ragged heads, rolling prefills: one prompt per run
    if bucket:
        groups = length_buckets(lengths, max_batch_size)
    else:
        size = max_batch_size or len(lengths)
        groups = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    return request, [sorted(group) for group in groups]  # input order inside a bucket


def grammar(engine: EngineLike, specs: Sequence[OutputSpec], max_new_tokens: int):
    """The rows' compiled grammars, or None when every row is free text (typed errors on bad schemas)."""
    if not any(s.constrained for s in specs):
        return None
    from ..tools.constraints import BatchConstraint

    return BatchConstraint.build(engine.grammar_tokenizer, specs, max_new_tokens)


def resolve_policy(
    engine: EngineLike,
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
        policy.for_prompt(question_tail_tokens(engine.tokenizer, p, chat=chat, question=q, tools=s.tools if s.renders_tools else ()))
        for p, q, s in zip(prompts, questions, specs)
    ]


def _text_spans(engine: EngineLike, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any, key: str) -> list[tuple[int, int]]:
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) or not all(isinstance(t, str) and t for t in texts) or not texts:
        raise InvalidGenerationParameterError(f"{key} must be a non-empty list of non-empty strings (texts that appear in the prompt)", param=key)
    return text_token_spans(engine.tokenizer, prompt, texts, len(row), chat=chat, tools=spec.tools if spec.renders_tools else ())


def protected_spans(
    engine: EngineLike, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any
) -> tuple[tuple[int, int], ...] | None:
    """Validate ``keep_texts``; the token spans of the texts found (None: nothing to keep)."""
    if texts is None:
        return None
    spans = _text_spans(engine, prompt, row, chat, spec, texts, KEEP_KEY)
    missing = [t for t, (a, b) in zip(texts, spans) if b <= a]
    if missing:
        raise InvalidGenerationParameterError(f"keep_texts: {missing[0][:80]!r} does not appear in the rendered prompt", param=KEEP_KEY)
    return tuple(spans)


def attention_spans(
    engine: EngineLike, prompt: PromptLike, row: list[int], chat: bool | None, spec: OutputSpec, texts: Any
) -> tuple[tuple[tuple[int, int], ...] | None, str | None]:
    """Validate ``attend_to``; the token spans of its texts in the prompt (in the given order;
    a text not found gets an empty span), or None and why nothing will be recorded."""
    if texts is None:
        return None, None
    spans = _text_spans(engine, prompt, row, chat, spec, texts, ATTEND_KEY)
    if not any(b > a for a, b in spans):
        return None, "none of the attend_to texts was found in the rendered prompt"
    return tuple(spans), None


def segment_request(
    engine: EngineLike,
    prompt: PromptLike,
    row: list[int],
    chat: bool | None,
    spec: OutputSpec,
    policy: CompressionPolicy | None,
    options: dict[str, Any],
    salt: str | None = None,
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
    if segments != "offered" and (isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or not all(isinstance(t, str) for t in segments)):
        raise InvalidGenerationParameterError('reuse_segments must be a list of strings (texts that appear in the prompt) or "offered"', param="reuse_segments")
    if policy is not None and reuse_tail(policy) is None:
        return None, f"{policy.name} needs every prompt query; prefilled whole"
    if getattr(engine, "invariant", False):
        return None, "refused: blended chunk reuse approximates by design, and the invariant mode computes prompts exactly; prefilled whole"
    if spans_devices(engine.model):
        return None, "refused: blended chunk reuse runs on one device, and this model's layers are spread over several (device_map); prefilled whole"
    if attention_kernel(engine.model) == "flash_attention_2":
        return None, "refused: blended chunk reuse attends through a 4-D mask, which flash_attention_2 cannot take; prefilled whole"
    try:
        shift = engine.rope_shift()
    except SegmentReuseUnsupported as exc:
        return None, f"refused: {exc}"
    tools = spec.tools if spec.renders_tools else ()
    chosen = OFFERED.found_in if segments == "offered" else segments
    spans = segment_spans(engine.tokenizer, prompt, chosen, len(row), chat=chat, tools=tools)
    if not spans:
        return None, "no segment found in the rendered prompt"
    signature = salted_signature(engine.signature, salt)
    return SegmentRequest(spans, segment_anchor(row), store if store is not None else engine.segment_store, signature, float(recompute), shift), None


def check_continuation(engine: EngineLike, continuation: Any) -> list[int]:
    """``score``'s continuation as a list of token ids in the vocabulary."""
    if isinstance(continuation, torch.Tensor):
        if continuation.dim() != 1 or continuation.dtype.is_floating_point or continuation.dtype == torch.bool:
            raise InvalidPromptError("continuation tensor must be 1-D integer token ids")
        continuation = continuation.tolist()
    if isinstance(continuation, (str, bytes)) or not isinstance(continuation, Sequence):
        raise InvalidPromptError(f"continuation must be a list of token ids, got {type(continuation).__name__}")
    ids = list(continuation)
    if not ids:
        raise InvalidPromptError("continuation is empty; score needs at least one token id")
    vocab = engine.model.get_input_embeddings().num_embeddings
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidPromptError(f"continuation[{i}] = {t!r} is not a token id in [0, {vocab})")
    return ids
