"""The one decode loop: a (compressed) prefill, then one token per step for a left-padded batch.

Positions are explicit. After compression the cache holds ``k < n`` entries per layer, but
the first generated token still sits at position ``n`` (per row: its real-token count), so
RoPE sees true positions; the 2-D mask covers the kept entries plus the new ones, and
transformers derives mask sizes from the cache length, which stays consistent. A rolling
prefill (:mod:`.rolling`) is the exception: its kept keys are moved to packed positions, and
generation continues from the last prompt token's packed position.
"""

from __future__ import annotations

import statistics
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..compression.base import CompressionPolicy
from ..compression.decoding import PolicyState, layer_entries
from ..compression.own_attention import layers_of
from ..compression.quantized import MIN_RESIDUAL, is_quantized, quantize_cache
from ..compression.ragged import is_ragged
from ..compression.rotary import AnglesFn, rotary_angles
from ..compression.runtime import LayersDone, PrefillCompression, ScoringSession, compressing, plain_causal, policy_attention, sliding_layers
from ..compression.span_attention import SpanAttention, observing
from ..errors import InvalidCompressionError
from ..model.device_clock import device_clock
from ..model.placement import layer_devices
from ..reuse.blending import (
    SegmentRequest,
    SegmentReuseUnsupported,
    assemble,
    blended_mask,
    blending_cache,
    kv_shape,
    model_rope_shift,
    recompute_positions,
)
from ..reuse.kept_contexts import KeptContext
from ..reuse.prefix_cache import (
    PrefixCache,
    ReusePlan,
    aligned_end,
    aligned_reuse,
    plan_reuse,
    reuse_tail,
    reused_columns,
    reused_layer,
    store_prompts,
)
from .lookup import drop_last
from .rolling import RollingPlan, RollingStats, rolling_plan, rolling_prefill
from .sampling import GenerationParams, make_generator, select_next_tokens


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def plain_cache(model, cache):
    """A ``DynamicCache`` holding ``cache``'s layer tensors (no copy)."""
    from transformers import DynamicCache

    plain = DynamicCache(config=model.config)
    for i, (layer, source) in enumerate(zip(plain.layers, cache.layers)):
        if is_ragged(source):
            plain.layers[i] = source
            continue
        if getattr(source, "keys", None) is None:  # a layer past an early exit: never run, stays empty
            continue
        layer.lazy_initialization(source.keys, source.values)
        layer.keys, layer.values = source.keys, source.values
    return plain


def cache_bytes(cache) -> int:
    return sum(layer_bytes(layer) for layer in cache.layers)


def layer_bytes(layer) -> int:
    """Bytes ``layer`` holds (ragged and quantized layers count their own buffers)."""
    if hasattr(layer, "held_bytes"):
        return layer.held_bytes()
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if keys is None or values is None or not keys.numel():
        return 0
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


def layer_token_bytes(layer, *, stored: bool = True) -> float:
    """K and V bytes of one cached token in ``layer`` (all its KV heads); a quantized layer's
    mean over the entries it holds (codes, scales and zero points, and its full-width residual),
    or with ``stored=False`` what a token takes at the model's width."""
    if is_quantized(layer):
        return layer.held_bytes() / (layer.batch_size * layer.get_seq_length()) if stored else layer.full_token_bytes
    keys = layer.keys
    heads = layer.heads if is_ragged(layer) else keys.shape[1]
    return 2 * heads * keys.shape[3] * keys.element_size()


@dataclass
class DecodeTimings:
    prefill_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens each forward produced (more than 1: accepted drafts)

    @property
    def decode_ms_per_token(self) -> float | None:
        """The median step; with drafts taken, decode time over the tokens it produced (first step excluded both ways)."""
        steps = self.step_seconds[1:] or self.step_seconds
        tokens = self.step_tokens[1:] or self.step_tokens
        if tokens and max(tokens) > 1 and len(tokens) == len(steps):
            return sum(steps) / sum(tokens) * 1000
        return statistics.median(steps) * 1000 if steps else None

    @property
    def decode_ms_quartiles(self) -> tuple[float, float] | None:
        """25th and 75th percentile of the step times (first step excluded): how much one run's median can be trusted."""
        steps = self.step_seconds[1:]
        if len(steps) < 4:
            return None
        q1, _, q3 = statistics.quantiles(steps, n=4)
        return q1 * 1000, q3 * 1000


