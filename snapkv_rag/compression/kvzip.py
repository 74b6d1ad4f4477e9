"""KVzip-style scoring: keep the entries the model reads while it repeats the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025,
arXiv:2505.23416.

A question asks for part of the context; to repeat the whole context the model must read all of
what it will ever be asked about. So after the context is prefilled (whole), the model is asked to
repeat it, a chunk at a time as the paper does (``repeat prompt + chunk`` run over the context's
cache at the positions after it, then dropped), and each context entry is scored by the most
attention any repeat query gives it (over the queries and the query heads of its GQA group). Each KV
head then keeps its ``max_capacity_prompt`` best entries and the first ``sink_tokens``; nothing of
the repeat stays, and what follows (the question) is read right after the context.

The repeat costs about a second prefill of the context (each chunk also attends to all of it); the
engine runs it for a context kept with ``keep_context`` only (:mod:`snapkv_rag.engine.kept_context`),
where it is paid once for every question asked of it. Chunks of ``repeat_chunk`` tokens keep the
highest position at ``context + prompt + chunk``, inside the model's window for a context of up to
its window less a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidCompressionError
from .base import SparsePolicy, check_positive_int, group_queries
from .decoding import keep_entries
from .snapkv import span_scores

#: What the model is asked before each chunk it repeats.
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


@dataclass(frozen=True)
class KVzip(SparsePolicy):
    """Keep each head's context entries that the model's repeat of the context attends to most (see the module docstring)."""

    name = "kvzip"
    max_capacity_prompt: int = 1024
    sink_tokens: int = 4
    repeat_chunk: int = 1024  # context tokens repeated per forward
    query_chunk: int = 256  # repeat queries scored at once (bounds the attention matrix)
    chunk_size: int = 1  # > 1: whole spans of this many tokens kept by their summed scores (as SnapKV's chunk=)

    def __post_init__(self) -> None:
        check_positive_int("KVzip", "max_capacity_prompt", self.max_capacity_prompt)
        check_positive_int("KVzip", "sink_tokens", self.sink_tokens, minimum=0)
        check_positive_int("KVzip", "repeat_chunk", self.repeat_chunk, minimum=16)
        check_positive_int("KVzip", "query_chunk", self.query_chunk)
        check_positive_int("KVzip", "chunk_size", self.chunk_size)
        if self.sink_tokens >= self.max_capacity_prompt:
            raise InvalidCompressionError(f"KVzip: sink_tokens ({self.sink_tokens}) must be smaller than max_capacity_prompt ({self.max_capacity_prompt})")
        for option in ("rolling", "kv_bits", "decode_budget"):
            if getattr(self, option) is not None:
                raise InvalidCompressionError(f"KVzip: {option}= is not offered with the repeat's scoring")
        self.check_shared_options()

    @property
    def repeats_context(self) -> bool:
        return True

    @property
    def can_roll(self) -> bool:
        return False

    def with_rolling(self, chunk: int | None) -> KVzip:
        if chunk is None:
            return self
        raise InvalidCompressionError("KVzip cannot read a prompt past the window (rolling=): it repeats the context inside it")

    def attention_from_repeat(self, queries: torch.Tensor, keys: torch.Tensor, context: int, scaling: float | None) -> torch.Tensor:
        """The most attention any of the repeat's ``queries`` (the last ``w`` positions of ``keys``) gives each of
        the first ``context`` keys: ``[b, kv_heads, context]``."""
        n, w = keys.shape[2], queries.shape[2]
        kv_heads, dim = keys.shape[1], keys.shape[3]
        scale = dim**-0.5 if scaling is None else scaling
        # the products in the model's own dtype (bf16 runs on the CPU's matrix units), the softmax in fp32
        k = keys.transpose(-1, -2)[:, :, None]  # [b, kv, 1, d, n]
        grouped = group_queries(queries, kv_heads).to(keys.dtype)  # [b, kv, group, w, d]
        best = torch.full((keys.shape[0], kv_heads, context), float("-inf"), device=keys.device)
        for lo in range(0, w, self.query_chunk):
            chunk = grouped[:, :, :, lo : lo + self.query_chunk]
            logits = (chunk @ k).float() * scale  # [b, kv, group, c, n]
            position = n - w + lo + torch.arange(chunk.shape[3], device=keys.device)
            later = torch.arange(n, device=keys.device)[None, :] > position[:, None]  # causal: only the repeat's own later keys
            logits[..., context:].masked_fill_(later[:, context:], float("-inf"))
            # each context key's weight is exp(logit - logsumexp): its most over the chunk's queries and the group's heads
            relative = logits[..., :context] - logits.logsumexp(dim=-1, keepdim=True)
            best = torch.maximum(best, relative.flatten(2, 3).amax(dim=2))
        return best.exp()

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """The kept positions ``[b, kv_heads, min(context, budget)]`` (ascending) from the repeat's ``scores [b, kv_heads, context]``."""
        context = scores.shape[-1]
        if context <= self.max_capacity_prompt:
            return torch.arange(context, device=scores.device).expand(*scores.shape[:2], context)
        scores = span_scores(scores, self.chunk_size) if self.chunk_size > 1 else scores.clone()
        scores[..., : self.sink_tokens] = float("inf")
        best = scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.max_capacity_prompt]  # ties: the earlier first
        return best.sort(dim=-1).values

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        raise InvalidCompressionError("KVzip scores a context by the model's repeat of it: use it with keep_context=True")


class RepeatScores:
    """Listens to the repeat's forwards (a :class:`~.runtime.ScoringSession`) and keeps, per compressed layer,
    the most attention each of the first ``context`` entries received; :meth:`shrink` then cuts the cache."""

    def __init__(self, policy: KVzip, context: int, sliding: list[bool]):
        self.policy = policy
        self.context = context
        self.sliding = sliding
        self.best: dict[int, torch.Tensor] = {}

    def compress_layer(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float | None, value: torch.Tensor | None = None) -> None:
        layer = module.layer_idx
        if self.sliding[layer]:
            return
        scores = self.policy.attention_from_repeat(query, key, self.context, scaling)
        self.best[layer] = scores if layer not in self.best else torch.maximum(self.best[layer], scores)

    def shrink(self, cache) -> None:
        """Keep each compressed layer's chosen entries of the context (the repeat's own were dropped already)."""
        for layer_idx, scores in self.best.items():
            layer = cache.layers[layer_idx]
            indices = self.policy.keep(scores)
            if indices.shape[-1] < layer.keys.shape[2]:
                keep_entries(layer, indices)
