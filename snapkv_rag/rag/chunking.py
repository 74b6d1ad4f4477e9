"""Cut documents into overlapping chunks measured in the embedder's tokens.

A chunk is a span of the original text (no re-joined tokens), so what the LLM reads and what
a citation shows are the source's own characters. Chunk ends prefer a sentence or line
break inside the last quarter of the window, so chunks rarely stop mid-sentence.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..errors import SnapKVRagError
from .loaders import SourceText

_BREAKS = (".", "!", "?", "\n", ";", ":")


class ChunkingError(SnapKVRagError, ValueError):
    """Chunk size or overlap are impossible."""


@dataclass(frozen=True)
class Chunk:
    source: str
    title: str
    position: int  # 0-based index of the chunk within its document
    start: int  # character span in the document's text
    end: int
    text: str
    tokens: int  # embedder tokens
    content_hash: str  # sha256 of text

    @property
    def id(self) -> str:
        """Derived from content: the same text at the same place always gets the same id."""
        key = f"{self.source}\x00{self.position}\x00{self.content_hash}"
        return hashlib.sha256(key.encode()).hexdigest()[:32]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def chunk_document(doc: SourceText, tokenizer, *, chunk_tokens: int = 200, overlap: int = 40) -> list[Chunk]:
    """Chunks of at most ``chunk_tokens`` tokens, consecutive ones sharing about ``overlap``."""
    if chunk_tokens < 8:
        raise ChunkingError(f"chunk_tokens must be at least 8, got {chunk_tokens}")
    if not 0 <= overlap < chunk_tokens // 2:
        raise ChunkingError(f"overlap must be in [0, chunk_tokens / 2), got {overlap} for chunk_tokens={chunk_tokens}")
    text = doc.text
    offsets = [(s, e) for s, e in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"] if e > s]
    chunks: list[Chunk] = []
    first = 0
    while first < len(offsets):
        last = min(first + chunk_tokens, len(offsets)) - 1
        if last < len(offsets) - 1:
            for candidate in range(last, first + (3 * chunk_tokens) // 4 - 1, -1):
                if text[offsets[candidate][1] - 1] in _BREAKS:
                    last = candidate
                    break
        start, end = offsets[first][0], offsets[last][1]
        piece = text[start:end]
        chunks.append(Chunk(doc.source, doc.title, len(chunks), start, end, piece, last - first + 1, text_hash(piece)))
        if last == len(offsets) - 1:
            break
        first = max(last + 1 - overlap, first + 1)
        # Start the next chunk on a word boundary, not inside a word.
        while first <= last and offsets[first][0] > 0 and not text[offsets[first][0] - 1].isspace():
            first += 1
    return chunks
