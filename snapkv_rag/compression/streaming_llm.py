"""StreamingLLM: attention-sink tokens plus the most recent ones.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidCompressionError
from .base import SparsePolicy, check_positive_int, keep_all, keep_recent_and_top


@dataclass(frozen=True)
class StreamingLLM(SparsePolicy):
    """Keep the first ``sink_tokens`` real tokens and the last ``max_capacity_prompt - sink_tokens``."""

    name = "streamingllm"
    sink_tokens: int = 4
    max_capacity_prompt: int = 1024

    def __post_init__(self) -> None:
        check_positive_int("StreamingLLM", "sink_tokens", self.sink_tokens, minimum=0)
        check_positive_int("StreamingLLM", "max_capacity_prompt", self.max_capacity_prompt)
        if self.sink_tokens >= self.max_capacity_prompt:
            raise InvalidCompressionError(
                f"StreamingLLM: sink_tokens ({self.sink_tokens}) must be smaller than max_capacity_prompt ({self.max_capacity_prompt})"
            )
        self.check_shared_options()

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None):
        b, kv_heads, n, _ = keys.shape
        if n <= self.max_capacity_prompt:
            return keep_all(b, kv_heads, n, keys.device)
        prefix = n - (self.max_capacity_prompt - self.sink_tokens)
        # Earlier positions score higher, so the top `sink_tokens` are the first real tokens.
        earliness = torch.arange(prefix, 0, -1, device=keys.device, dtype=torch.float32)
        return keep_recent_and_top(earliness.expand(b, kv_heads, prefix), n, self.max_capacity_prompt, attention_mask, protected)
