"""The one decode loop: a (compressed) prefill, then one token per step for a left-padded batch.

Positions are explicit. After compression the cache holds ``k < n`` entries per layer, but
the first generated token still sits at position ``n`` (per row: its real-token count), so
RoPE sees true positions; the 2-D mask covers the kept entries plus the new ones, and
transformers derives mask sizes from the cache length, which stays consistent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .compression.base import CompressionPolicy
from .compression.runtime import PrefillCompression, compressing, sliding_layers
from .sampling import GenerationParams, make_generator, select_next_tokens


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def cache_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None and layer.keys.numel()
    )


@dataclass
class DecodeTimings:
    prefill_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)

    @property
    def decode_ms_per_token(self) -> float | None:
        steps = self.step_seconds[1:] or self.step_seconds
        return statistics.median(steps) * 1000 if steps else None


class DecodeRun:
    """Prefill ``rows`` (token id lists) and yield the next token of every row per step.

    The caller stops iterating when it is done; at most ``params.max_new_tokens`` steps.
    """

    def __init__(self, model, rows: list[list[int]], params: GenerationParams, policy: CompressionPolicy | None, pad_id: int):
        from transformers import DynamicCache

        self.model = model
        self.params = params
        self.policy = policy
        self.device = next(model.parameters()).device
        self.input_ids, self.attention_mask = left_pad(rows, pad_id, self.device)
        self.cache = DynamicCache(config=model.config)
        self.timings = DecodeTimings()
        self.kept_tokens_per_layer: list[int] = []
        self.prompt_kv_bytes_kept = 0
        self.session: PrefillCompression | None = None
        self.last_logits: torch.Tensor | None = None  # [batch, vocab] of the latest forward

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padded_length(self) -> int:
        return self.input_ids.shape[1]

    def _forward(self, input_ids, attention_mask, position_ids):
        self.last_logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        return self.last_logits

    @torch.inference_mode()
    def steps(self) -> Iterator[torch.Tensor]:
        mask = self.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        has_padding = bool((mask == 0).any())
        session = self.session = None
        if self.policy is not None:
            session = self.session = PrefillCompression(
                self.policy, self.cache, mask if has_padding else None, sliding_layers(self.model.config)
            )
        start = time.perf_counter()
        with compressing(session):
            logits = self._forward(self.input_ids, mask if has_padding else None, positions)
        self.timings.prefill_seconds = time.perf_counter() - start

        self.kept_tokens_per_layer = [layer.get_seq_length() for layer in self.cache.layers]
        self.prompt_kv_bytes_kept = cache_bytes(self.cache)
        kv_mask = session.kept_attention_mask if session is not None else None
        if kv_mask is None:
            kv_mask = mask if has_padding else torch.ones(self.batch_size, self.kept_tokens_per_layer[0], dtype=mask.dtype, device=mask.device)
        next_position = positions[:, -1:] + 1
        generator = make_generator(self.params, self.device)
        ones = torch.ones(self.batch_size, 1, dtype=kv_mask.dtype, device=kv_mask.device)

        for step in range(self.params.max_new_tokens):
            tokens = select_next_tokens(logits, self.params, generator)
            yield tokens
            if step + 1 == self.params.max_new_tokens:
                return
            kv_mask = torch.cat([kv_mask, ones], dim=-1)
            start = time.perf_counter()
            logits = self._forward(tokens[:, None], kv_mask if has_padding else None, next_position)
            self.timings.step_seconds.append(time.perf_counter() - start)
            next_position = next_position + 1
