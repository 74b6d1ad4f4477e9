"""Apply a policy inside the model's prefill, one layer at a time, with no model-specific code.

The engine registers an attention function (``snapkv_sdpa``, ``snapkv_flash_attention_2``) through
transformers' public ``AttentionInterface``. It runs the stock implementation and, while a
:class:`PrefillCompression` is active, hands the layer's post-RoPE queries and keys to the
policy and shrinks that layer's cache entry right away. So at most one layer holds its
full K/V at any moment, the cache keeps ``kv_heads`` heads, and every architecture whose
attention goes through the interface (Llama, Mistral, Qwen2/3, Gemma, Phi3, ...) works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import InvalidCompressionError
from ..model.portable import portable_enabled
from .base import CompressionPolicy, window_attention
from .decoding import keep_entries
from .own_attention import mask_decode_scores
from .quantized import active_quantized_layer
from .ragged import RaggedHeadsLayer, active_ragged_layer
from .rotary import angles_for_layer
from .span_attention import active_observer

if TYPE_CHECKING:
    from .decoding import PolicyState

_ACTIVE: ContextVar[PrefillCompression | ScoringSession | None] = ContextVar("snapkv_rag_prefill", default=None)
_RECORDER: ContextVar[list[KeptIndices] | None] = ContextVar("snapkv_rag_kept_recorder", default=None)
_VOTE_RECORDER: ContextVar[list[WindowVotes] | None] = ContextVar("snapkv_rag_vote_recorder", default=None)
# The policy state of the decode run whose forward is running (None: the policy has none).
_POLICY_STATE: ContextVar[PolicyState | None] = ContextVar("snapkv_rag_policy_state", default=None)
# Training capture (``snapkv-rag less train``): called with every layer's attention inputs and output.
_CAPTURE: ContextVar[Callable | None] = ContextVar("snapkv_rag_capture", default=None)
# The running forward attends causally over everything cached (no padding, no explicit mask):
# its new tokens see every cached entry and each other causally (see cached_prefix_attention).
_PLAIN_CAUSAL: ContextVar[bool] = ContextVar("snapkv_rag_plain_causal", default=False)
# An early exit: the forward stops when it reaches a layer past this one (a read that only needs
# the votes of the layers up to here, e.g. the skim's heads).
_EXIT_AFTER: ContextVar[int | None] = ContextVar("snapkv_rag_exit_after_layer", default=None)
# A read that wants the window's votes and not the compressed cache (nothing decodes from it): the
# selection is skipped (it changes no later layer of the same forward, so the votes are the same).
_VOTES_ONLY: ContextVar[bool] = ContextVar("snapkv_rag_votes_only", default=False)


class LayersDone(Exception):
    """Raised at the first layer past :func:`exiting_after_layer`'s: the forward has done what the read needs."""


# Implementations registered globally in transformers (eager is per-model code, so it cannot be wrapped).
WRAPPED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2")


def wrapped_name(base: str) -> str:
    return f"snapkv_{base}"


def attention_kernel(model) -> str:
    """The attention implementation the model runs (``sdpa``, ``flash_attention_2``), unwrapped."""
    name = str(model.config._attn_implementation)
    return name.removeprefix(wrapped_name(""))


# One query token on the CPU goes through decode_attention (matmul + softmax) instead of SDPA:
# torch's CPU SDPA takes a slow path for a bf16 query with grouped KV heads and no mask (3.8 ms
# per layer at 7,800 keys here, against 0.18 ms for the matmuls); fp32 costs the same either way.
FAST_DECODE_ATTENTION = True
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def decode_attention(module, query, key, value, attention_mask, scaling=None, **_):
    """Attention of one query token per row, as ``sdpa_attention_forward`` returns it.

    ``query`` ``[b, heads, 1, d]``; ``key``/``value`` ``[b, kv_heads, n, d]`` (grouped query heads
    share their KV head, no copy); ``attention_mask`` None, bool (True = attend) or additive,
    broadcastable to ``[b, heads, 1, n]``. Scores in the input dtype, softmax in float32.
    Returns ``([b, 1, heads, d], None)``.
    """
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    q = query.reshape(b, kv_heads, groups, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [b, kv_heads, groups, n]
    scores = mask_decode_scores(scores, attention_mask)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv_heads, groups, d]
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def draft_attention(query, key, value, attention_mask, scaling=None):
    """:func:`decode_attention` for ``t`` query tokens per row (a token and its draft): ``attention_mask``
    bool ``[b, 1, t, n]`` (True = attend). Returns ``([b, t, heads, d], None)``."""
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    q = query.reshape(b, kv_heads, groups * t, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [b, kv_heads, groups * t, n]
    scores = scores.reshape(b, kv_heads, groups, t, -1).masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).reshape(b, kv_heads, groups * t, -1)
    out = torch.matmul(probs, value)  # [b, kv_heads, groups * t, d]
    return out.reshape(b, heads, t, d).transpose(1, 2).contiguous(), None


