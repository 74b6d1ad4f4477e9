"""``snapkv-rag tune``: LoRA fine-tuning of the engine's model on generated document-QA and
tool-decision data (chunks also read apart), and the adapter the embedded model ships with.

Importing this package loads neither peft nor a model; the trainer lives in :mod:`.train`.
"""

from .lora import AdapterError, merge_adapter, read_manifest
from .shipped import AUTO, gates_passed, resolve_adapter, shipped_adapter_dir

__all__ = ["AUTO", "AdapterError", "gates_passed", "merge_adapter", "read_manifest", "resolve_adapter", "shipped_adapter_dir"]
