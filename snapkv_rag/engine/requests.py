"""A validated engine call (rows, sampling, policy, output specs) and how rows are grouped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..compression import CompressionPolicy
from ..errors import InvalidGenerationParameterError, StructuredOutputError
from ..reuse.blending import SegmentRequest
from ..tools.calls import TEXT, OutputSpec, build_output_spec
from .sampling import GenerationParams


def output_specs(n: int, options: dict[str, Any], *, per_row: bool = False) -> list[OutputSpec]:
    """One :class:`OutputSpec` per row from ``tools``/``tool_choice``/``response_format``/``parallel_tool_calls``.

    With ``per_row`` (``generate_batch``), each option may instead be a list with one entry per
    prompt: ``tools`` as a list of (lists of specs or None), ``tool_choice`` and
    ``response_format`` as lists of values or None.
    """
    tools = options.get("tools")
    choice = options.get("tool_choice")
    fmt = options.get("response_format")
    parallel = options.get("parallel_tool_calls", False)
    max_calls = options.get("max_tool_calls")

    def rows(value: Any, is_per_row: bool) -> list[Any]:
        if not (per_row and is_per_row):
            return [value] * n
        if len(value) != n:
            raise StructuredOutputError(f"a per-prompt list of tools, tool_choice or response_format needs {n} entries, got {len(value)}")
        return list(value)

    tools_rows = rows(tools, isinstance(tools, list) and bool(tools) and all(t is None or isinstance(t, (list, tuple)) for t in tools))
    choice_rows = rows(choice, isinstance(choice, list))
    fmt_rows = rows(fmt, isinstance(fmt, list))
    specs = []
    for t, c, f in zip(tools_rows, choice_rows, fmt_rows):
        if not t and c is None and f is None:
            specs.append(TEXT)
        else:
            specs.append(build_output_spec(t, c, f, parallel, max_calls))
    return specs


MAX_CACHE_SALT_CHARS = 1024


def checked_cache_salt(value: Any) -> str | None:
    """``cache_salt``: None, or a non-empty string (at most 1,024 characters) naming the prefix
    cache's and the chunk store's namespace: a prompt reuses K/V stored under its own salt only."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise InvalidGenerationParameterError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, or None", param="cache_salt"
        )
    return value


@dataclass(frozen=True)
class Request:
    """A validated call: token ids per prompt, sampling parameters and the policy.

    ``row_policies`` is the policy resolved for the rows: the policy itself, or one per row
    when it depends on where each row's question sits (``snapkv:window=question``).
    ``specs`` says what each row must produce (text, tool calls, JSON); ``constraint`` holds
    the rows' compiled grammars (None when every row is free text).
    """

    rows: list[list[int]]
    params: GenerationParams
    policy: CompressionPolicy | None
    row_policies: CompressionPolicy | list[CompressionPolicy] | None
    specs: tuple[OutputSpec, ...] = ()
    constraint: Any = None
    use_prefix_cache: bool = True
    segments: SegmentRequest | None = None  # single-prompt calls with reuse_segments
    segment_note: str | None = None  # why segment reuse was asked for but not applied
    # single-prompt calls under tool_choice="auto" with a call gate: prepares the call again with
    # the gate's tool_choice (see snapkv_rag.tools.call_gate); then call_decision holds what it decided
    redo: Callable[[Any], Request] | None = None
    call_decision: Any = None
    # single-prompt calls with attend_to: the token spans of the texts found (see snapkv_rag.compression.span_attention)
    attention_spans: tuple[tuple[int, int], ...] | None = None
    attention_note: str | None = None  # why attend_to records nothing (no text found)
    # single-prompt calls with keep_texts: the token spans every compressed layer keeps
    protected_spans: tuple[tuple[int, int], ...] | None = None
    cache_salt: str | None = None  # the prefix cache's namespace: reuse only K/V stored under the same salt
    # keep_context: the prompt's context (its first tokens, before the question) is read without the
    # question, kept compressed, and read again by later prompts over the same context (None: off)
    context_tokens: int | None = None
    context_policy: CompressionPolicy | None = None  # the policy the kept context is read with (row_policies: the question's cut, or None)

    def spec(self, row: int) -> OutputSpec:
        return self.specs[row] if self.specs else TEXT

    def subset(self, indices: Sequence[int]) -> Request:
        rows = [self.rows[i] for i in indices]
        row_policies = [self.row_policies[i] for i in indices] if isinstance(self.row_policies, list) else self.row_policies
        specs = tuple(self.specs[i] for i in indices) if self.specs else ()
        constraint = self.constraint.subset(indices) if self.constraint is not None else None
        return Request(rows, self.params, self.policy, row_policies, specs, constraint, self.use_prefix_cache, cache_salt=self.cache_salt)


def length_buckets(lengths: Sequence[int], max_batch_size: int | None = None, *, slack: float = 0.25, min_slack: int = 16) -> list[list[int]]:
    """Group row indices by length so padding stays small: rows sorted longest first join
    the current bucket while ``longest - length <= max(min_slack, slack * longest)``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            current = buckets[-1]
            longest = lengths[current[0]]
            fits = longest - lengths[i] <= max(min_slack, slack * longest)
            if fits and (max_batch_size is None or len(current) < max_batch_size):
                current.append(i)
                continue
        buckets.append([i])
    return buckets
