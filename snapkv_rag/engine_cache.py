"""One engine per model, shared by every wrapper that names it (LlamaIndex and LangChain LLMs).

Framework wrappers are cheap to construct and often constructed many times (one per query
engine, per agent, per test); loading weights each time would be slow and would split the
prefix cache. :func:`shared_engine` loads an :class:`~snapkv_rag.Engine` once per
``(model, device, dtype, prefix_cache_bytes)`` and hands the same object back afterwards.
The prefix-cache bound is part of the key because the cache belongs to the engine: two
callers asking for different bounds get different engines rather than one silently
ignoring its setting.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

_ENGINES: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def supports_prefix_cache() -> bool:
    """Whether this build's :meth:`Engine.from_pretrained` takes ``prefix_cache_bytes``."""
    from .engine import Engine

    return "prefix_cache_bytes" in inspect.signature(Engine.from_pretrained).parameters


def _key(model: str, device: Any, dtype: Any, prefix_cache_bytes: int | None) -> tuple:
    return (str(model), None if device is None else str(device), None if dtype is None else str(dtype).removeprefix("torch."), prefix_cache_bytes)


def shared_engine(model: str = "default", *, device: Any = None, dtype: Any = None, prefix_cache_bytes: int | None = None):
    """The engine for ``model`` (``"default"`` = the embedded SmolLM2), loaded on first use.

    ``prefix_cache_bytes``: the engine's prefix-cache bound (None: its default, 0: off).
    Raises ``ValueError`` when a bound is given and this build has no prefix cache.
    """
    from .engine import Engine

    key = _key(model, device, dtype, prefix_cache_bytes)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            options: dict[str, Any] = {"device": device, "dtype": dtype}
            if prefix_cache_bytes is not None:
                if not supports_prefix_cache():
                    raise ValueError("prefix_cache_bytes was given, but this snapkv_rag build has no prefix cache")
                options["prefix_cache_bytes"] = prefix_cache_bytes
            engine = Engine.from_pretrained(model, **options)
            _ENGINES[key] = engine
        return engine


def clear_shared_engines() -> None:
    """Forget every cached engine (their memory is freed once no wrapper holds them)."""
    with _LOCK:
        _ENGINES.clear()
