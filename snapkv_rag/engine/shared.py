"""One engine per model, shared by every wrapper that names it (LlamaIndex and LangChain LLMs),
and loading one quietly for the command lines.

Framework wrappers are cheap to construct and often constructed many times (one per query
engine, per chain, per agent, per test); loading weights each time would be slow and would
split the prefix cache. :func:`shared_engine` loads an :class:`~snapkv_rag.Engine` once per
``(model, device, dtype, options)`` and hands the same object back afterwards. Engines
run the model in one worker (concurrent calls decode in one batch), so sharing one is safe
across threads and tasks.
The options (for example the prefix-cache bound) are part of the key because they belong to
the engine: two callers asking for different bounds get different engines rather than one
silently ignoring its setting.
"""

from __future__ import annotations

import threading
from typing import Any

_ENGINES: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _key(model: str, device: Any, dtype: Any, options: dict[str, Any]) -> tuple:
    return (
        str(model),
        None if device is None else str(device),
        None if dtype is None else str(dtype).removeprefix("torch."),
        tuple(sorted((k, repr(v)) for k, v in options.items())),
    )


def shared_engine(model: str = "default", *, device: Any = None, dtype: Any = None, **options: Any):
    """The engine for ``model`` (``"default"`` = the embedded SmolLM2, a path or a hub id), loaded once.

    ``options`` go to :meth:`Engine.from_pretrained` (e.g. ``prefix_cache_bytes``: None for the
    engine's default, 0 for off); options set to None are left out, so they share the default's
    engine. A load that fails is not cached, so a later call tries again.
    """
    from .engine import Engine

    options = {k: v for k, v in options.items() if v is not None}
    key = _key(model, device, dtype, options)
    with _LOCK:  # one load at a time: two callers asking for the same model get one copy
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine.from_pretrained(model, device=device, dtype=dtype, **options)
            _ENGINES[key] = engine
        return engine


def clear_shared_engines() -> None:
    """Forget every cached engine (their memory is freed once no wrapper holds them)."""
    with _LOCK:
        _ENGINES.clear()


def load_engine_quietly(model: str, *, device: Any = None, dtype: Any = None, weights: str | None = None, **options: Any):
    """A new engine for ``model``, loaded without transformers' progress bars and warnings (for
    the command lines and the server, which print their own)."""
    from transformers.utils import logging as hf_logging

    from .engine import Engine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return Engine.from_pretrained(model, device=device, dtype=dtype, weights=weights, **options)
