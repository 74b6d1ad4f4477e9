"""Build policies from CLI strings such as ``snapkv:budget=512,window=32,kernel=7,pooling=max``."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..errors import InvalidCompressionError
from .base import CompressionPolicy
from .full import FullCache
from .h2o import H2O
from .random_keep import RandomKeep
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

POLICIES: dict[str, type[CompressionPolicy]] = {
    "snapkv": SnapKV,
    "streamingllm": StreamingLLM,
    "streaming": StreamingLLM,
    "h2o": H2O,
    "random": RandomKeep,
    "full": FullCache,
    "none": FullCache,
}

ALIASES = {
    "budget": "max_capacity_prompt",
    "capacity": "max_capacity_prompt",
    "window": "window_size",
    "kernel": "kernel_size",
    "sinks": "sink_tokens",
    "gqa": "gqa_reduce",
    "chunk": "chunk_size",
    "chunk_from": "chunk_min_ratio",
    "layers": "layer_budgets",
    "beta": "pyramid_beta",
    "heads": "head_budgets",
    "floor": "head_floor",
    "whole": "whole_layers",
}


def _coerce(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _items(rest: str) -> list[tuple[str, str]]:
    items = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value.strip():
            raise InvalidCompressionError(f"expected key=value in compression spec, got {item!r}")
        items.append((key.strip(), value.strip()))
    return items


def _parse_less(rest: str) -> CompressionPolicy:
    """``less:base=snapkv,budget=256[,kernels=PATH][,probe=N][,<base settings>]``: LESS over a base policy."""
    from .less.policy import LESS

    base, kernels, probe, others = "snapkv", None, 0, []
    seen: set[str] = set()
    for key, value in _items(rest):
        if key in ("base", "kernels", "probe"):
            if key in seen:
                raise InvalidCompressionError(f"LESS: {key!r} is given twice; give each setting once")
            seen.add(key)
        if key == "base":
            base = value
        elif key == "kernels":
            kernels = value
        elif key == "probe":
            try:
                probe = int(value)
            except ValueError:
                raise InvalidCompressionError(f"LESS: probe must be a whole number, got {value!r}") from None
        else:
            others.append(f"{key}={value}")
    if base.lower() in ("less", "full", "none"):
        raise InvalidCompressionError(f"LESS: base must be a sparse policy, got {base!r}")
    return LESS(base=parse_compression(f"{base}:{','.join(others)}"), kernels=kernels, probe=probe)


def parse_compression(spec: str) -> CompressionPolicy:
    """Parse ``name[:key=value,...]``; keys may use the short aliases in ``ALIASES``.

    ``less:base=snapkv,budget=256`` wraps the base policy (with the other settings) in LESS.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidCompressionError("empty compression spec; try 'snapkv:budget=1024'")
    name, _, rest = spec.strip().partition(":")
    if name.strip().lower() == "less":
        return _parse_less(rest)
    cls = POLICIES.get(name.strip().lower())
    if cls is None:
        raise InvalidCompressionError(f"unknown compression method {name!r}; choose one of {', '.join(sorted({*POLICIES, 'less'}))}")
    allowed = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    typed: dict[str, str] = {}  # field -> the name the user wrote, for errors in their words
    for key, value in _items(rest):
        field = ALIASES.get(key, key)
        if field not in allowed:
            raise InvalidCompressionError(f"{cls.name} has no setting {key!r}; settings: {', '.join(setting_names(allowed)) or 'none'}")
        if field in kwargs:
            same = f"{key!r} is given twice" if typed[field] == key else f"{typed[field]!r} and {key!r} name the same setting"
            raise InvalidCompressionError(f"{cls.name}: {same}; give each setting once")
        kwargs[field] = _coerce(value)
        typed[field] = key
    try:
        return cls(**kwargs)
    except InvalidCompressionError as error:
        message = str(error)
        for field in allowed:
            message = re.sub(rf"\b{field}\b", typed.get(field) or _short_name(field), message)
        raise InvalidCompressionError(message) from None


def _short_name(field: str) -> str:
    return next((alias for alias, target in ALIASES.items() if target == field), field)


def setting_names(fields: set[str]) -> list[str]:
    """The settings a spec may name: a field's short alias where it has one (``budget``), else the field."""
    return sorted(_short_name(field) for field in fields)


def as_policy(compression: CompressionPolicy | str | None) -> CompressionPolicy | None:
    """Normalize the engine's ``compression=`` argument; full-cache forms become None."""
    if compression is None:
        return None
    if isinstance(compression, str):
        compression = parse_compression(compression)
    if not isinstance(compression, CompressionPolicy):
        raise InvalidCompressionError(f"compression must be a policy, a spec string or None, got {type(compression).__name__}")
    return None if isinstance(compression, FullCache) and compression.kv_bits is None else compression


def rolls(compression: CompressionPolicy | str | None) -> bool:
    """Whether ``compression`` is a sparse policy that can read a prompt past the window (``rolling=``)."""
    policy = as_policy(compression) if isinstance(compression, str) else compression
    return isinstance(policy, CompressionPolicy) and "rolling" in {f.name for f in dataclasses.fields(policy)}
