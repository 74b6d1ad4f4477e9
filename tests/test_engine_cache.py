"""Engines shared per (model, device, dtype, options)."""

from __future__ import annotations

import threading

import pytest

from snapkv_rag import Engine
from snapkv_rag.engine import shared as engine_cache


@pytest.fixture
def loads(monkeypatch):
    calls = []

    def fake(name, **options):
        calls.append((name, options))
        return object()

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(fake))
    engine_cache.clear_shared_engines()
    yield calls
    engine_cache.clear_shared_engines()


def test_one_engine_per_model_device_and_dtype(loads):
    a = engine_cache.shared_engine("m", device="cpu", dtype="float32")
    b = engine_cache.shared_engine("m", device="cpu", dtype="torch.float32")
    c = engine_cache.shared_engine("m", device="cpu", dtype="bfloat16")
    d = engine_cache.shared_engine("other")
    assert a is b and a is not c and d is not a
    assert [name for name, _ in loads] == ["m", "m", "other"]


def test_options_are_part_of_the_key_and_none_means_default(loads):
    a = engine_cache.shared_engine("m", prefix_cache_bytes=1 << 20)
    b = engine_cache.shared_engine("m", prefix_cache_bytes=0)
    assert a is not b and loads[-1] == ("m", {"device": None, "dtype": None, "prefix_cache_bytes": 0})
    assert engine_cache.shared_engine("m", prefix_cache_bytes=None) is engine_cache.shared_engine("m")
    assert len(loads) == 3


def test_concurrent_callers_get_one_engine(loads):
    got = []
    threads = [threading.Thread(target=lambda: got.append(engine_cache.shared_engine("m"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and all(e is got[0] for e in got)


def test_failed_load_is_not_cached(monkeypatch):
    calls = []

    def boom(model, **kwargs):
        calls.append(model)
        raise FileNotFoundError(model)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(boom))
    engine_cache.clear_shared_engines()
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            engine_cache.shared_engine("missing")
    assert calls == ["missing", "missing"]
