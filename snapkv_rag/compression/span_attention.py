"""How much each generated token attended to given prompt spans: citations from the run itself.

A call with ``attend_to=[texts]`` (texts that appear in the prompt, e.g. the stuffed chunks)
gets :class:`SpanAttention` on its decode run. On every decode forward, the registered
attention function hands each full-attention layer's query and cached keys to it; it adds
the new token's softmaxed attention over the entries that came from each span (the entries
the policy kept, under compression), averaged over heads and then layers. The result holds,
per generated token, one share per span (the rest went to the template, the question and the
answer so far). Cost: one extra ``q @ K`` per layer and step; no second pass.

Row ``i`` is the forward that read generated token ``i`` and so predicted token ``i + 1``;
the first generated token comes from the prefill and has no row.

Not recorded (``None`` in the result, with a note): batches of several prompts, and policies
that cut the cache during decoding (their entries no longer map to prompt positions).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_OBSERVER: ContextVar[SpanAttention | None] = ContextVar("snapkv_rag_span_attention", default=None)


class SpanAttention:
    """Per generated token, the attention share of each prompt span ``[start, end)`` (token positions)."""

    def __init__(self, spans: Sequence[tuple[int, int]], prompt_length: int, sliding: Sequence[bool]):
        self.spans = [(int(a), int(b)) for a, b in spans]
        self.sliding = list(sliding)
        outside = len(self.spans)
        owner = torch.full((prompt_length,), outside, dtype=torch.long)
        for i, (a, b) in enumerate(self.spans):
            owner[a:b] = i
        self._owner = owner  # span id of each prompt position; `outside` for the rest
        self._layer_owner: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, prompt entries kept]
        self._step: torch.Tensor | None = None
        self._layers = 0
        self.rows: list[list[float]] = []

    def bind(self, kept_indices: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] | None) -> None:
        """After the prefill: ``kept_indices`` (layer -> ``[1, kv_heads, k]`` prompt positions kept),
        None when every layer holds the whole prompt. (Per-head budgets are not recorded.)"""
        for layer, indices in (kept_indices or {}).items():
            if isinstance(indices, tuple):
                raise ValueError("span attention is not recorded under per-head budgets")
            self._layer_owner[layer] = self._owner[indices[0].cpu()]

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling: float | None) -> None:
        """One layer's decode attention: ``query [1, heads, 1, d]``, ``key [1, kv_heads, n, d]``."""
        if self.sliding[layer_idx] or query.shape[0] != 1 or query.shape[2] != 1:
            return
        kv_heads, n, d = key.shape[1], key.shape[2], key.shape[3]
        groups = query.shape[1] // kv_heads
        scale = scaling if scaling is not None else d**-0.5
        scores = torch.matmul(query[0, :, 0].reshape(kv_heads, groups, d), key[0].transpose(-1, -2)).float() * scale
        if attention_mask is not None:
            mask = attention_mask[..., -1, :].reshape(-1, n)[:1]  # [1, n] (a single row)
            scores = scores.masked_fill(~mask.bool(), float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        probs = scores.softmax(dim=-1).mean(dim=1)  # [kv_heads, n], mean over each KV head's query group
        owner = self._layer_owner.get(layer_idx)
        if owner is None:
            owner = self._owner.expand(kv_heads, -1)
        prompt_entries = owner.shape[1]
        if prompt_entries > n:  # not the cache layout this run bound: record nothing
            return
        outside = len(self.spans)
        full_owner = torch.cat([owner, owner.new_full((kv_heads, n - prompt_entries), outside)], dim=1).to(probs.device)
        mass = probs.new_zeros(kv_heads, outside + 1).scatter_add_(1, full_owner, probs).mean(dim=0)
        self._step = mass if self._step is None else self._step + mass
        self._layers += 1

    def end_step(self) -> None:
        if self._step is not None and self._layers:
            self.rows.append([round(float(x), 6) for x in (self._step / self._layers)[: len(self.spans)]])
        self._step, self._layers = None, 0


@contextmanager
def observing(observer: SpanAttention | None) -> Iterator[None]:
    """Hand the decode attention of the model calls inside the block to ``observer`` (None: off)."""
    if observer is None:
        yield
        return
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)
        observer.end_step()


def active_observer() -> SpanAttention | None:
    return _OBSERVER.get()


def sentence_shares(rows: Sequence[Sequence[float]], token_ends: Sequence[int], sentence_spans: Sequence[tuple[int, int]]) -> list[list[float]]:
    """Each sentence's attention over the spans, as shares that sum to 1 over the spans.

    ``rows``: :attr:`SpanAttention.rows` of the answer; ``token_ends``: the character offset
    where each generated token ends in the answer text; ``sentence_spans``: each sentence's
    ``[start, end)`` in that text. A sentence averages the rows that predicted its tokens; one
    with none (the first token only) gets zeros.
    """
    spans = len(rows[0]) if rows else 0
    out = []
    for start, end in sentence_spans:
        picked = [rows[j - 1] for j, token_end in enumerate(token_ends) if 1 <= j <= len(rows) and start < token_end <= end]
        if not picked or not spans:
            out.append([0.0] * spans)
            continue
        mean = [sum(r[s] for r in picked) / len(picked) for s in range(spans)]
        total = sum(mean)
        out.append([m / total if total > 0 else 0.0 for m in mean])
    return out


def sentence_attention(tokenizer, token_ids: Sequence[int], rows: Sequence[Sequence[float]], sentences: Sequence[str]) -> list[list[float]]:
    """:func:`sentence_shares` for ``sentences`` of the text that ``token_ids`` decode to (each
    found in order; one not found gets zeros)."""
    ends, text = [], ""
    for j in range(len(token_ids)):
        text = tokenizer.decode(list(token_ids[: j + 1]), skip_special_tokens=True)
        ends.append(len(text))
    spans, cursor = [], 0
    for sentence in sentences:
        at = text.find(sentence, cursor)
        if at < 0:
            spans.append((0, 0))
            continue
        spans.append((at, at + len(sentence)))
        cursor = at + len(sentence)
    return sentence_shares(rows, ends, spans)