# Several new tokens over cached keys on the CPU (a prompt's rest after a reused prefix, a later
# prefill chunk) go through cached_prefix_attention instead of SDPA with an explicit mask, which
# cost 1.4-1.7x as much per layer here (2K keys, a quarter to half of them cached).
FAST_PREFIX_ATTENTION = True


def cached_prefix_attention(query, key, value, scaling=None):
    """Attention of ``q`` new tokens that see the ``n - q`` cached entries before them and each
    other causally, as the causal mask with an offset gives, in two maskless flash-attention
    calls (the cached part in full, the new part causal) merged by their log-sum-exp, as flash
    attention merges blocks. ``query`` ``[b, heads, q, d]``, ``key``/``value``
    ``[b, kv_heads, n, d]`` with ``n > q``. Returns ``[b, q, heads, d]``."""
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    cached = key.shape[2] - q
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The cached part has no mask, so a KV head's query heads can be stacked along the query
    # axis: no copy of the cache per query head (repeating the keys cost more than the attention).
    stacked = query.reshape(b, kv_heads, groups * q, d)
    before, lse_before = flash(stacked, key[:, :, :cached], value[:, :, :cached], 0.0, False, scale=scaling)
    before, lse_before = before.reshape(b, heads, q, d), lse_before.reshape(b, heads, q)
    new_keys, new_values = key[:, :, cached:], value[:, :, cached:]
    if groups > 1:
        new_keys, new_values = new_keys.repeat_interleave(groups, dim=1), new_values.repeat_interleave(groups, dim=1)
    among, lse_among = flash(query, new_keys, new_values, 0.0, True, scale=scaling)
    lse = torch.logaddexp(lse_before, lse_among)
    out = before.float() * (lse_before - lse).exp().unsqueeze(-1) + among.float() * (lse_among - lse).exp().unsqueeze(-1)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def _fast_prefix(module, query, key, kwargs) -> bool:
    return (
        FAST_PREFIX_ATTENTION
        and not portable_enabled()
        and _PLAIN_CAUSAL.get()
        and 1 < query.shape[2] < key.shape[2]
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and not getattr(module, "training", False)
        and not kwargs.get("dropout")
        and kwargs.get("sliding_window") is None
        and getattr(module, "sliding_window", None) is None
        and getattr(module, "is_causal", True)
        and all(kwargs.get(k) is None for k in _UNSUPPORTED)
    )


@contextmanager
def plain_causal(active: bool) -> Iterator[None]:
    """Mark the model calls inside the block as attending causally over the whole cache."""
    token = _PLAIN_CAUSAL.set(active)
    try:
        yield
    finally:
        _PLAIN_CAUSAL.reset(token)


def _fast_decode(module, query, kwargs) -> bool:
    return (
        FAST_DECODE_ATTENTION
        and not portable_enabled()
        and query.shape[2] == 1
        and query.device.type == "cpu"
        and not getattr(module, "training", False)
        and not kwargs.get("dropout")
        and all(kwargs.get(k) is None for k in _UNSUPPORTED)
    )


