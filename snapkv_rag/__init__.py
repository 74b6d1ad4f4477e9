"""snapkv-rag: long-context LLM applications on a local model with a compressed KV cache.

The heavy parts (torch, transformers) load on first use of :class:`Engine` and friends, so
``snapkv-rag --help`` and ``from snapkv_rag.errors import ...`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (  # noqa: E402
    EmptyPromptError,
    InvalidCompressionError,
    InvalidDeviceError,
    InvalidGenerationParameterError,
    InvalidPromptError,
    ModelNotFoundError,
    PromptTooLongError,
    SnapKVRagError,
    StructuredOutputError,
)

_LAZY = {
    "Engine": "engine.engine",
    "GenerationStream": "engine.streams",
    "AsyncGenerationStream": "engine.streams",
    "ModelInfo": "engine.engine",
    "GenerationResult": "engine.results",
    "GenerationStats": "engine.results",
    "Usage": "engine.results",
    "ToolCall": "tools.calls",
    "ToolCallDelta": "tools.calls",
}

if TYPE_CHECKING:  # pragma: no cover
    from .engine.engine import AsyncGenerationStream, Engine, GenerationStream, ModelInfo
    from .engine.results import GenerationResult, GenerationStats, Usage
    from .tools.calls import ToolCall, ToolCallDelta


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapkv_rag' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncGenerationStream",
    "Engine",
    "EmptyPromptError",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InvalidCompressionError",
    "InvalidDeviceError",
    "InvalidGenerationParameterError",
    "InvalidPromptError",
    "ModelInfo",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SnapKVRagError",
    "StructuredOutputError",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "__version__",
]
