"""LlamaIndex integration for snapkv-rag: ``SnapKVLLM``, a token-budget node postprocessor, an attention reranker and agent memory."""

from llama_index.llms.snapkv.base import SnapKVLLM, response_format_for
from llama_index.llms.snapkv.memory import SnapKVMemory
from llama_index.llms.snapkv.postprocessor import CITATION_HEADER, TokenBudgetPostprocessor
from llama_index.llms.snapkv.rag import chroma_vector_store, default_embed_model, hide_file_metadata
from llama_index.llms.snapkv.reranker import SnapKVAttentionReranker

__all__ = [
    "CITATION_HEADER",
    "SnapKVAttentionReranker",
    "SnapKVLLM",
    "SnapKVMemory",
    "TokenBudgetPostprocessor",
    "chroma_vector_store",
    "default_embed_model",
    "hide_file_metadata",
    "response_format_for",
]
