"""LlamaIndex integration for snapkv-rag: ``SnapKVLLM``, a token-budget node postprocessor and agent memory."""

from llama_index.llms.snapkv.base import SnapKVLLM, response_format_for
from llama_index.llms.snapkv.memory import SnapKVMemory
from llama_index.llms.snapkv.postprocessor import TokenBudgetPostprocessor

__all__ = ["SnapKVLLM", "SnapKVMemory", "TokenBudgetPostprocessor", "response_format_for"]
