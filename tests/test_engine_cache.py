"""Engines shared per (model, device, dtype, prefix-cache bound)."""

from __future__ import annotations

import pytest

from snapkv_rag import Engine
from snapkv_rag import engine_cache


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


def test_prefix_cache_bound_is_part_of_the_key_or_refused(loads, monkeypatch):
    monkeypatch.setattr(engine_cache, "supports_prefix_cache", lambda: False)
    with pytest.raises(ValueError, match="prefix cache"):
        engine_cache.shared_engine("m", prefix_cache_bytes=1 << 20)
    monkeypatch.setattr(engine_cache, "supports_prefix_cache", lambda: True)
    a = engine_cache.shared_engine("m", prefix_cache_bytes=1 << 20)
    b = engine_cache.shared_engine("m", prefix_cache_bytes=0)
    assert a is not b and loads[-1][1]["prefix_cache_bytes"] == 0
