"""snapkv-rag: long-context LLM applications on a local model with a compressed KV cache."""

__version__ = "0.1.0"

from .engine import Engine, GenerationStream, ModelInfo  # noqa: E402
from .errors import (  # noqa: E402
    EmptyPromptError,
    InvalidCompressionError,
    InvalidGenerationParameterError,
    InvalidPromptError,
    ModelNotFoundError,
    PromptTooLongError,
    SnapKVRagError,
)
from .results import GenerationResult, GenerationStats, Usage  # noqa: E402

__all__ = [
    "Engine",
    "EmptyPromptError",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InvalidCompressionError",
    "InvalidGenerationParameterError",
    "InvalidPromptError",
    "ModelInfo",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SnapKVRagError",
    "Usage",
    "__version__",
]
