"""The compression-policy contract and the selection step every policy shares.

``policy.select(queries, keys, attention_mask=None, *, scaling=None, protected=None) -> indices``

- ``queries``: post-RoPE queries of the last ``policy.query_window`` prompt positions,
  ``[batch, q_heads, window, head_dim]`` (all positions when ``query_window`` is None,
  none when it is 0);
- ``keys``: post-RoPE keys ``[batch, kv_heads, n, head_dim]``; ``q_heads`` is a multiple
  of ``kv_heads`` (GQA groups are reduced to one score per KV head);
- ``attention_mask``: ``[batch, n]``, 1 for real tokens, 0 for left padding;
- returns ``LongTensor [batch, kv_heads, k]``, ``k = min(n, max_capacity_prompt)``,
  sorted ascending. The last ``recent`` positions (the observation window) are always
  kept. Padding is never chosen while real tokens remain; a row with fewer real tokens
  than ``k`` keeps all of them and fills its remaining slots with its *earliest* padding
  positions. Those filler slots therefore come first and are the same for every head, so
  ``attention_mask.gather(1, indices[:, 0])`` is the row's mask over the kept entries.
- ``protected``: ``[batch, n]`` bool, positions every head keeps whatever their score (texts a
  caller names with ``keep_texts``, such as document labels), as many as fit beside the window
  (the earliest first when they do not all fit); None: none.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import InvalidCompressionError
from .decoding import PolicyState
from .quantized import check_kv_bits

DECODE_FIELDS = ("decode_budget", "decode_interval")
OPTIONAL_FIELDS = (*DECODE_FIELDS, "rolling", "kv_bits")  # left out of a spec when unset
MIN_ROLLING = 16
DEFAULT_DECODE_INTERVAL = 64


def check_positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidCompressionError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")


def check_choice(owner: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise InvalidCompressionError(f"{owner}: unknown {name} {value!r}; choose one of {', '.join(map(str, choices))}")


class CompressionPolicy(ABC):
    """A prompt KV-cache selection rule. Subclasses are frozen dataclasses."""

    name: ClassVar[str]
    max_capacity_prompt: int
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every concrete policy is a dataclass

    @property
    def query_window(self) -> int | None:
        """Trailing prompt queries that :meth:`select` needs (None: all of them)."""
        return 0

    @property
    def needs_question_span(self) -> bool:
        """True when the policy must be resolved per prompt with :meth:`for_prompt` first."""
        return False

    def for_prompt(self, question_tokens: int | None) -> CompressionPolicy:
        """This policy for one prompt whose question spans ``question_tokens`` trailing tokens."""
        return self

    @property
    def question_aware(self) -> bool:
        """True when the kept set depends on the end of the prompt (the question)."""
        return False

    @property
    def repeats_context(self) -> bool:
        """True when the policy scores a context by the model's repeat of it (:mod:`.kvzip`): the engine
        reads ``context + repeat prompt + context`` and keeps entries of the first copy only."""
        return False

    @property
    def needs_rotary_angles(self) -> bool:
        """True when :meth:`select` moves queries to other positions (:mod:`.rotary`): the engine then names the model's angles."""
        return False

    @property
    def reads_values(self) -> bool:
        """True when :meth:`select` also takes the prompt's ``values`` (weighing entries by their values)."""
        return False

    @property
    def ragged_heads(self) -> bool:
        """True when the KV heads of a layer keep different numbers of entries (:meth:`select_heads`)."""
        return False

    def select_heads(
        self, queries: torch.Tensor, keys: torch.Tensor, *, scaling: float | None = None, protected: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Per-head selection for one unpadded prompt (``batch == 1``): one ascending LongTensor of
        kept positions per KV head, of different lengths. Only policies with :attr:`ragged_heads`."""
        raise InvalidCompressionError(f"{type(self).__name__} selects the same number of entries for every head")

    @abstractmethod
    def select(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        scaling: float | None = None,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def with_budget(self, budget: int) -> CompressionPolicy:
        """This policy with ``max_capacity_prompt = budget`` (validated)."""
        return dataclasses.replace(self, max_capacity_prompt=budget)

    def with_query_window(self, window: int) -> CompressionPolicy:
        """This policy voting with ``window`` trailing queries (policies without a window ignore it)."""
        return self

    @property
    def can_roll(self) -> bool:
        """Whether this policy can read a prompt past the model's window (``rolling=``)."""
        return False

    def with_rolling(self, chunk: int | None) -> CompressionPolicy:
        """This policy reading the prompt ``chunk`` tokens at a time (None: whole)."""
        if chunk is None:
            return self
        raise InvalidCompressionError(f"{type(self).__name__} cannot read a prompt past the window (rolling=); use a sparse policy such as SnapKV")

    def with_bits(self, bits: int | None) -> CompressionPolicy:
        """This policy storing its kept entries in ``bits`` (8 or 4; None: full width)."""
        return self if bits == self.kv_bits else dataclasses.replace(self, kv_bits=bits)

    def with_settings(self, **settings: Any) -> CompressionPolicy:
        """This policy with other settings, named as in a spec (``chunk=16``, ``budget=512``) or by field."""
        from .settings import replaced_settings

        return replaced_settings(self, settings)

    def for_layer(self, position: int, layers: int) -> CompressionPolicy:
        """The policy for the ``position``-th of ``layers`` compressed layers (bottom first).

        Uniform policies return themselves; a per-layer budget schedule returns this policy at
        that layer's budget, so layers may hold different numbers of entries. The padding
        contract above keeps that safe in a padded batch: every layer's kept mask is the last
        columns of the widest layer's (filler slots come first).
        """
        return self

    # ------------------------------------------------------------ after the prefill
    decode_budget: int | None = None  # the fields are SparsePolicy's; policies without them read None
    decode_interval: int | None = None

    @property
    def decode_every(self) -> int:
        """Generated tokens between two decode-time cuts."""
        return self.decode_interval if self.decode_interval is not None else DEFAULT_DECODE_INTERVAL

    def for_decode(self) -> CompressionPolicy:
        """The policy that cuts the cache at decode time: this one at budget ``decode_budget``."""
        return dataclasses.replace(self, max_capacity_prompt=self.decode_budget, decode_budget=None, decode_interval=None)

    def check_decode_budget(self) -> None:
        """Validate ``decode_budget``/``decode_interval`` (call from ``__post_init__``)."""
        owner = type(self).__name__
        if self.decode_budget is None:
            if self.decode_interval is not None:
                raise InvalidCompressionError(f"{owner}: decode_interval applies only together with decode_budget (the entries to cut back to)")
            return
        check_positive_int(owner, "decode_budget", self.decode_budget)
        if self.decode_interval is not None:
            check_positive_int(owner, "decode_interval", self.decode_interval)
        try:
            self.for_decode()
        except InvalidCompressionError as exc:
            # the decode-time policy's own complaint, told in the terms the user set
            reason = str(exc).replace(f"max_capacity_prompt ({self.decode_budget})", f"decode_budget ({self.decode_budget})")
            reason = reason.replace("raise the budget", "raise decode_budget")
            raise InvalidCompressionError(f"{reason} (decode_budget is the budget of the decode-time cuts)") from None

    # ------------------------------------------------------------ rolling prefill
    rolling: int | None = None  # a SparsePolicy field; policies without it read None

    def check_rolling(self) -> None:
        """Validate ``rolling`` (call from ``__post_init__``)."""
        if self.rolling is not None:
            check_positive_int(type(self).__name__, "rolling", self.rolling, minimum=MIN_ROLLING)

    # ------------------------------------------------------------ stored width
    kv_bits: int | None = None  # 8 or 4 (None: full width): a field of SparsePolicy and of FullCache

    def check_kv_bits(self) -> None:
        """Validate ``kv_bits`` (call from ``__post_init__``)."""
        check_kv_bits(type(self).__name__, self.kv_bits)
        if self.kv_bits is not None and self.ragged_heads:
            raise InvalidCompressionError(f"{type(self).__name__}: kv_bits does not combine with head_budgets='adaptive' (per-head budgets keep ragged layers)")

    @property
    def window_bound(self) -> int:
        """The most trailing prompt tokens the policy votes with, before it is resolved for a prompt (0: none)."""
        return self.query_window or 0

    def prompt_positions(self, prompt_tokens: int) -> int:
        """Positions a prompt of ``prompt_tokens`` occupies in the model: all of them, or under
        ``rolling=N`` at most ``budget + N + window`` (the rest is read through the budget)."""
        if self.rolling is None:
            return prompt_tokens
        return min(prompt_tokens, self.max_capacity_prompt + self.rolling + self.window_bound)

    def decode_state(self, model, sliding: list[bool]) -> PolicyState | None:
        """This policy's state for one decode run, or None when nothing happens after the prefill."""
        if self.decode_budget is None:
            return None
        return PolicyState(self, sliding)

    def spec_fields(self) -> dict[str, Any]:
        """The dataclass fields that rebuild this policy, the policy's own first, then the shared
        options (:class:`SparsePolicy`) that are set."""
        fields = dataclasses.asdict(self)
        optional = {name: fields.pop(name) for name in OPTIONAL_FIELDS if name in fields}
        return fields | {name: value for name, value in optional.items() if value is not None}

    def settings(self) -> dict[str, Any]:
        out = {"method": self.name, **self.spec_fields()}
        out["question_aware"] = self.question_aware
        return out

    def spec(self) -> str:
        """The CLI string that rebuilds this policy."""
        fields = ",".join(f"{k}={v}" for k, v in self.spec_fields().items())
        return f"{self.name}:{fields}" if fields else self.name


@dataclass(frozen=True)
class SparsePolicy(CompressionPolicy):
    """A policy that keeps a budget of the prompt's entries, with the options every such policy
    takes, declared once (keyword-only, so each policy's own fields keep their positions)."""

    decode_budget: int | None = field(default=None, kw_only=True)  # cut the cache back to this many entries per layer during decoding
    decode_interval: int | None = field(default=None, kw_only=True)  # ... every this many generated tokens (None: 64)
    rolling: int | None = field(default=None, kw_only=True)  # prefill this many prompt tokens at a time, cut back to the budget after each (engine/rolling.py)
    kv_bits: int | None = field(default=None, kw_only=True)  # store kept entries in 8 or 4 bits (compression/quantized.py)

    @property
    def can_roll(self) -> bool:
        return True

    def with_rolling(self, chunk: int | None) -> CompressionPolicy:
        return self if chunk == self.rolling else dataclasses.replace(self, rolling=chunk)

    def check_shared_options(self) -> None:
        """Validate the options above (call from ``__post_init__``)."""
        self.check_decode_budget()
        self.check_rolling()
        self.check_kv_bits()


def keep_all(batch: int, kv_heads: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device).expand(batch, kv_heads, n).contiguous()


def keep_recent_and_top(
    prefix_scores: torch.Tensor,
    n: int,
    capacity: int,
    attention_mask: torch.Tensor | None,
    protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep the last ``n - p`` positions and the ``capacity - (n - p)`` best-scored prefix ones
    (``protected`` prefix positions first, see the module contract).

    ``prefix_scores``: ``[batch, kv_heads, p]``, non-negative, one per prefix position.
    Returns ``[batch, kv_heads, min(n, capacity)]`` ascending (see the module contract).
    """
    batch, kv_heads, prefix = prefix_scores.shape
    device = prefix_scores.device
    if n <= capacity:
        return keep_all(batch, kv_heads, n, device)
    recent = n - prefix
    if not 0 <= recent <= capacity:
        raise InvalidCompressionError(f"recent window {recent} does not fit in budget {capacity}")
    k = capacity - recent
    scores = protect(prefix_scores.float(), protected)
    if attention_mask is not None:
        # Real tokens score >= 0; padding ranks below every real token, earliest first.
        real = attention_mask[:, :prefix].bool()[:, None, :]
        filler = -(torch.arange(prefix, device=device, dtype=scores.dtype) + 1)
        scores = torch.where(real, scores, filler.expand_as(scores))
    # A stable sort breaks ties (max pooling makes exact plateaus) towards the earlier
    # position, so the choice does not depend on the row's padding offset or the batch.
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    window = torch.arange(prefix, n, device=device).expand(batch, kv_heads, recent)
    return torch.cat([top, window], dim=-1)


def protect(prefix_scores: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
    """``prefix_scores [b, h, p]`` with ``protected [b, n]`` prefix positions raised above every score."""
    if protected is None:
        return prefix_scores
    prefix = prefix_scores.shape[-1]
    return prefix_scores.masked_fill(protected[:, None, :prefix].to(prefix_scores.device), float("inf"))


def keep_adaptive(prefix_scores: torch.Tensor, n: int, capacity: int, floor: float, protected: torch.Tensor | None = None) -> list[torch.Tensor]:
    """AdaKV's allocation of one layer's budget over its heads, for one row.

    ``prefix_scores``: ``[1, kv_heads, p]`` comparable across heads (attention-derived votes).
    Every head keeps the last ``n - p`` positions; the ``kv_heads * (capacity - (n - p))``
    voted entries the layer may hold go to the best-scored (head, position) pairs of all its
    heads, after each head is first given its own best ``floor * (capacity - (n - p))``
    (AdaKV's safeguard; ``floor=1`` is the uniform per-head top-k), or all its ``protected``
    positions when they are more (up to its uniform share). Returns one ascending
    LongTensor per head; their lengths sum to ``kv_heads * min(n, capacity)``.
    """
    _, kv_heads, prefix = prefix_scores.shape
    device = prefix_scores.device
    if n <= capacity:
        return [torch.arange(n, device=device) for _ in range(kv_heads)]
    recent = n - prefix
    if not 0 <= recent <= capacity:
        raise InvalidCompressionError(f"recent window {recent} does not fit in budget {capacity}")
    k = capacity - recent
    scores = protect(prefix_scores.float(), protected)[0]
    # each head's own best first: the safeguard's share, or all its protected positions that fit
    protected_count = int(protected[0, :prefix].sum()) if protected is not None else 0
    guaranteed = max(int(floor * k), min(protected_count, k))
    kept = torch.zeros(kv_heads, prefix, dtype=torch.bool, device=device)
    if guaranteed:
        kept.scatter_(1, scores.sort(dim=-1, descending=True, stable=True).indices[:, :guaranteed], True)
    shared = kv_heads * (k - guaranteed)
    if shared:
        chosen = scores.masked_fill(kept, float("-inf")).reshape(-1).sort(descending=True, stable=True).indices[:shared]
        kept.view(-1)[chosen] = True
    window = torch.arange(prefix, n, device=device)
    return [torch.cat([kept[h].nonzero().squeeze(1), window]) for h in range(kv_heads)]


def group_queries(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, q_heads, w, d] -> [b, kv_heads, group, w, d]`` (GQA groups are contiguous)."""
    batch, q_heads, window, dim = queries.shape
    if q_heads % kv_heads:
        raise InvalidCompressionError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return queries.reshape(batch, kv_heads, q_heads // kv_heads, window, dim)


def window_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    query_start: int,
) -> torch.Tensor:
    """Softmaxed attention (fp32) of ``w`` queries at positions ``query_start..`` over all keys.

    Returns ``[b, kv_heads, group, w, n]``; never builds an ``n x n`` matrix.
    """
    kv_heads, n, dim = keys.shape[1], keys.shape[2], keys.shape[3]
    q = group_queries(queries, kv_heads).float()
    scale = dim**-0.5 if scaling is None else scaling
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys.float()) * scale
    w = q.shape[3]
    q_pos = torch.arange(query_start, query_start + w, device=keys.device)
    blocked = torch.arange(n, device=keys.device)[None, :] > q_pos[:, None]  # causal: [w, n]
    blocked = blocked[None, None, None]
    if attention_mask is not None:
        blocked = blocked | ~attention_mask.bool()[:, None, None, None, :]
    logits = logits.masked_fill(blocked, float("-inf"))
    # A padded query row sees nothing; give it zeros instead of NaN.
    return torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)


def reduce_groups(scores: torch.Tensor, how: str) -> torch.Tensor:
    """``[b, kv_heads, group, p] -> [b, kv_heads, p]``."""
    return scores.mean(dim=2) if how == "mean" else scores.amax(dim=2)
