"""What a finished run returns: per row its text, finish reason, usage and stats, and for a
constrained row the tool calls or JSON parsed and checked against what the call asked for."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import StructuredOutputError
from ..tools.calls import OutputSpec, ToolCallStream, complete_calls_text, parse_json_output, parse_tool_calls
from .results import GenerationResult, Usage, row_stats

if TYPE_CHECKING:
    from ..model.peak_memory import PeakMemory
    from .info import ModelInfo
    from .requests import Request
    from .scheduler import Member


def row_results(member: Member, request: Request, cancelled: bool, peak: PeakMemory, info: ModelInfo, model: str) -> list[GenerationResult]:
    """One result per row of ``member``'s finished (or cancelled) run."""
    run = member.run
    total = run.timings.prefill_seconds + sum(run.timings.step_seconds)
    results = []
    drafts = member.drafts_stats()
    for i, (row, t) in enumerate(zip(request.rows, member.texts)):
        stats = row_stats(run, i, request, peak, member.kv_bytes_final, total, info, model, drafts)
        result = GenerationResult(
            text=t.text,
            finish_reason="cancelled" if cancelled and not t.finished else (t.finish_reason or "length"),
            usage=Usage(prompt_tokens=len(row), completion_tokens=t.generated),
            stats=replace(stats, decode_batch_rows_max=member.batch_rows_max, decode_step=member.decode_step()),
            token_ids=list(t.token_ids),
            span_attention=list(run.span_attention.rows) if run.span_attention is not None else None,
        )
        spec = request.spec(i)
        if spec.constrained and result.finish_reason != "cancelled":
            call = member.calls[i]
            assert request.constraint is not None  # a constrained row has a grammar
            result = structured_result(result, spec, call, i, request.constraint.complete(i) or bool(call and call.duplicate))
        results.append(result)
    return results


def structured_result(result: GenerationResult, spec: OutputSpec, stream: ToolCallStream | None, row: int, complete: bool) -> GenerationResult:
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
