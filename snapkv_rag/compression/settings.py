"""A policy's settings by the names a spec gives them (``budget``, ``window``...): the aliases, and the one
way to build or change a policy from named settings, its errors told in the names the user wrote."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..errors import InvalidCompressionError

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


def short_name(field: str) -> str:
    return next((alias for alias, target in ALIASES.items() if target == field), field)


def setting_names(fields: set[str]) -> list[str]:
    """The settings a spec may name: a field's short alias where it has one (``budget``), else the field."""
    return sorted(short_name(field) for field in fields)


def named_fields(cls: Any, items: list[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings named by alias or field, as fields of the policy class ``cls`` (and each field's name as the user wrote it)."""
    allowed = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    typed: dict[str, str] = {}  # field -> the name the user wrote, for errors in their words
    for key, value in items:
        field = ALIASES.get(key, key)
        if field not in allowed:
            raise InvalidCompressionError(f"{cls.name} has no setting {key!r}; settings: {', '.join(setting_names(allowed)) or 'none'}")
        if field in kwargs:
            same = f"{key!r} is given twice" if typed[field] == key else f"{typed[field]!r} and {key!r} name the same setting"
            raise InvalidCompressionError(f"{cls.name}: {same}; give each setting once")
        kwargs[field] = value
        typed[field] = key
    return kwargs, typed


def built(cls: Any, kwargs: dict[str, Any], typed: dict[str, str], base: Any = None) -> Any:
    """``cls(**kwargs)`` (or the policy ``base`` with them replaced), its errors told in the names the user wrote."""
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except InvalidCompressionError as error:
        message = str(error)
        for field in {f.name for f in dataclasses.fields(cls)}:
            message = re.sub(rf"\b{field}\b", typed.get(field) or short_name(field), message)
        raise InvalidCompressionError(message) from None


def replaced_settings(policy: Any, settings: dict[str, Any]) -> Any:
    """``policy`` with ``settings`` (spec names such as ``chunk``, or field names) replaced, validated as a
    spec naming them would be; ``policy`` itself when nothing changes."""
    kwargs, typed = named_fields(type(policy), list(settings.items()))
    replaced = built(type(policy), kwargs, typed, base=policy)
    return policy if replaced == policy else replaced
