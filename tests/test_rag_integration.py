"""Document QA over the shipped sample corpus on the real embedded model (short contexts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapkv_rag.rag import DocumentQA, DocumentStore

pytestmark = pytest.mark.integration

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "sample_corpus"


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    store = DocumentStore("marrowick", path=tmp_path_factory.mktemp("chroma"))
    report = store.ingest([CORPUS])
    assert report.files == 36 and not report.skipped
    return store


def test_answers_with_an_attributed_citation_to_the_right_file(embedded_engine, sample_store):
    qa = DocumentQA(embedded_engine, sample_store, context_tokens=1500, max_new_tokens=48)
    answer = qa.ask("What time does the first ferry leave Marrowick harbour on weekdays?")
    assert "6:40" in answer.text
    cited = [answer.context.chunk_for(n) for n in answer.cited("attributed")]
    assert cited and Path(cited[0].file).name == "harbour-ferry.md"
    assert answer.result.stats.compression["resolved_window_sizes"][0] >= 8
    assert answer.context.prompt_tokens > 1024  # the default SnapKV budget compresses this prompt
    assert answer.result.stats.kept_tokens_per_layer[0] == 1024
