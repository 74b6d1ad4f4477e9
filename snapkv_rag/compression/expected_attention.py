"""Expected Attention: keep the entries that *future* queries are expected to attend to.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution", 2025, arXiv:2510.00636 (kvpress's ``ExpectedAttentionPress``).

SnapKV scores each entry by the attention of the prompt's last queries, so what it keeps is chosen
for the question at the end. Expected Attention asks instead how much the queries still to come
will attend to each entry, in closed form and without another pass:

1. the prompt's last ``window`` queries are moved (with the model's rotary embedding,
   :mod:`.rotary`) to the position the first future query takes, and their mean ``mu`` and
   covariance ``Sigma`` per query head taken as the distribution of a query;
2. the rotation averaged over the next ``future`` positions is applied to both, since a query
   ``j`` positions further on is turned ``j`` steps more;
3. for a Gaussian query ``q ~ N(mu, Sigma)`` the expected unnormalised attention on key ``k`` is
   ``E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2)`` (``s`` the attention scaling); the scores
   are normalised over the keys (a softmax), averaged over each GQA group and, with ``vnorm``,
   weighted by the value's norm (an entry's contribution to the output is its weight times its value).

The last ``window`` entries and the first ``sink_tokens`` are always kept; with ``chunk_size=c``
whole spans of ``c`` tokens are kept by their summed scores, as SnapKV's ``chunk=`` keeps them. Without the model's
angles (the policy used on its own, a model without rotary positions) step 1 and 2 leave the
queries where they are. Because nothing in the score depends on what the question asks, a context
compressed this way before the question serves every follow-up question alike (the engine's
``keep_context``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import InvalidCompressionError
from . import rotary
from .base import SparsePolicy, check_choice, check_positive_int, group_queries, keep_all, keep_recent_and_top
from .snapkv import span_scores


@dataclass(frozen=True)
class ExpectedAttention(SparsePolicy):
    """Keep the ``window`` last entries, the first ``sink_tokens`` and the prefix entries with the most
    expected attention from the next ``future`` queries (see the module docstring)."""

    name = "expected"
    max_capacity_prompt: int = 1024
    window_size: int = 64  # the trailing queries whose statistics stand for the future ones; also kept whole
    future: int = 512  # future positions the rotation is averaged over
    sink_tokens: int = 4
    covariance: int = 1  # 0: the mean query alone
    vnorm: int = 1  # 0: attention alone, not weighted by the value's norm
    chunk_size: int = 1  # > 1: whole spans of this many tokens kept by their summed scores (as SnapKV's chunk=)

    def __post_init__(self) -> None:
        check_positive_int("ExpectedAttention", "max_capacity_prompt", self.max_capacity_prompt)
        check_positive_int("ExpectedAttention", "window_size", self.window_size)
        check_positive_int("ExpectedAttention", "future", self.future)
        check_positive_int("ExpectedAttention", "sink_tokens", self.sink_tokens, minimum=0)
        check_choice("ExpectedAttention", "covariance", self.covariance, (0, 1))
        check_choice("ExpectedAttention", "vnorm", self.vnorm, (0, 1))
        check_positive_int("ExpectedAttention", "chunk_size", self.chunk_size)
        if self.window_size + self.sink_tokens >= self.max_capacity_prompt:
            raise InvalidCompressionError(
                f"ExpectedAttention: window_size ({self.window_size}) plus sink_tokens ({self.sink_tokens}) must be smaller than "
                f"max_capacity_prompt ({self.max_capacity_prompt}); raise the budget or shrink the window"
            )
        self.check_shared_options()

    @property
    def query_window(self) -> int:
        return self.window_size

    @property
    def question_aware(self) -> bool:
        return True  # its statistics come from the prompt's end: ask for keep_context to leave the question out

    @property
    def needs_rotary_angles(self) -> bool:
        return True

    @property
    def reads_values(self) -> bool:
        return bool(self.vnorm)

    def with_query_window(self, window: int) -> ExpectedAttention:
        return self if window == self.window_size else dataclasses.replace(self, window_size=window)

    def query_statistics(self, queries: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The future queries' mean ``[b, kv_heads, group, d]`` and covariance ``[b, kv_heads, group, d, d]``
        (None without ``covariance``), from the window's ``queries [b, q_heads, w, d]``."""
        q = group_queries(queries, kv_heads).float()
        w = q.shape[3]
        here = rotary.angles(torch.arange(w, 0, -1, device=q.device))  # window query s moves w - s positions on
        if here is not None:
            q = rotary.rotate(q, here[0], here[1])
        mean = q.mean(dim=3)
        cov = None
        if self.covariance:
            centred = q - mean[..., None, :]
            cov = centred.transpose(-1, -2) @ centred / max(1, w - 1)
        ahead = rotary.angles(torch.arange(self.future, device=q.device))
        if ahead is not None:
            cos, sin = ahead[0].mean(dim=0), ahead[1].mean(dim=0)  # the rotation averaged over the future positions
            mean = rotary.rotate(mean, cos, sin)
            if cov is not None:
                cov = rotary.rotate(rotary.rotate(cov, cos, sin).transpose(-1, -2), cos, sin)
        return mean, cov

    def scores(
        self, queries: torch.Tensor, keys: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None, values: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each key's expected attention ``[b, kv_heads, n]`` (normalised over the keys, GQA groups averaged)."""
        kv_heads, dim = keys.shape[1], keys.shape[3]
        scale = dim**-0.5 if scaling is None else scaling
        mean, cov = self.query_statistics(queries, kv_heads)
        k = keys.float()
        logits = torch.einsum("bhgd,bhnd->bhgn", mean, k) * scale
        if cov is not None:
            logits = logits + 0.5 * scale**2 * torch.einsum("bhnd,bhgde,bhne->bhgn", k, cov, k)
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
        expected = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0).mean(dim=2)
        if self.vnorm and values is not None:
            expected = expected * values.float().norm(dim=-1)
        return expected

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None, values=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        if queries.shape[2] != self.window_size:
            raise InvalidCompressionError(f"ExpectedAttention expects {self.window_size} window queries, got {queries.shape[2]}")
        prefix = n - self.window_size
        scores = self.scores(queries, keys, attention_mask, scaling, values)[..., :prefix]
        if self.chunk_size > 1:
            scores = span_scores(scores, self.chunk_size)
        if self.sink_tokens:
            real = attention_mask.bool() if attention_mask is not None else torch.ones(b, n, dtype=torch.bool, device=keys.device)
            sinks = (real.cumsum(dim=1) <= self.sink_tokens) & real
            scores = scores.masked_fill(sinks[:, None, :prefix], float("inf"))
        return keep_recent_and_top(scores, n, self.max_capacity_prompt, attention_mask, protected)
