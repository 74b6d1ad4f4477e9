"""LangChain integration for snapkv-rag: local chat models with SnapKV-compressed KV caches.

- :class:`ChatSnapKV`: chat model (streaming, async, tool calling, structured output, JSON mode)
- :class:`SnapKVStuffingRetriever`: token-budget stuffing over the toolkit's Chroma store or any
  LangChain vector store / retriever
- :class:`SnapKVAttentionReranker`: a document compressor that reranks Documents by the model's
  attention to the query (its own prefill, no generation)
- :class:`SnapKVEmbeddings`: the offline all-MiniLM-L6-v2 embedder as LangChain ``Embeddings``
- :func:`create_cited_qa_chain`: LCEL chain returning answers with citations mapped to Documents
- :class:`SnapKVChatMessageHistory`: chat history backed by the core agent memory (SQLite)
"""

from importlib import metadata

from .chains import cited_prompt, create_cited_qa_chain
from .chat_history import SnapKVChatMessageHistory
from .chat_models import ChatSnapKV, from_engine_messages, to_engine_messages
from .embeddings import SnapKVEmbeddings
from .rerankers import SnapKVAttentionReranker
from .retrievers import LangChainChunkSource, SnapKVStuffingRetriever, chunk_to_document, document_to_chunk

try:
    __version__ = metadata.version("langchain-snapkv")
except metadata.PackageNotFoundError:
    __version__ = "0.1.0"

__all__ = [
    "ChatSnapKV",
    "LangChainChunkSource",
    "SnapKVAttentionReranker",
    "SnapKVChatMessageHistory",
    "SnapKVEmbeddings",
    "SnapKVStuffingRetriever",
    "__version__",
    "chunk_to_document",
    "cited_prompt",
    "create_cited_qa_chain",
    "document_to_chunk",
    "from_engine_messages",
    "to_engine_messages",
]
