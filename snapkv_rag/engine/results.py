"""What every generation returns: text, finish reason, usage and measured stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..tools.calls import ToolCall

if TYPE_CHECKING:
    from ..model.peak_memory import PeakMemory
    from .generation import DecodeRun
    from .info import ModelInfo
    from .requests import Request


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_tokens": self.total_tokens}


def kept_tokens_text(kept_tokens_per_layer: list[int]) -> str:
    """Prompt entries kept per layer, for a log line: ``"1024"``, or ``"57-977"`` where layers kept different amounts."""
    kept = kept_tokens_per_layer
    if not kept:
        return "0"
    return f"{min(kept)}-{max(kept)}" if min(kept) != max(kept) else str(kept[0])


@dataclass(frozen=True)
class GenerationStats:
    """Measurements of one engine call, for one row (one prompt).

    Token and byte counts are the row's own: its real prompt tokens, never the padding of
    a batch. Timings, ``prompt_tokens_padded``, ``batch_prompt_kv_bytes``, ``kv_bytes_final``,
    peak memory and the counts in ``policy_stats`` (decode-time cuts, folded entries; not
    ``low_rank_state_bytes``/``_tokens``, which are the row's) describe the whole (bucketed)
    batch the row ran in.
    """

    prefill_seconds: float
    decode_ms_per_token: float | None  # median over decode steps, first step excluded
    decode_steps: int
    total_seconds: float
    prompt_tokens_padded: int  # width of the batch the row ran in (= prompt tokens alone)
    reused_prompt_tokens: int  # this row's prompt tokens whose K/V came from a cache (prefix or segments), not computed
    prefilled_prompt_tokens: int  # this row's prompt tokens run through the model (recomputed ones included)
    kept_tokens_per_layer: list[int]  # real prompt tokens of this row kept, per layer
    prompt_kv_bytes_full: int  # this row's prompt K/V without compression
    prompt_kv_bytes_kept: int  # this row's prompt K/V kept (real tokens only)
    batch_prompt_kv_bytes: int  # the batch's prompt cache after compression, padding slots included
    kv_bytes_final: int  # this call's cache at the end (all its rows), generated tokens included, other requests' rows and padding not
    peak_memory_bytes: int  # the process's (CPU RSS) or the device allocator's (CUDA) peak during the call, weights included
    peak_memory_kind: str
    compression: dict[str, Any] | None
    batch_size: int
    device: str
    dtype: str
    threads: int
    model: str
    version: str
    peak_memory_added_bytes: int = 0  # that peak minus the memory in use when the call began: what the call added
    peak_memory_shared: bool = False  # CUDA: another call overlapped this one, so the peak counts both
    constraint_ms_per_step: float | None = None  # tools/response_format: median grammar mask + advance per step
    constraint_closing_steps: int | None = None  # steps this row's unfinished JSON was steered to close near max_new_tokens
    # The policy's decode-time state, measured by itself: decode-time compression
    # (decode_compactions, decode_evicted_entries, decode_cache_entries_max, ...) and LESS
    # (low_rank_state_bytes, low_rank_state_tokens, low_rank_ms_per_step, low_rank_folded_entries).
    policy_stats: dict[str, Any] = field(default_factory=dict)
    # Deprecated (use policy_stats; removed in the next release): LESS's stats under their old names.
    low_rank_state_bytes: int = 0  # LESS: this row's state (H and z of every layer), beside prompt_kv_bytes_kept
    low_rank_state_tokens: float = 0.0  # the state's bytes in cached tokens of this model (K and V, all layers)
    low_rank_ms_per_step: float | None = None  # LESS: median time of the low-rank part of a decode step
    decode_ms_quartiles: tuple[float, float] | None = None  # 25th/75th percentile of step times (4+ steps after the first)
    recomputed_prompt_tokens: int = 0  # stored-segment tokens computed again by the blended prefill
    segment_hits: int = 0  # reuse_segments found in the segment store
    segment_misses: int = 0  # reuse_segments computed (and stored) by this call
    segment_reuse: str | None = None  # "blended", or why reuse_segments were not applied (None: not asked)
    tool_call_tail_dropped: bool = False  # max_new_tokens ran out inside a call after complete ones; those were returned
    decode_batch_rows_max: int = 0  # continuous batching: the most rows decoded in one forward with this request's
    duplicate_tool_calls: bool = False  # the model repeated a call of this turn; the repeat was dropped and the turn ended
    weights: str = "native"  # the linear layers' weights: "native" (the dtype's) or "int8" (weight-only)
    decode_step: str = "none"  # "compiled", "eager (why not compiled)", or both with their counts (snapkv_rag.engine.compiled_decode)
    tool_decision: dict[str, Any] | None = None  # tool_choice="auto" under a call gate: the tool chosen (None: prose), its score, the threshold
    span_attention: str | None = None  # attend_to: "recorded (N spans)", or why it was not (None: not asked)
    protected_prompt_tokens: int = 0  # keep_texts: their prompt tokens (kept by every compressed layer, as many as fit)
    context_reuse: str | None = None  # keep_context: "stored", "reused", "extended" (from a kept start, the rest read and kept) or why not kept
    # prompt_lookup_num_tokens: forwards with a draft, tokens drafted and accepted, tokens per
    # forward, or draft_off saying why none was tried (None: not asked)
    drafts: dict[str, Any] | None = None

    @property
    def compression_ratio(self) -> float:
        return self.prompt_kv_bytes_full / self.prompt_kv_bytes_kept if self.prompt_kv_bytes_kept else 1.0

    @property
    def compression_ratio_text(self) -> str:
        """The ratio for people: two decimals below 2 (1,064 tokens kept as 1,024 is 1.04, not 1.0), else one."""
        ratio = self.compression_ratio
        return f"{ratio:.2f}" if ratio < 2 else f"{ratio:.1f}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression_ratio": self.compression_ratio}


@dataclass(frozen=True)
class PromptRead:
    """What :meth:`~snapkv_rag.engine.engine.Engine.read_prompt` did: a prefill and no answer."""

    prompt_tokens: int
    seconds: float  # the prefill, wall clock on the model's worker
    layers_run: int  # every layer, or those up to the early exit
    rolling: Any = None  # the rolled read's RollingStats (None: read in one window)
    reused_tokens: int = 0  # prompt tokens placed from stored chunk K/V instead of computed
    segment_hits: int = 0  # chunks found in the segment store
    segment_misses: int = 0  # chunks computed (and stored) by this read


@dataclass(frozen=True)
class GenerationResult:
    text: str  # with tools: the prose outside tool-call blocks
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled" or "tool_calls"
    usage: Usage
    stats: GenerationStats
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed and schema-validated
    parsed: Any = None  # with response_format: the validated JSON value of ``text``
    # with attend_to: per generated token after the first, the attention share of each given text
    # (see snapkv_rag.compression.span_attention); None when not asked for or not recorded
    span_attention: list[list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "parsed": self.parsed,
            "usage": self.usage.to_dict(),
            "stats": self.stats.to_dict(),
        }


def row_stats(
    run: DecodeRun, row: int, request: Request, peak: PeakMemory, kv_final: int, total: float, info: ModelInfo, model: str, drafts: dict[str, Any] | None = None
) -> GenerationStats:
    """Row ``row``'s stats after ``run`` (a decode run of ``request``'s rows) finished."""
    import torch

    from .._version import __version__

    kept, full = run.row_kv_bytes(row)
    policy_stats = run.policy_stats()
    if "low_rank_state_bytes" in policy_stats:  # the state is the batch's; report this row's
        policy_stats["low_rank_state_bytes"] //= run.batch_size
        policy_stats["low_rank_state_tokens"] = policy_stats["low_rank_state_bytes"] / info.kv_bytes_per_token
    settings = request.policy.settings() if request.policy is not None else None
    if request.context_policy is not None:
        settings = {**(settings or {}), "kept_context": request.context_policy.spec()}
    if settings is not None and isinstance(request.row_policies, list):
        settings["resolved_window_size"] = request.row_policies[row].query_window
        settings["resolved_window_sizes"] = [p.query_window for p in request.row_policies]  # rows of this batch
    return GenerationStats(
        prefill_seconds=run.timings.prefill_seconds,
        decode_ms_per_token=run.timings.decode_ms_per_token,
        decode_ms_quartiles=run.timings.decode_ms_quartiles,
        decode_steps=len(run.timings.step_seconds),
        total_seconds=total,
        prompt_tokens_padded=run.padded_length,
        reused_prompt_tokens=run.reused_tokens[row],
        prefilled_prompt_tokens=run.row_lengths[row] - run.reused_tokens[row],
        recomputed_prompt_tokens=run.recomputed_tokens,
        segment_hits=run.segment_hits,
        segment_misses=run.segment_misses,
        segment_reuse="blended" if run.segments is not None else (run.segment_note or request.segment_note),
        kept_tokens_per_layer=run.row_kept_tokens(row),
        prompt_kv_bytes_full=full,
        prompt_kv_bytes_kept=kept,
        batch_prompt_kv_bytes=run.prompt_kv_bytes_kept,
        kv_bytes_final=kv_final,
        peak_memory_bytes=peak.peak_bytes,
        peak_memory_kind=peak.kind,
        peak_memory_added_bytes=peak.added_bytes,
        peak_memory_shared=peak.shared,
        compression=settings,
        batch_size=run.batch_size,
        device=info.device,
        dtype=info.dtype,
        weights=info.weights,
        tool_decision=request.call_decision.to_dict() if request.call_decision is not None else None,
        span_attention=f"recorded ({len(run.span_attention.spans)} spans)"
        if run.span_attention is not None
        else (run.span_attention_note or request.attention_note),
        protected_prompt_tokens=sum(end - start for start, end in run.protected_spans) if run.session is not None else 0,
        context_reuse=run.context_reuse,
        threads=torch.get_num_threads(),
        model=model,
        version=__version__,
        # the grammar mask + advance per step (whole batch), beside the forward's decode_ms_per_token
        constraint_ms_per_step=request.constraint.ms_per_step if request.constraint is not None else None,
        constraint_closing_steps=request.constraint.closing_steps[row] if request.constraint is not None else None,
        policy_stats=policy_stats,
        # LESS's stats under their names from before policy_stats, kept for one release
        low_rank_state_bytes=policy_stats.get("low_rank_state_bytes", 0),
        low_rank_state_tokens=policy_stats.get("low_rank_state_tokens", 0.0),
        low_rank_ms_per_step=policy_stats.get("low_rank_ms_per_step"),
        drafts=drafts,
    )
