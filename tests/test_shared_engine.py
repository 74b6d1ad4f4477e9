"""shared_engine: one load per (model, device, dtype, options); rag.cite shared by DocumentQA and connectors."""

from __future__ import annotations

import threading

import pytest

from snapkv_rag import shared
from snapkv_rag.rag import Citation, cite
from snapkv_rag.rag.store import StoredChunk


@pytest.fixture()
def fake_loads(monkeypatch):
    loads = []

    def from_pretrained(model, **kwargs):
        loads.append((model, kwargs))
        return object()

    monkeypatch.setattr(shared.Engine, "from_pretrained", staticmethod(from_pretrained))
    shared.clear_shared_engines()
    yield loads
    shared.clear_shared_engines()


def test_same_key_loads_once_and_keys_differ_by_device_dtype_options(fake_loads):
    a = shared.shared_engine("default")
    assert shared.shared_engine("default") is a
    assert shared.shared_engine("default", dtype="float32") is not a
    assert shared.shared_engine("default", dtype="torch.float32") is shared.shared_engine("default", dtype="float32")
    assert shared.shared_engine("default", device="cpu") is not a
    assert shared.shared_engine("default", prefix_cache_bytes=0) is not a
    assert shared.shared_engine("other") is not a
    assert len(fake_loads) == 5
    assert fake_loads[4] == ("other", {"device": None, "dtype": None})


def test_concurrent_callers_get_one_engine(fake_loads):
    got = []
    threads = [threading.Thread(target=lambda: got.append(shared.shared_engine("m"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_loads) == 1 and all(e is got[0] for e in got)


def test_failed_load_is_not_cached(monkeypatch):
    calls = []

    def boom(model, **kwargs):
        calls.append(model)
        raise FileNotFoundError(model)

    monkeypatch.setattr(shared.Engine, "from_pretrained", staticmethod(boom))
    shared.clear_shared_engines()
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            shared.shared_engine("missing")
    assert calls == ["missing", "missing"]


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
