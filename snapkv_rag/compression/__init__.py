"""KV-cache compression policies and the machinery that applies them during prefill."""

from .base import CompressionPolicy, SparsePolicy, keep_recent_and_top
from .defaults import DEFAULT_COMPRESSION
from .expected_attention import ExpectedAttention
from .full import FullCache
from .h2o import H2O
from .kvzip import KVzip
from .less.policy import LESS
from .parsing import POLICIES, as_policy, parse_compression
from .past_window import ROLLING_CHUNK, can_roll, fit_to_window, reads_past_window
from .random_keep import RandomKeep
from .runtime import KeptIndices, WindowVotes, recording_kept_indices, recording_window_votes
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

__all__ = [
    "DEFAULT_COMPRESSION",
    "ROLLING_CHUNK",
    "can_roll",
    "fit_to_window",
    "reads_past_window",
    "CompressionPolicy",
    "ExpectedAttention",
    "FullCache",
    "H2O",
    "KeptIndices",
    "KVzip",
    "LESS",
    "POLICIES",
    "RandomKeep",
    "SnapKV",
    "SparsePolicy",
    "StreamingLLM",
    "as_policy",
    "keep_recent_and_top",
    "parse_compression",
    "recording_kept_indices",
    "recording_window_votes",
    "WindowVotes",
]