class TokenConstraint(Protocol):
    """Per-row logits masks (grammar-constrained decoding), consulted once per step.

    ``mask`` edits ``[batch, vocab]`` logits before a token is chosen (rows it does not
    constrain stay as they are); ``advance`` receives the chosen token of every row. A mask
    computed without advancing is computed again, the same, from the same state (prompt-lookup
    drafts check a draft token that way).
    See :class:`snapkv_rag.tools.constraints.BatchConstraint`.
    """

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def advance(self, tokens: list[int]) -> None: ...

    @property
    def closing(self) -> bool:
        """Whether masks now depend on the step count (unfinished JSON steered to close): drafts stop there."""
        ...


def model_forward(model, cache, input_ids, attention_mask, position_ids, state: PolicyState | None = None, *, last_only: bool = True) -> torch.Tensor:
    """One forward through ``cache`` at explicit positions; the logits ``[batch, t or 1, vocab]``.
    Without ``attention_mask`` (no padding) the new tokens attend causally over the whole cache."""
    with policy_attention(state), layers_of(cache), plain_causal(attention_mask is None):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        ).logits


def policy_angles(model, policy: CompressionPolicy | None) -> AnglesFn | None:
    """The model's rotary angles for a policy that moves queries to other positions (None: the policy
    does not, or the model has no rotate-half rotary embedding; the policy then leaves them in place)."""
    if policy is None or not policy.needs_rotary_angles:
        return None
    try:
        return model_rope_shift(model, sliding=True).angles
    except SegmentReuseUnsupported:
        return None


def choose_tokens(
    logits: torch.Tensor,
    step: int,
    params: GenerationParams,
    generator: torch.Generator | None,
    eos_ids: list[int],
    constraint: TokenConstraint | None,
) -> torch.Tensor:
    """The next token of every row ``[batch]`` from ``logits [batch, vocab]`` at decode step ``step``:
    end-of-sequence held back before ``params.min_new_tokens``, the grammar's mask, then sampling."""
    if step < params.min_new_tokens and eos_ids:
        logits = logits.index_fill(-1, torch.tensor(eos_ids, device=logits.device), float("-inf"))
    if constraint is not None:
        logits = constraint.mask(logits)
    tokens = select_next_tokens(logits, params, generator)
    if constraint is not None:
        constraint.advance(tokens.tolist())
    return tokens


