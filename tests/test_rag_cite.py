"""rag.cite: the citation routes as one function, shared by DocumentQA and the connectors' chains."""

from __future__ import annotations

import pytest

from snapkv_rag.rag import Citation, cite
from snapkv_rag.rag.store import StoredChunk


class _Attributor:
    def attribute(self, question, answer, texts):
        from snapkv_rag.rag.attribution import SentenceSupport

        return [SentenceSupport(sentence=answer, numbers=[2], scores=[0.9])]


def _chunk(i):
    return StoredChunk(id=f"c{i}", text=f"text {i}", source=f"s{i}", title=f"T{i}", position=0, tokens=2)


def test_cite_by_both_routes_and_invalid_markers():
    chunks = [_chunk(1), _chunk(2)]
    citations, invalid = cite("q?", "It is so [1] [7].", chunks, _Attributor())
    assert invalid == [7]
    assert citations[0] == Citation(1, "generated", chunks[0])
    assert (citations[1].number, citations[1].route, citations[1].score) == (2, "attributed", 0.9)
    only, _ = cite("q?", "It is so [1].", chunks, None, routes=("generated",))
    assert [c.route for c in only] == ["generated"]
    with pytest.raises(ValueError, match="attributor"):
        cite("q?", "x", chunks, None)
    with pytest.raises(ValueError, match="unknown citation routes"):
        cite("q?", "x", chunks, None, routes=("bogus",))
