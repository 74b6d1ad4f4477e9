"""An OpenAI-compatible server over the engine: ``snapkv-rag serve`` or :func:`create_app`.

Imports are lazy so that building the CLI parser (``--help``) does not load torch.
"""

from __future__ import annotations

from typing import Any

from .defaults import DEFAULT_COMPRESSION, DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS

__all__ = ["DEFAULT_COMPRESSION", "DEFAULT_MAX_QUEUE", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_MAX_TOKENS", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("ServerConfig", "create_app"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
