"""Build policies from CLI strings such as ``snapkv:budget=512,window=32,kernel=7,pooling=max``."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidCompressionError
from .base import CompressionPolicy
from .defaults import DEFAULT_COMPRESSION, DEFAULT_SPEC
from .expected_attention import ExpectedAttention
from .full import FullCache
from .h2o import H2O
from .kvzip import KVzip
from .random_keep import RandomKeep
from .settings import built, named_fields
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

POLICIES: dict[str, type[CompressionPolicy]] = {
    "snapkv": SnapKV,
    "streamingllm": StreamingLLM,
    "streaming": StreamingLLM,
    "h2o": H2O,
    "expected": ExpectedAttention,
    "expected_attention": ExpectedAttention,
    "kvzip": KVzip,
    "random": RandomKeep,
    "full": FullCache,
    "none": FullCache,
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


def settings_from_text(text: str) -> dict[str, Any]:
    """``"chunk=16,chunk_from=2"`` (a spec's settings, as a command line gives them) as keyword arguments
    for :meth:`~.base.CompressionPolicy.with_settings`, each value typed as a spec's would be."""
    return {key: _coerce(value) for key, value in _items(text)}


def parse_compression(spec: str) -> CompressionPolicy:
    """Parse ``name[:key=value,...]``; keys may use the short aliases in ``ALIASES``.

    ``less:base=snapkv,budget=256`` wraps the base policy (with the other settings) in LESS;
    ``default`` is :data:`~.defaults.DEFAULT_COMPRESSION` itself.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidCompressionError("empty compression spec; try 'snapkv:budget=1024'")
    if spec.strip().lower() == DEFAULT_SPEC:
        return DEFAULT_COMPRESSION
    name, _, rest = spec.strip().partition(":")
    if name.strip().lower() == "less":
        return _parse_less(rest)
    cls = POLICIES.get(name.strip().lower())
    if cls is None:
        raise InvalidCompressionError(f"unknown compression method {name!r}; choose one of {', '.join(sorted({*POLICIES, 'less', DEFAULT_SPEC}))}")
    kwargs, typed = named_fields(cls, [(key, _coerce(value)) for key, value in _items(rest)])
    return built(cls, kwargs, typed)


def as_policy(compression: CompressionPolicy | str | None) -> CompressionPolicy | None:
    """Normalize the engine's ``compression=`` argument; full-cache forms become None."""
    if compression is None:
        return None
    if isinstance(compression, str):
        compression = parse_compression(compression)
    if not isinstance(compression, CompressionPolicy):
        raise InvalidCompressionError(f"compression must be a policy, a spec string or None, got {type(compression).__name__}")
    return None if isinstance(compression, FullCache) and compression.kv_bits is None else compression
