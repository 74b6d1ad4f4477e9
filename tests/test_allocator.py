"""The C allocator under a long-running server (issue 51, item 1): its bytes are readable, and
trimming gives back what freed tensors left in its arenas."""

from __future__ import annotations

import subprocess
import sys

import pytest

from snapkv_rag.model.allocator import bound_allocator, malloc_stats

pytestmark = pytest.mark.skipif(malloc_stats() is None, reason="not glibc")

PROBE = """
import torch
from snapkv_rag.model.allocator import malloc_stats, trim
from snapkv_rag.model.peak_memory import current_rss_bytes

tensors = [torch.ones(25_000) for _ in range(2000)]  # 100 KB each: below glibc's mmap threshold, from its arena
kept = tensors[::10]  # what stays in use pins the heap: the freed blocks between cannot be cut off its top
del tensors
before, free = current_rss_bytes(), malloc_stats().free_bytes
trim()
print(before, free, current_rss_bytes())
"""


def test_trim_gives_back_what_freed_tensors_left_resident():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    before, free, after = map(int, done.stdout.split())
    assert free > 150 << 20  # about 180 MB freed, held by the allocator
    assert before - after > 120 << 20, (before, after)


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("SNAPKV_RAG_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="SNAPKV_RAG_MALLOC must be 'bounded' or 'system'"):
        bound_allocator()
    monkeypatch.setenv("SNAPKV_RAG_MALLOC", "system")
    assert bound_allocator() is False


def test_metrics_report_resident_and_allocator_bytes():
    from starlette.testclient import TestClient

    from snapkv_rag.server import ServerConfig, create_app

    class NoEngine:
        async def open(self, config, request):  # pragma: no cover
            raise AssertionError

        async def health(self):
            return {"context_length": 512, "device": "cpu", "replicas": 1}

    text = TestClient(create_app(ServerConfig(None, backend=NoEngine(), model_id="m"))).get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values["snapkv_process_resident_bytes"] > 50 << 20
    assert values["snapkv_malloc_in_use_bytes"] > 1 << 20 and values["snapkv_malloc_free_bytes"] >= 0
    assert "snapkv_malloc_trims_total" in values