def _make_attention(base_fn):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if torch.compiler.is_compiling():
            # the compiled decode step (snapkv_rag.engine.compiled_decode) over a static cache, nothing
            # listening: one token per row through the eager decode path's kernel, a token and its draft
            # through the same operations with a query axis
            if kwargs.get("sliding_window") is not None or any(kwargs.get(k) is not None for k in _UNSUPPORTED):
                raise NotImplementedError("the compiled decode step has no sliding window, softcap or sinks")
            if query.shape[2] == 1:
                return decode_attention(module, query, key, value, attention_mask, **kwargs)
            return draft_attention(query, key, value, attention_mask, kwargs.get("scaling"))
        last = _EXIT_AFTER.get()
        if last is not None and module.layer_idx > last:
            raise LayersDone(last)
        quantized = active_quantized_layer(module.layer_idx)
        if quantized is not None:
            if quantized.quantized_entries and _fast_decode(module, query, kwargs) and _reads_output_only():
                return quantized.attend(query, attention_mask, kwargs.get("scaling")), None
            key, value = quantized.keys, quantized.values  # dequantized: several tokens, or a hook that reads the keys
        if attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
            # a layer kept fewer entries than the widest (per-layer budgets): its mask is the
            # widest one's last columns (see CompressionPolicy.for_layer)
            attention_mask = attention_mask[..., -key.shape[2] :]
        ragged = active_ragged_layer(module.layer_idx)
        if ragged is not None:
            output = (ragged.attend(query, kwargs.get("scaling")), None)
        elif _fast_decode(module, query, kwargs):
            output = decode_attention(module, query, key, value, attention_mask, **kwargs)
        elif _fast_prefix(module, query, key, kwargs):
            output = (cached_prefix_attention(query, key, value, kwargs.get("scaling")), None)
        else:
            output = base_fn(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] == 1:
            observer = active_observer()
            if observer is not None:
                observer.observe(module.layer_idx, query, key, attention_mask, kwargs.get("scaling"))
        capture = _CAPTURE.get()
        if capture is not None:
            capture(module, query, key, value, output[0], kwargs.get("scaling"))
        session = _ACTIVE.get()
        if session is not None:
            session.compress_layer(module, query, key, kwargs.get("scaling"), value)
            return output
        state = _POLICY_STATE.get()
        if state is not None:
            amended = state.attend(module.layer_idx, query, key, attention_mask, output[0], kwargs.get("scaling"))
            return (amended, *output[1:])
        return output

    return attention


def _reads_output_only() -> bool:
    """Whether nothing in the running forward reads the keys beside the attention output
    (no prefill selection, policy state, span observer or training capture)."""
    return _ACTIVE.get() is None and _POLICY_STATE.get() is None and active_observer() is None and _CAPTURE.get() is None


def register_attention_functions() -> None:
    """Idempotently register the wrapped attention and mask functions with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for base in WRAPPED_IMPLEMENTATIONS:
        name = wrapped_name(base)
        if name in ALL_ATTENTION_FUNCTIONS:
            continue
        AttentionInterface.register(name, _make_attention(ALL_ATTENTION_FUNCTIONS[base]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def sliding_layers(config) -> list[bool]:
    """Which decoder layers use sliding-window attention (those are left uncompressed)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return [t != "full_attention" for t in layer_types]
    return [False] * text.num_hidden_layers


