"""The engine: one object, one generation path, used by every interface of the toolkit.

:class:`Engine` (``engine.py``) is the public API. A call is validated and rendered in
``preparation.py``, runs in the scheduler's worker (``scheduler.py``: continuous batching)
through the one decode loop (``generation.py``), and comes back as streams (``streams.py``) and
results (``results.py``). Imports are lazy, so that ``snapkv_rag.engine.shared`` and the CLI's
``--help`` do not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "engine",
    "Compression": "engine",
    "ModelInfo": "engine",
    "GenerationStream": "streams",
    "AsyncGenerationStream": "streams",
}

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Compression, Engine, ModelInfo
    from .streams import AsyncGenerationStream, GenerationStream

__all__ = ["AsyncGenerationStream", "Compression", "Engine", "GenerationStream", "ModelInfo"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'snapkv_rag.engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