class DecodeRun:
    """Prefill ``rows`` (token id lists) and yield the next token of every row per step.

    The caller stops iterating when it is done; at most ``params.max_new_tokens`` steps.
    An optional ``constraint`` masks each step's logits (tool calls, JSON output).
    """

    def __init__(
        self,
        model,
        rows: list[list[int]],
        params: GenerationParams,
        policy: CompressionPolicy | list[CompressionPolicy] | None,
        pad_id: int,
        constraint: TokenConstraint | None = None,
        prefix_cache: PrefixCache | None = None,
        segments: SegmentRequest | None = None,
        eos_ids: frozenset[int] = frozenset(),
        attention_spans: Sequence[tuple[int, int]] | None = None,
        protected_spans: Sequence[tuple[int, int]] | None = None,
        cache_namespace: str = "",
        invariant_chunk: int | None = None,
    ):
        from transformers import DynamicCache

        self.model = model
        self.constraint = constraint
        self.eos_ids = sorted(eos_ids)  # held back for the first params.min_new_tokens steps
        self.params = params
        self.policy = policy
        self.rows = rows
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        widths = {p.kv_bits if p is not None else None for p in (policy if isinstance(policy, list) else [policy])}
        if len(widths) > 1:
            raise InvalidCompressionError("the rows of one batch store their entries at one width (kv_bits)")
        self.kv_bits: int | None = widths.pop()
        if len(rows) > 1 and self.ragged_heads:
            raise InvalidCompressionError("per-head budgets (heads=adaptive) run one prompt at a time; Engine.generate_batch runs such rows one by one")
        self.input_ids, self.attention_mask = left_pad(rows, pad_id, self.device)
        # Without padding no mask is passed at all, so SDPA takes its causal fast path.
        self.has_padding = bool((self.attention_mask == 0).any())
        self.row_lengths = [len(r) for r in rows]
        self.sliding = sliding_layers(model.config)
        # 2-D masks over cached entries, padded batches only: one for the (compressed) full
        # layers, one for the uncompressed sliding layers when the model mixes both kinds.
        self._kv_mask: torch.Tensor | None = None
        self._sliding_mask: torch.Tensor | None = None
        self.cache = DynamicCache(config=model.config)
        # Prefix reuse needs plain (non-sliding) layers: a sliding layer keeps only its window.
        sliding_cache = any(self.sliding) or any(getattr(self.cache, "is_sliding", []))
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.max_bytes > 0 and not sliding_cache else None
        self.cache_namespace = cache_namespace  # prompts reuse and store prefix K/V only within it
        # The invariant mode (snapkv_rag.engine.invariant): every prefill forward and decode step is
        # computed the same way however the request arrives; None: off
        self.invariant = invariant_chunk is not None
        if self.invariant and len(rows) != 1:
            raise ValueError("the invariant mode prefills one prompt per run")
        self.invariant_chunk = invariant_chunk
        self.reused_tokens = [0] * len(rows)  # per row: prompt tokens whose K/V came from a cache, not recomputed
        # Rolling prefill (rolling=N): one prompt at a time, no prefix reuse or segments (their K/V sit at other positions)
        first = self._row_policy(0)
        self.rolling_plan: RollingPlan | None = rolling_plan(len(rows[0]), first) if first is not None else None
        if self.rolling_plan is not None:
            if len(rows) != 1:
                raise InvalidCompressionError("rolling= prefills one prompt at a time; Engine.generate_batch runs such rows one by one")
            self.prefix_cache = None
        self.rolling: RollingStats | None = None
        # Segment reuse (one prompt at a time; policies that need every prompt query prefill whole)
        self.segments = (
            segments
            if segments is not None and segments.spans and len(rows) == 1 and self.rolling_plan is None and reuse_tail(self._row_policy(0)) is not None
            else None
        )
        self.recomputed_tokens = 0  # reused-segment tokens computed again (blended prefill)
        self.segment_note: str | None = None  # why segments given were not used
        self.segment_hits = self.segment_misses = 0
        self.timings = DecodeTimings()
        self.kept_tokens_per_layer: list[int] = []
        self.token_bytes_per_layer: list[float] = []  # K and V bytes of one cached token, per layer (a quantized layer's mean)
        self.full_token_bytes_per_layer: list[float] = []  # the same at the model's width
        self.prompt_kv_bytes_kept = 0
        self.session: PrefillCompression | None = None
        self.last_logits = torch.empty(0)  # [batch, vocab] of the latest forward
        self.exited_early = False  # a forward stopped at an early exit: the run has no logits to decode from
        self.context_reuse: str | None = None  # keep_context: "stored", "reused", or why it was not kept (None: not asked)
        # What the policy keeps doing after the prefill (LESS's folded state, decode-time cuts); None: nothing
        self.policy_state: PolicyState | None = first.decode_state(model, self.sliding) if first is not None else None
        self.rotary_angles = policy_angles(model, first)
        # attention over given prompt spans during decoding (attention citations), one prompt only
        if protected_spans and len(rows) != 1:
            raise ValueError("protected spans apply to one prompt")
        self.protected_spans = list(protected_spans or [])
        self.span_attention: SpanAttention | None = None
        self.span_attention_note: str | None = None
        if attention_spans:
            if len(rows) != 1:
                self.span_attention_note = "span attention is recorded for one prompt at a time"
            elif self.policy_state is not None and self.policy_state.compacts:
                self.span_attention_note = "not recorded under decode-time cuts (decode_budget)"
            elif first is not None and first.ragged_heads:
                self.span_attention_note = "not recorded under per-head budgets (heads=adaptive)"
            elif self.rolling_plan is not None:
                self.span_attention_note = "not recorded under a rolling prefill (rolling=)"
            else:
                self.span_attention = SpanAttention(attention_spans, len(rows[0]), self.sliding)

    def _protected_mask(self) -> torch.Tensor | None:
        """``[batch, width]`` bool over the prompt layout: the positions of ``protected_spans`` (one prompt)."""
        if not self.protected_spans:
            return None
        mask = torch.zeros(self.attention_mask.shape, dtype=torch.bool, device=self.device)
        offset = self.padded_length - self.row_lengths[0]
        for start, end in self.protected_spans:
            mask[0, offset + start : offset + end] = True
        return mask

    @property
    def ragged_heads(self) -> bool:
        """Whether the policy keeps different numbers of entries per head (its cache layers are ragged)."""
        first = self._row_policy(0)
        return first is not None and first.ragged_heads

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padded_length(self) -> int:
        """Width of the prompt's cache layout (reused + prefilled columns, padding included)."""
        return self.attention_mask.shape[1]

    def _row_policy(self, row: int) -> CompressionPolicy | None:
        return self.policy[row] if isinstance(self.policy, list) else self.policy

    def _plan_reuse(self) -> ReusePlan:
        assert self.prefix_cache is not None
        return plan_reuse(self.prefix_cache, self.rows, [self._row_policy(i) for i in range(len(self.rows))], self.cache_namespace)

    def _layout_with_reuse(self, plan: ReusePlan) -> None:
        """Keep the left-padded layout of width ``W``; its first ``P`` columns come from the
        stored prefixes, the last ``T = W - P`` columns are prefilled."""
        assert self.prefix_cache is not None
        width_p = reused_columns(plan, self.rows)
        self.input_ids = self.input_ids[:, width_p:]
        self.reused_tokens = [take for _, take in plan]
        devices = layer_devices(self.model)  # under a device_map each layer's K/V live where its weights do
        for layer_idx in range(len(self.cache.layers)):
            keys, values = reused_layer(plan, layer_idx, width_p)
            device = devices.get(layer_idx, self.device)
            self.cache.update(keys.to(device), values.to(device), layer_idx)
        for entry, take in plan:
            self.prefix_cache.record_reuse(entry, take)

    def _forward(self, input_ids, attention_mask, position_ids, *, last_only: bool = True) -> torch.Tensor:
        try:
            with rotary_angles(self.rotary_angles):
                logits = model_forward(self.model, self.cache, input_ids, attention_mask, position_ids, self.policy_state, last_only=last_only)
        except LayersDone:  # an early exit (Engine.read_prompt): the layers the read needs have run, no logits
            self.exited_early = True
            self.last_logits = torch.empty(0)
            return self.last_logits
        self.last_logits = logits[:, -1, :]
        return logits

    def _prefill(self) -> torch.Tensor:
        """Run the whole (compressed) prefill at once; the last position's logits ``[batch, vocab]``."""
        steps = self.prefill_steps(None)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, chunk_tokens: int | None) -> Generator[None, None, torch.Tensor]:
        """Run the (compressed) prefill, yielding between chunks of ``chunk_tokens`` prompt tokens
        (None: one forward); returns the last position's logits ``[batch, vocab]``.

        With a prefix cache, each row's longest stored token prefix (minus the tail its
        policy's window needs, see :mod:`snapkv_rag.reuse.prefix_cache`) is placed in the cache
        first and only the rest is run through the model; the policy then selects over the
        reused plus the new keys, as after a full prefill. Every row's full prompt K/V is
        stored back before compression shrinks the cache.

        Chunks (see :meth:`_chunk_starts` for when a prompt is chunked) run uncompressed; the
        last one, at least the policy's observation window long, runs with the policy, which then
        selects over every chunk's keys with the window's queries, as after one forward. Until
        then every layer holds its full K/V (a whole prefill holds one layer's at a time).
        """
        if self.rolling_plan is not None:
            return (yield from self._rolling_prefill(self.rolling_plan))
        start = device_clock(self.device)
        aligned = self._aligned_end()
        if self.invariant:
            plan = self._aligned_plan(aligned)
        else:
            plan = self._plan_reuse() if self.prefix_cache is not None else None
        if self.segments is not None and plan is not None and self._exact_prefix_covers_more(plan[0][1]):
            self.segments = None
            self.segment_note = "an exact stored prefix covered more of the prompt than the segments"
        if self.segments is not None:
            self._blended_prefill()
            return self._finish_prefill(device_clock(self.device) - start, self.attention_mask)
        if plan is not None and any(take for _, take in plan):
            self._layout_with_reuse(plan)
        mask = self.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] - self.input_ids.shape[1] :]
        self._last_position = positions[:, -1:]
        padding_mask = mask if self.has_padding else None
        self.session = None
        keep = self._rows_to_store()
        if self.policy is not None:
            self.session = PrefillCompression(self.policy, self.cache, padding_mask, self.sliding, self.policy_state, self._protected_mask())
            if any(keep):
                self.session.full_kv = {}
        seconds = 0.0
        starts = self._aligned_starts(aligned) if self.invariant else self._chunk_starts(chunk_tokens)
        for a, b in zip(starts, starts[1:]):
            # the policy's decode-time state must not hear the prompt's chunks (it would record their queries)
            try:
                model_forward(self.model, self.cache, self.input_ids[:, a:b], None, positions[:, a:b])
            except LayersDone:  # an early exit: the layers later chunks read have this chunk's K/V
                self.exited_early = True
            seconds += device_clock(self.device) - start
            yield
            start = device_clock(self.device)
        last = starts[-1]
        with compressing(self.session):
            self._forward(self.input_ids[:, last:], padding_mask, positions[:, last:])
        if self.prefix_cache is not None and any(keep):
            if self.session is not None:
                assert self.session.full_kv is not None
                full_kv = self.session.full_kv
            else:
                layers: list = list(self.cache.layers)  # DynamicLayer: keys and values set by the forward
                full_kv = {i: (layer.keys, layer.values) for i, layer in enumerate(layers)}
            store_prompts(self.prefix_cache, self.rows, full_kv, self.cache_namespace, keep, aligned or 0, self.invariant_chunk or 0)
            if self.session is not None:
                self.session.full_kv = None  # the stored copies are the prefix cache's now
        return self._finish_prefill(seconds + device_clock(self.device) - start, mask)

    def _aligned_end(self) -> int | None:
        """Invariant mode: where the last prefill forward starts (:func:`aligned_end`); None: a
        whole prefill (the mode off, a policy needing every query, sliding-window layers)."""
        if not self.invariant or any(self.sliding) or self.rolling_plan is not None:
            return None
        assert self.invariant_chunk is not None
        return aligned_end(len(self.rows[0]), self._row_policy(0), self.invariant_chunk)

    def _aligned_plan(self, end: int | None) -> ReusePlan | None:
        """Invariant mode: whole aligned chunks of a stored prompt, or nothing."""
        if self.prefix_cache is None or end is None:
            return None
        assert self.invariant_chunk is not None
        return [aligned_reuse(self.prefix_cache, self.rows[0], self.cache_namespace, end, self.invariant_chunk)]

    def _aligned_starts(self, end: int | None) -> list[int]:
        """Invariant mode: the chunk starts in ``input_ids`` (after any reused chunks): one forward
        per ``invariant_chunk`` tokens up to ``end``, then the last forward from ``end``."""
        if end is None:
            return [0]
        assert self.invariant_chunk is not None
        rest = end - self.reused_tokens[0]
        return [*range(0, rest, self.invariant_chunk), rest] if rest > 0 else [0]

    def _rows_to_store(self) -> list[bool]:
        """Per row: whether its full prompt K/V goes to the prefix cache (its admission rule, see
        :mod:`snapkv_rag.reuse.prefix_cache`); every row is remembered as seen."""
        if self.prefix_cache is None:
            return [False] * len(self.rows)
        layers, kv_heads, head_dim = kv_shape(self.model)
        per_token = 2 * layers * kv_heads * head_dim * self.model.dtype.itemsize
        cache = self.prefix_cache
        dtype, chunk = self.model.dtype, self.invariant_chunk
        return [cache.admits(row, self.cache_namespace, len(row) * per_token, self._row_policy(i), dtype, chunk) for i, row in enumerate(self.rows)]

    def _rolling_prefill(self, plan: RollingPlan) -> Generator[None, None, torch.Tensor]:
        """The prompt read a chunk at a time into the budget (:mod:`snapkv_rag.engine.rolling`)."""
        policy = self._row_policy(0)
        assert policy is not None
        start, seconds = device_clock(self.device), 0.0
        steps = rolling_prefill(self, policy, plan, model_rope_shift(self.model, sliding=True))
        while True:
            try:
                next(steps)
            except StopIteration:
                break
            seconds += device_clock(self.device) - start
            yield
            start = device_clock(self.device)
        return self._finish_prefill(seconds + device_clock(self.device) - start, self.attention_mask)

    def _chunk_starts(self, chunk_tokens: int | None) -> list[int]:
        """Where the prefill's chunks start in ``input_ids`` (``[0]``: one forward).

        Chunked: one unpadded prompt on a model without sliding-window layers, with no policy or
        a policy that votes with a window of last queries (H2O needs every query), longer than a
        chunk. The last chunk is at least the window long (it may be longer than a chunk)."""
        n = self.input_ids.shape[1]
        policy = self._row_policy(0)
        window = 0 if policy is None else policy.query_window
        if chunk_tokens is None or self.batch_size != 1 or self.has_padding or any(self.sliding) or window is None or n <= chunk_tokens:
            return [0]
        starts = list(range(0, n, chunk_tokens))
        while len(starts) > 1 and n - starts[-1] < window:
            starts.pop()  # the last chunk holds the whole window
        return starts

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Run the whole (compressed) prefill; the last position's logits ``[batch, vocab]``.

        Afterwards the run can decode on its own (:meth:`decode_step`) or hand its cache to a
        running batch (:mod:`snapkv_rag.engine.scheduler`)."""
        return self._prefill()

    def _finish_prefill(self, seconds: float, mask: torch.Tensor) -> torch.Tensor:
        if self.kv_bits is not None:
            quantize_cache(self.cache, self.kv_bits, self._kv_residual(), self.sliding)
        self.timings.prefill_seconds = seconds
        if self.span_attention is not None:
            self.span_attention.bind(self.session.kept_indices if self.session is not None else None)
        self.record_kept()
        if self.has_padding:
            compressed = self.session.kept_attention_mask if self.session is not None else None
            self._kv_mask = compressed if compressed is not None else mask
            if compressed is not None and any(self.sliding) and not all(self.sliding):
                self._sliding_mask = mask
        return self.last_logits

    def record_kept(self) -> None:
        """Count what the cache holds now (entries and bytes per layer), for the run's statistics."""
        self.kept_tokens_per_layer = [layer_entries(layer) for layer in self.cache.layers]
        self.token_bytes_per_layer = [layer_token_bytes(layer) if layer_entries(layer) else 0 for layer in self.cache.layers]
        self.full_token_bytes_per_layer = [layer_token_bytes(layer, stored=False) if layer_entries(layer) else 0 for layer in self.cache.layers]
        self.prompt_kv_bytes_kept = cache_bytes(self.cache)

    # ------------------------------------------------------------ compress once, ask many
    def kept_context(self) -> KeptContext:
        """What this run holds after prefilling its one prompt (a context without its question), to
        keep for follow-up questions (:mod:`snapkv_rag.reuse.kept_contexts`)."""
        if self.batch_size != 1 or self.has_padding or self.exited_early:
            raise ValueError("a kept context is one unpadded prompt's whole prefill")
        return KeptContext(
            torch.tensor(self.rows[0]),
            list(self.cache.layers),
            self._last_position.clone(),
            self.policy_state,
            self.rolling,
            nbytes=cache_bytes(self.cache),
        )

    def adopt(self, kept: KeptContext) -> None:
        """Start from a kept context (this run's prompt must be its tokens) instead of prefilling it."""
        tokens = kept.tokens.tolist()
        if self.batch_size != 1 or tokens != self.rows[0][: len(tokens)]:
            raise ValueError("a kept context is adopted by a run over the same context tokens")
        self.rows, self.row_lengths = [tokens], [len(tokens)]
        layers, self.policy_state = kept.copy()
        self.cache.layers[:] = layers
        self._last_position = kept.last_position.clone().to(self.device)
        self.rolling = kept.rolling
        self.reused_tokens = [len(self.rows[0])]
        self.timings.prefill_seconds = 0.0
        self.record_kept()

    def listen(self, tokens: list[int], session: ScoringSession) -> None:
        """Read ``tokens`` after the cache with ``session`` listening to every layer, then drop their
        entries again: a scoring pass that leaves the cache as it was (KVzip's repeat)."""
        with compressing(session):
            self._extend(torch.tensor([tokens], device=self.device))
        self.drop_last(len(tokens))

    def continue_prompt(self, suffix: list[int], cut: CompressionPolicy | None = None) -> torch.Tensor:
        """Read ``suffix`` (the question and the template's tail) over the compressed context at the
        positions after it, as decoding reads a token; with ``cut``, that policy then selects over the
        whole cache with the suffix's queries (a question-aware cut of a question-agnostic context).
        This run's prompt becomes the whole one. The last position's logits ``[1, vocab]``."""
        start = device_clock(self.device)
        if suffix:
            window = cut.query_window if cut is not None else None
            if cut is not None and window is not None and window > len(suffix):
                cut = cut.with_query_window(len(suffix))
            session = PrefillCompression(cut, self.cache, None, self.sliding, self.policy_state) if cut is not None else None
            with compressing(session, record=False):
                self._extend(torch.tensor([suffix], device=self.device))
            self._after_step()
        self.rows = [self.rows[0] + list(suffix)]
        self.row_lengths = [len(self.rows[0])]
        self.timings.prefill_seconds += device_clock(self.device) - start
        self.record_kept()
        return self.last_logits

    def _kv_residual(self) -> int:
        """Entries kept at full width after a quantized prefill: the policy's observation window, or more."""
        windows = [self._row_policy(i) for i in range(self.batch_size)]
        return max([MIN_RESIDUAL] + [p.query_window or 0 for p in windows if p is not None])

    def _exact_prefix_covers_more(self, take: int) -> bool:
        """Whether the ``take`` tokens the prefix cache reuses exactly are at least as many as the
        segments after them would add (an agent's append-only history: stay exact, and stored)."""
        assert self.segments is not None
        beyond = sum(max(0, end - max(start, take)) for start, end in self.segments.spans)
        return take > 0 and take >= beyond

    def _blended_prefill(self) -> None:
        """Prefill one prompt from stored segment K/V plus the tokens it must compute
        (see :mod:`snapkv_rag.reuse.blending`); the policy selects during that forward as usual."""
        row, request = self.rows[0], self.segments
        assert request is not None
        prompt = assemble(self.model, row, request)
        self.segment_hits, self.segment_misses = prompt.hits, prompt.misses
        tail = reuse_tail(self._row_policy(0))
        assert tail is not None  # the constructor drops segments for policies that need every query
        positions = recompute_positions(self.model, row, prompt, tail, request.recompute)
        n = len(row)
        self.reused_tokens = [n - positions.numel()]
        self.recomputed_tokens = int(prompt.covered[positions].sum())
        cache = self.cache = blending_cache(self.model, prompt, positions)
        positions = positions.to(self.device)
        self._last_position = torch.tensor([[n - 1]], device=self.device)
        self.session = (
            PrefillCompression(self.policy, self.cache, None, self.sliding, self.policy_state, self._protected_mask()) if self.policy is not None else None
        )
        with compressing(self.session):
            self._forward(self.input_ids[:, positions], blended_mask(positions, n, self.device), positions[None])
        self.cache = plain_cache(self.model, cache)  # the blending cache's closure holds the placed segments
        if self.session is not None:
            self.session.cache = self.cache

    def policy_stats(self) -> dict:
        """The policy state's own measurements (empty without one; byte counts are the whole batch's),
        and a rolling prefill's chunks, peak entries and highest position."""
        stats = self.policy_state.stats() if self.policy_state is not None else {}
        return {**stats, **self.rolling.to_dict()} if self.rolling is not None else stats

    def row_kept_tokens(self, row: int) -> list[int]:
        """Real (non-padding) prompt tokens kept per layer for ``row``.

        Padding sits on the left and is kept only when a row has fewer real tokens than a
        layer keeps (see the selection contract), so this is ``min(real, entries)``.
        """
        return [min(self.row_lengths[row], k) for k in self.kept_tokens_per_layer]

    def row_kv_bytes(self, row: int) -> tuple[int, int]:
        """``(kept, full)`` prompt K/V bytes of ``row``'s real tokens."""
        kept = full = 0.0
        for per_token, per_full_token, k in zip(self.token_bytes_per_layer, self.full_token_bytes_per_layer, self.kept_tokens_per_layer):
            kept += min(self.row_lengths[row], k) * per_token
            full += self.row_lengths[row] * per_full_token
        return round(kept), round(full)

    def _masks(self, tokens: torch.Tensor, positions: torch.Tensor):
        """The attention-mask argument for a decode forward: 2-D, or one 4-D mask per layer kind."""
        if self._sliding_mask is None:
            return self._kv_mask
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = self.model.config.get_text_config(decoder=True)
        stub = torch.empty(tokens.shape[0], tokens.shape[1], 1, dtype=self.model.dtype, device=tokens.device)
        common = dict(config=config, inputs_embeds=stub, cache=self.cache, position_ids=positions)
        return {
            "full_attention": create_causal_mask(attention_mask=self._kv_mask, **common),
            "sliding_attention": create_sliding_window_causal_mask(attention_mask=self._sliding_mask, **common),
        }

    def _extend(self, tokens: torch.Tensor, *, last_only: bool = True) -> torch.Tensor:
        """Append ``tokens [batch, t]`` after the cached ones, at their true positions."""
        t = tokens.shape[1]
        positions = self._last_position + 1 + torch.arange(t, device=tokens.device)
        self._last_position = positions[:, -1:]
        if self._kv_mask is not None:
            self._kv_mask = torch.cat([self._kv_mask, self._kv_mask.new_ones(self.batch_size, t)], dim=-1)
        if self._sliding_mask is not None:
            self._sliding_mask = torch.cat([self._sliding_mask, self._sliding_mask.new_ones(self.batch_size, t)], dim=-1)
        with observing(self.span_attention):
            return self._forward(tokens, self._masks(tokens, positions), positions, last_only=last_only)

    @torch.inference_mode()
    def steps(self) -> Generator[torch.Tensor, None, None]:
        logits = self._prefill()
        generator = make_generator(self.params, self.device)
        for step in range(self.params.max_new_tokens):
            tokens = choose_tokens(logits, step, self.params, generator, self.eos_ids, self.constraint)
            yield tokens
            if step + 1 == self.params.max_new_tokens:
                return
            start = device_clock(self.device)
            logits = self.decode_step(tokens)
            self.timings.step_seconds.append(device_clock(self.device) - start)

    def hand_over(self):
        """Give the prefilled cache to a running batch: ``(cache, mask [batch, entries] or None,
        last positions [batch, 1])``; this run keeps an empty cache."""
        from transformers import DynamicCache

        handed = (self.cache, self._kv_mask, self._last_position)
        self.cache = DynamicCache(config=self.model.config)
        self._kv_mask = None
        return handed

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row ``[batch]`` and run the policy's after-step; the next logits ``[batch, vocab]``."""
        self._extend(tokens[:, None])
        self._after_step()
        return self.last_logits

    def extend_all(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens [1, t]`` (a token and its draft); the logits ``[t, vocab]`` after each."""
        return self._extend(tokens, last_only=False)[0]

    def drop_last(self, count: int) -> None:
        """Remove the last ``count`` appended entries (rejected draft tokens) from the cache."""
        if count <= 0:
            return
        drop_last(self.cache, count)
        self._last_position = self._last_position - count
        if self._kv_mask is not None:
            self._kv_mask = self._kv_mask[:, :-count]

    def after_step(self) -> None:
        """What the policy does after a decode forward (LESS's step time; decode-time cuts)."""
        self._after_step()

    def _after_step(self) -> None:
        if self.policy_state is not None:
            self._kv_mask = self.policy_state.after_step(self.cache, self._kv_mask)

    def teacher_force(self, continuation: list[int], *, train: bool = False) -> torch.Tensor:
        """Logits ``[len(continuation), vocab]`` predicting each continuation token (batch of 1).

        Row 0 comes from the prefill; the rest from one forward over ``continuation[:-1]``
        through the (compressed) cache, so it measures exactly what decoding would see. A
        policy that cuts the cache during decoding is fed one token at a time, as it decodes.

        ``train=True`` is how the tuner reads through the kept cache: the prefill runs
        without gradients (row 0 carries none) and the continuation's forward with them.
        """
        if self.batch_size != 1 or not continuation:
            raise ValueError("teacher_force takes one prompt and a non-empty continuation")
        compacts = self.policy_state is not None and self.policy_state.compacts
        if train and compacts:
            raise ValueError("training through a policy that cuts the cache during decoding is not supported")
        with torch.inference_mode(mode=not train):
            with torch.no_grad():
                first = self._prefill()
            if len(continuation) == 1:
                return first
            if compacts:
                rows = [first]
                for token in continuation[:-1]:
                    rows.append(self._extend(torch.tensor([[token]], device=self.device))[0, -1:])
                    self._after_step()
                return torch.cat(rows, dim=0)
            rest = self._extend(torch.tensor([continuation[:-1]], device=self.device), last_only=False)[0]
            return torch.cat([first, rest], dim=0)
