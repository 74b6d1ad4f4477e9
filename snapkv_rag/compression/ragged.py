"""A cache layer whose KV heads hold different numbers of entries (per-head budgets, AdaKV).

kvpress's AdaKV press masks the entries a head drops and keeps the dense ``[batch, heads, n,
dim]`` cache, so it saves no memory. Here a layer compressed with per-head budgets really
holds only what each head kept: one flat ``[entries, dim]`` tensor per K and V, the heads'
entries one after the other (head 0's first), with each head's count beside it. Its bytes
are therefore the kept entries' bytes, the same as a uniform cache of the same mean budget.

The registered attention function finds such a layer through :func:`active_ragged_layer` (see
:mod:`.own_attention`) and attends each KV head over its own slice
(:meth:`RaggedHeadsLayer.attend`); the K/V arguments transformers passes are ignored there.
One prompt at a time: no batch rows and no padding, so no mask is needed beyond causality
among the tokens of one forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

from .own_attention import active_layer


class RaggedHeadsLayer(DynamicLayer):
    """One layer's K/V for a batch of one, ``lengths[h]`` entries for KV head ``h``.

    ``keys``/``values`` are ``[1, 1, sum(lengths), dim]`` (the flat layout; :meth:`held_bytes`
    adds the ``BUCKET`` rows of zeros after the last head); new tokens are appended to every head.

    Attention reads heads over lengths rounded up to ``BUCKET`` (masked past each head's
    entries): a bf16 matrix product of a shape oneDNN has not seen costs about 0.6 ms on this
    CPU to set up, and 2 x 90 head lengths growing by one every step would pay it 180 times a
    step (93 ms/token against SnapKV's 23 at 3K tokens, measured); rounded lengths repeat, so
    their kernels are set up once. A decode token copies the heads into one padded block
    (:meth:`_attend_one`); a forward of several tokens reads each head in place, the zero rows
    after the last head giving it room to round up.
    """

    BUCKET = 64
    attends_itself = True

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        super().__init__()
        first = keys[0]
        self.lazy_initialization(first, first)
        self.heads = len(keys)
        self.lengths = [int(k.shape[0]) for k in keys]
        self._store(list(keys), list(values))

    def _store(self, key_pieces: list[torch.Tensor], value_pieces: list[torch.Tensor]) -> None:
        """Concatenate the heads' entries, plus ``BUCKET`` zero rows, into one buffer each."""
        slack = key_pieces[0].new_zeros(self.BUCKET, key_pieces[0].shape[-1])
        total = sum(self.lengths)
        self._key_buffer = torch.cat([*key_pieces, slack])
        self._value_buffer = torch.cat([*value_pieces, slack.to(value_pieces[0].dtype)])
        self.keys = self._key_buffer[:total][None, None]
        self.values = self._value_buffer[:total][None, None]

    @classmethod
    def from_selection(cls, keys: torch.Tensor, values: torch.Tensor, kept: Sequence[torch.Tensor]) -> RaggedHeadsLayer:
        """Keep ``kept[h]`` (positions, ascending) of head ``h`` from dense ``[1, heads, n, dim]`` K/V."""
        return cls([keys[0, h, idx] for h, idx in enumerate(kept)], [values[0, h, idx] for h, idx in enumerate(kept)])

    def _spans(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each head's entries in the buffers."""
        starts = [0, *itertools.accumulate(self.lengths)]
        return list(zip(starts, self.lengths))

    def head_keys(self, head: int) -> torch.Tensor:
        start, n = self._spans()[head]
        return self._key_buffer[start : start + n]

    def head_values(self, head: int) -> torch.Tensor:
        start, n = self._spans()[head]
        return self._value_buffer[start : start + n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[1, heads, t, dim]`` new entries to every head; returns them (attention reads the layer)."""
        if key_states.shape[0] != 1 or key_states.shape[1] != self.heads:
            raise ValueError(f"a ragged cache layer takes [1, {self.heads}, t, dim] states, got {list(key_states.shape)}")
        key_pieces, value_pieces = [], []
        for h in range(self.heads):
            key_pieces += [self.head_keys(h), key_states[0, h]]
            value_pieces += [self.head_values(h), value_states[0, h]]
        added = key_states.shape[2]
        self.lengths = [length + added for length in self.lengths]
        self._store(key_pieces, value_pieces)
        return key_states, value_states

    def held_bytes(self) -> int:
        """Bytes of K and V held, the zero rows after the last head included."""
        return sum(t.numel() * t.element_size() for t in (self._key_buffer, self._value_buffer))

    def entries_per_head(self) -> int:
        """The mean entries a head holds (rounded), the figure a uniform layer's length compares with."""
        return round(sum(self.lengths) / self.heads)

    def get_seq_length(self) -> int:
        return self.entries_per_head()

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of ``query [1, q_heads, t, dim]`` (the forward's last ``t`` tokens, already
        appended) over each KV head's own entries; returns ``[1, t, q_heads, dim]`` as the
        attention functions do. Scores and softmax in float32."""
        _, q_heads, t, dim = query.shape
        group = q_heads // self.heads
        scale = scaling if scaling is not None else dim**-0.5
        if t == 1:
            return self._attend_one(query, group, scale)
        outputs = []
        for h, (start, n) in enumerate(self._spans()):
            width = -(-n // self.BUCKET) * self.BUCKET
            keys, values = self._key_buffer[start : start + width], self._value_buffer[start : start + width]
            # 2-D products on rows with unit stride: a [group, 1, dim] slice of the model's
            # transposed query keeps a stride of q_heads * dim on its size-1 axis, which sent
            # torch.matmul to a path 7x slower on the CPU (bf16)
            # a teacher-forced or blended forward: float32 throughout, as SDPA accumulates
            q = query[0, h * group : (h + 1) * group].reshape(group * t, dim).float()
            scores = torch.mm(q, keys.float().t()).view(group, t, width) * scale
            scores[..., n:] = float("-inf")  # columns past this head's entries
            new = torch.arange(n, device=keys.device) - (n - t)  # >= 0 for this forward's tokens
            blocked = new[None, :] > torch.arange(t, device=keys.device)[:, None]
            scores[..., :n] = scores[..., :n].masked_fill(blocked, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            outputs.append(torch.mm(probs.view(group * t, width), values.float()).view(group, t, dim))
        return torch.cat(outputs).transpose(0, 1)[None].to(query.dtype).contiguous()

    def _attend_one(self, query: torch.Tensor, group: int, scale: float) -> torch.Tensor:
        """One decode token: the heads copied into one zero-padded ``[heads, width, dim]`` block
        (width rounded up to ``BUCKET``) and attended by two batched products, a third faster than
        six per-head ones; scores in the input dtype, softmax in float32, as ``decode_attention``."""
        q_heads, dim = query.shape[1], query.shape[3]
        width = -(-max(self.lengths) // self.BUCKET) * self.BUCKET
        keys = self._key_buffer.new_zeros(self.heads, width, dim)
        values = self._value_buffer.new_zeros(self.heads, width, dim)
        for h, n in enumerate(self.lengths):
            keys[h, :n] = self.head_keys(h)
            values[h, :n] = self.head_values(h)
        # [q_heads, dim] rows with unit stride (a [group, 1, dim] slice of the model's transposed
        # query keeps a stride of q_heads * dim on its size-1 axis, which sent products to a slow path)
        q = query[0, :, 0].reshape(self.heads, group, dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).float() * scale  # [heads, group, width]
        lengths = torch.tensor(self.lengths, device=keys.device)
        scores.masked_fill_((torch.arange(width, device=keys.device)[None, :] >= lengths[:, None])[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.bmm(probs, values).reshape(1, 1, q_heads, dim)


def is_ragged(layer) -> bool:
    return isinstance(layer, RaggedHeadsLayer)


def active_ragged_layer(layer_idx: int) -> RaggedHeadsLayer | None:
    """The running forward's cache layer ``layer_idx`` when it holds ragged heads (else None)."""
    return active_layer(layer_idx, RaggedHeadsLayer)