def select_for_prompt(
    policy: CompressionPolicy,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling,
    protected: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """``policy``'s kept indices over a prompt's keys; a windowed policy votes with the prompt's last queries
    (a policy that weighs entries by their values, :attr:`~.base.CompressionPolicy.reads_values`, gets them)."""
    extra = {"values": value} if policy.reads_values and value is not None else {}
    return policy.select(voting_queries(policy, query), key, mask, scaling=scaling, protected=protected, **extra)


def voting_queries(policy: CompressionPolicy, query: torch.Tensor) -> torch.Tensor:
    window = policy.query_window
    return query if window is None else query[:, :, query.shape[2] - window :]


class ScoringSession(Protocol):
    """What listens to each layer's queries and keys during a forward without compressing it (KVzip's repeat)."""

    def compress_layer(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float | None, value: torch.Tensor | None = None) -> None: ...


class PrefillCompression:
    """State of one compressed prefill: the policy, the cache it shrinks, what was kept.

    ``policy`` is one policy for the whole batch, or one per row (a question-aligned
    window resolves to a different window per row); rows with different policies are
    selected one at a time, and all return the same number of entries.
    """

    def __init__(
        self,
        policy: CompressionPolicy | Sequence[CompressionPolicy],
        cache,
        attention_mask: torch.Tensor | None,
        sliding: list[bool],
        state: PolicyState | None = None,
        protected: torch.Tensor | None = None,
    ):
        rows = [policy] if isinstance(policy, CompressionPolicy) else list(policy)
        self.row_policies = rows if len(set(rows)) > 1 else None
        self.policy = rows[0]
        self.cache = cache
        self.attention_mask = attention_mask
        self.sliding = sliding
        # layer -> [batch, kv_heads, k], or per-head budgets: one [k_h] tensor per head (batch of one); for inspection
        self.kept_indices: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.kept_attention_mask: torch.Tensor | None = None  # the widest compressed layer's padding mask
        self.widest_kept = 0
        self.full_layers = [i for i, s in enumerate(sliding) if not s]  # the layers a policy compresses
        self.prompt_length = 0  # n, the (left-padded) prompt length seen by the compressed layers
        # layer -> its full (K, V) before selection, when the engine's prefix cache wants them
        self.full_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        # the policy's decode-time state, told what each layer's selection evicts
        self.state = state
        self.protected = protected  # [batch, n] bool: prompt positions every layer keeps (keep_texts)
        # layer -> [q_heads, n]: the observation window's attention mass on each key (one prompt), while
        # recording_window_votes() listens; None otherwise
        self.votes: dict[int, torch.Tensor] | None = {} if _VOTE_RECORDER.get() is not None else None

    def compress_layer(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float | None, value: torch.Tensor | None = None) -> None:
        layer_idx = module.layer_idx
        with angles_for_layer(layer_idx):
            self._compress_layer(layer_idx, query, key, scaling, value)

    def _compress_layer(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None, value: torch.Tensor | None) -> None:
        n = key.shape[2]
        self.prompt_length = n
        if self.sliding[layer_idx]:
            return
        if self.full_kv is not None:
            layer = self.cache.layers[layer_idx]
            self.full_kv[layer_idx] = (layer.keys, layer.values)
        position, layers = self.full_layers.index(layer_idx), len(self.full_layers)
        layer_policy = self.policy.for_layer(position, layers)
        if self.votes is not None:
            self.record_votes(layer_idx, layer_policy, query, key, scaling)
            if _VOTES_ONLY.get() and _RECORDER.get() is None:
                return
        if layer_policy.ragged_heads and n > layer_policy.max_capacity_prompt:
            self.keep_heads(layer_idx, layer_policy, query, key, scaling)
            return
        if self.row_policies is None:
            indices = select_for_prompt(layer_policy, query, key, self.attention_mask, scaling, self.protected, value)
        else:
            mask = self.attention_mask
            indices = torch.cat(
                [
                    select_for_prompt(
                        p.for_layer(position, layers),
                        query[i : i + 1],
                        key[i : i + 1],
                        None if mask is None else mask[i : i + 1],
                        scaling,
                        None if self.protected is None else self.protected[i : i + 1],
                        None if value is None else value[i : i + 1],
                    )
                    for i, p in enumerate(self.row_policies)
                ]
            )
        self.kept_indices[layer_idx] = indices
        if self.attention_mask is not None and indices.shape[-1] > self.widest_kept:
            # the decode mask is the widest layer's; narrower layers use its last columns
            self.widest_kept = indices.shape[-1]
            self.kept_attention_mask = self.attention_mask.gather(1, indices[:, 0]) if indices.shape[-1] < n else self.attention_mask
        if indices.shape[-1] < n:
            self.keep(layer_idx, indices, query, scaling)

    def record_votes(self, layer_idx: int, policy: CompressionPolicy, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        """Each query head's attention mass from the window on each key of one prompt (summed over the window's queries)."""
        assert self.votes is not None
        w = policy.query_window
        if not w or query.shape[0] != 1:
            return
        attention = window_attention(query[:, :, -w:], key, self.attention_mask, scaling, key.shape[2] - w)  # [1, kv, group, w, n]
        self.votes[layer_idx] = attention[0].sum(dim=2).flatten(0, 1).cpu()  # [q_heads, n], heads in the model's order

    def keep_heads(self, layer_idx: int, policy: CompressionPolicy, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        """Per-head budgets: replace the layer's cache entry by a ragged one holding each head's own entries."""
        if key.shape[0] != 1 or self.attention_mask is not None or self.state is not None:
            raise InvalidCompressionError("per-head budgets (heads=adaptive) run one unpadded prompt at a time, without LESS or decode-time cuts")
        kept = policy.select_heads(voting_queries(policy, query), key, scaling=scaling, protected=self.protected)
        self.kept_indices[layer_idx] = tuple(kept)
        layer = self.cache.layers[layer_idx]
        self.cache.layers[layer_idx] = RaggedHeadsLayer.from_selection(layer.keys, layer.values, kept)

    def keep(self, layer_idx: int, indices: torch.Tensor, query: torch.Tensor | None = None, scaling: float | None = None) -> None:
        """Shrink the layer's cache entry to ``indices [batch, kv_heads, k]``; the policy state hears of the rest."""
        layer = self.cache.layers[layer_idx]
        if self.state is not None:
            self.state.evicted(layer_idx, layer.keys, layer.values, indices, self.attention_mask, query, scaling)
        keep_entries(layer, indices)


@dataclass(frozen=True)
class KeptIndices:
    """Which prompt positions one compressed prefill kept, per layer and KV head.

    ``layers``: layer index -> LongTensor ``[batch, kv_heads, k]`` of kept positions in the
    left-padded prompt of length ``prompt_length`` (on CPU), or, with per-head budgets (one
    prompt), a tuple of one LongTensor ``[k_h]`` per KV head. Layers the policy leaves whole
    (sliding-window layers) are absent.
    """

    prompt_length: int
    layers: dict[int, torch.Tensor | tuple[torch.Tensor, ...]]

    def share(self, row: int = 0) -> torch.Tensor:
        """``[prompt_length]`` floats: the fraction of (compressed layer, KV head) pairs that
        kept each position of batch row ``row``. Its sum is the entries kept per layer and
        head, on average."""
        n = self.prompt_length
        counts = torch.zeros(n, dtype=torch.float64)
        pairs = 0
        for indices in self.layers.values():
            heads = list(indices) if isinstance(indices, tuple) else list(indices[row])
            for head in heads:
                counts += torch.bincount(head, minlength=n).to(torch.float64)
            pairs += len(heads)
        return counts / pairs if pairs else torch.ones(n, dtype=torch.float64)


@dataclass(frozen=True)
class WindowVotes:
    """How much one compressed prefill's observation window attended to each prompt position.

    ``layers``: layer index -> float32 ``[query_heads, prompt_length]``, each head's softmaxed
    attention from the window's queries (the question with ``window=question``) on each position,
    summed over the queries, as the policy saw it when it selected. A rolling prefill scores each position once,
    in the forward that read it (its chunk, after the entries kept from before; the window's own
    positions hold 0). One prompt only; layers the policy leaves whole are absent.
    """

    prompt_length: int
    layers: dict[int, torch.Tensor]


@contextmanager
def recording_window_votes() -> Iterator[list[WindowVotes]]:
    """Collect the observation window's votes of every compressed prefill run inside the block
    (a :class:`WindowVotes` each; off unless asked for: it costs one more window-attention
    product per layer). :mod:`snapkv_rag.rag.skim` ranks documents by them."""
    with _recording(_VOTE_RECORDER) as recorded:
        yield recorded


@contextmanager
def _recording(recorder: ContextVar) -> Iterator[list]:
    """A fresh list in ``recorder`` for the block (a context variable: other threads do not see it)."""
    recorded: list = []
    token = recorder.set(recorded)
    try:
        yield recorded
    finally:
        recorder.reset(token)


def record_window_votes(votes: WindowVotes) -> None:
    """Hand ``votes`` to the listening :func:`recording_window_votes` (none: dropped)."""
    recorder = _VOTE_RECORDER.get()
    if recorder is not None:
        recorder.append(votes)


def _on_cpu(indices: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tuple(i.detach().cpu() for i in indices) if isinstance(indices, tuple) else indices.detach().cpu()


@contextmanager
def recording_kept_indices() -> Iterator[list[KeptIndices]]:
    """Collect what every compressed prefill run inside the block kept (off unless asked for).

    Opt-in inspection for tools such as the app's kept-entries picture; a full-cache call
    records nothing. The prefill runs when ``generate``/``stream`` is called, so only the
    call needs to sit inside the block::

        with recording_kept_indices() as kept:
            stream = engine.stream(prompt, compression="snapkv:budget=256")
        ...  # iterate the stream
        kept[-1].share()  # per position: the share of layers and heads that kept it

    The recorder is a context variable: other threads (other app sessions) do not see it.
    """
    with _recording(_RECORDER) as recorded:
        yield recorded


@contextmanager
def policy_attention(state: PolicyState | None) -> Iterator[None]:
    """Consult ``state`` in the attention of the model calls inside the block (None: off)."""
    token = _POLICY_STATE.set(state)
    try:
        yield
    finally:
        _POLICY_STATE.reset(token)


@contextmanager
def exiting_after_layer(layer: int | None, model=None) -> Iterator[None]:
    """Stop the model calls inside the block after layer ``layer`` (None: run every layer); the
    forward then ends in :class:`LayersDone`, which the engine's read-only path catches. With
    ``model``, its decoder layers past the exit do not start at all (hooks for the block, removed
    after it; only this context's forwards see the exit); without, the forward stops in the
    attention of the first layer past it."""
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValueError(f"the layer to exit after must be a non-negative integer, got {layer!r}")
    handles = []
    if layer is not None and model is not None:
        for module in model.modules():
            layer_idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
            if isinstance(layer_idx, int) and layer_idx > layer:
                handles.append(module.register_forward_pre_hook(_exit_before))
    token = _EXIT_AFTER.set(layer)
    try:
        yield
    finally:
        _EXIT_AFTER.reset(token)
        for handle in handles:
            handle.remove()


def _exit_before(module, args) -> None:
    last = _EXIT_AFTER.get()  # this forward's exit (another read's hooks may be on the model too)
    if last is not None and module.self_attn.layer_idx > last:
        raise LayersDone(last)


@contextmanager
def votes_only(active: bool = True) -> Iterator[None]:
    """Inside the block, a prefill that records window votes (and no kept indices) selects nothing:
    for a read that is thrown away after its votes (:meth:`~snapkv_rag.engine.engine.Engine.read_prompt`
    in one window; a rolled read needs each chunk's selection for the next)."""
    token = _VOTES_ONLY.set(active)
    try:
        yield
    finally:
        _VOTES_ONLY.reset(token)


@contextmanager
def capturing(callback: Callable | None) -> Iterator[None]:
    """Call ``callback(module, query, key, value, output, scaling)`` for every attention call in the block."""
    token = _CAPTURE.set(callback)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


@contextmanager
def compressing(session: PrefillCompression | ScoringSession | None, *, record: bool = True) -> Iterator[PrefillCompression | ScoringSession | None]:
    """Activate ``session`` for the model calls inside the block (None: no compression).
    ``record=False``: what it keeps is not prompt positions (a rolling prefill's chunks), so
    :func:`recording_kept_indices` does not hear of it. A :class:`ScoringSession` only listens."""
    token = _ACTIVE.set(session)
    try:
        yield session
        if not isinstance(session, PrefillCompression):
            return
        recorder = _RECORDER.get()
        if recorder is not None and record:
            layers = {layer: _on_cpu(idx) for layer, idx in session.kept_indices.items()}
            recorder.append(KeptIndices(session.prompt_length, layers))
        if record and session.votes:
            record_window_votes(WindowVotes(session.prompt_length, dict(session.votes)))
    finally:
        _ACTIVE.reset(token)
