"""``snapkv-rag tune``: LoRA fine-tuning of the engine's model on generated document-QA and
tool-decision data (chunks also read apart), and the adapter the embedded model ships with
(in ``shipped/``).

Loading and merging an adapter is the model layer's (:mod:`snapkv_rag.model.adapters`,
:mod:`snapkv_rag.model.shipped_adapters`); the names below are theirs, imported on first use,
so importing this package (``snapkv-rag --help``) loads neither torch nor peft. The trainer
lives in :mod:`.train`.
"""

from __future__ import annotations

from typing import Any

_FROM = {
    "AdapterError": "adapters",
    "merge_adapter": "adapters",
    "read_manifest": "adapters",
    "AUTO": "shipped_adapters",
    "gates_passed": "shipped_adapters",
    "resolve_adapter": "shipped_adapters",
    "shipped_adapter_dir": "shipped_adapters",
}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module 'snapkv_rag.adapter_training' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"snapkv_rag.model.{_FROM[name]}"), name)
