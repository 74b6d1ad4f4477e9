"""One loaded engine per (model, device, dtype, options), shared by every caller in the process.

Connectors build many model objects (a LangChain ``ChatSnapKV`` per chain, a LlamaIndex LLM per
query engine); each would otherwise load its own copy of the weights. :func:`shared_engine`
loads a model once and hands the same :class:`~snapkv_rag.Engine` to every later caller
with the same key. Engines serialize their model steps with a lock, so sharing one is safe
across threads and async tasks.
"""

from __future__ import annotations

import threading
from typing import Any

from .engine import Engine

_ENGINES: dict[tuple, Engine] = {}
_LOCK = threading.Lock()


def _key(model: str, device: Any, dtype: Any, options: dict[str, Any]) -> tuple:
    return (str(model), None if device is None else str(device), None if dtype is None else str(dtype).removeprefix("torch."),
            tuple(sorted((k, repr(v)) for k, v in options.items())))


def shared_engine(model: str = "default", *, device: Any = None, dtype: Any = None, **options: Any) -> Engine:
    """The engine for ``model`` ("default" = the embedded SmolLM2, a path or a hub id), loaded once.

    ``options`` go to :meth:`Engine.from_pretrained` (e.g. ``attn_implementation``, and
    ``prefix_cache_bytes`` where the engine has a prefix cache); they are part of the key.
    A load that fails is not cached, so a later call tries again.
    """
    key = _key(model, device, dtype, options)
    with _LOCK:  # one load at a time: two callers asking for the same model get one copy
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine.from_pretrained(model, device=device, dtype=dtype, **options)
            _ENGINES[key] = engine
        return engine


def cached_engines() -> list[Engine]:
    with _LOCK:
        return list(_ENGINES.values())


def clear_shared_engines() -> None:
    """Forget every shared engine (their memory is freed once no caller holds them)."""
    with _LOCK:
        _ENGINES.clear()
