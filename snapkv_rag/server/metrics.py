"""The server's Prometheus metrics (``GET /metrics``, text format), one registry per app.

Counters and histograms are fed by the request handlers; the cache gauges are read from the
engine at scrape time, so they are never stale.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: a first token within 50 ms (a reused prompt on a GPU) to minutes (a long CPU prefill).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServerMetrics:
    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("snapkv_requests", "Finished requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("snapkv_prompt_tokens", "Prompt tokens of finished completions", registry=r)
        self.completion_tokens = Counter("snapkv_completion_tokens", "Generated tokens of finished completions", registry=r)
        self.reused_tokens = Counter("snapkv_reused_prompt_tokens", "Prompt tokens whose K/V came from a cache (prefix or chunks)", registry=r)
        self.drafted = Counter("snapkv_draft_tokens", "Prompt-lookup draft tokens checked (prompt_lookup_num_tokens)", registry=r)
        self.accepted = Counter("snapkv_accepted_draft_tokens", "Draft tokens accepted: divided by snapkv_draft_tokens_total, the acceptance rate", registry=r)
        self.in_flight = Gauge("snapkv_requests_in_flight", "Completion requests admitted and not finished (waiting or generating)", registry=r)
        self.rejected = Counter("snapkv_requests_rejected", "Completion requests turned away with 429 because the queue was full", registry=r)
        self.ttft = Histogram("snapkv_time_to_first_token_seconds", "From the request's arrival to its first generated piece", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("snapkv_inter_token_latency_seconds", "Between consecutive generated pieces of one request", buckets=ITL_BUCKETS, registry=r)
        self.kv_kept = Histogram(
            "snapkv_prompt_kv_bytes_kept", "Prompt K/V bytes one request kept after compression", buckets=[2**k for k in range(16, 36, 2)], registry=r
        )
        if engine is not None:  # None: the engines are Ray Serve replicas in other processes
            self._engine_gauges(engine)
        r.register(MemoryCollector())

    def _engine_gauges(self, engine: Any) -> None:
        r = self.registry
        # read from the engine at each scrape (the CLI may swap the segment store after start)
        Gauge("snapkv_prefix_cache_bytes", "Bytes of stored prompt K/V in the prefix cache", registry=r).set_function(lambda: engine.prefix_cache.nbytes)
        Gauge("snapkv_prefix_cache_hit_ratio", "Prefix-cache lookups that reused something", registry=r).set_function(lambda: _prefix_hit_ratio(engine))
        Gauge("snapkv_chunk_kv_bytes", "Bytes of stored chunk K/V (the engine's segment store)", registry=r).set_function(lambda: engine.segment_store.nbytes)
        Gauge("snapkv_chunk_kv_hit_ratio", "Chunk K/V lookups found in the store", registry=r).set_function(
            lambda: _ratio(engine.segment_store.stats.hits, engine.segment_store.stats.hits + engine.segment_store.stats.misses)
        )

        r.register(SchedulerCollector(engine))
        device = getattr(engine, "device", None)
        if device is not None and device.type == "cuda":
            gpu_memory_gauges(r, device)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, endpoint: str, status: int, result: Any = None) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if result is not None:
            self.prompt_tokens.inc(result.usage.prompt_tokens)
            self.completion_tokens.inc(result.usage.completion_tokens)
            self.reused_tokens.inc(result.stats.reused_prompt_tokens)
            self.kv_kept.observe(result.stats.prompt_kv_bytes_kept)
            drafts = result.stats.drafts or {}
            self.drafted.inc(drafts.get("drafted_tokens", 0))
            self.accepted.inc(drafts.get("accepted_draft_tokens", 0))


class SchedulerCollector:
    """The continuous batcher's gauges (:mod:`snapkv_rag.engine.scheduler`), from one snapshot per scrape."""

    GAUGES = (
        ("snapkv_batch_rows", "running_rows", "Rows decoding in the running batch now"),
        ("snapkv_requests_running", "running_requests", "Requests decoding now (prefilled, not finished)"),
        ("snapkv_prefills_waiting", "waiting_tasks", "Model tasks (mostly prefills) waiting for the worker or for room in the batch"),
        ("snapkv_kv_bytes_in_use", "kv_bytes", "K/V bytes held by running requests (after compression, padding included)"),
        ("snapkv_decode_steps", "decode_steps", "Decode forwards so far (one per step of each batch)"),
        ("snapkv_decoded_rows", "decoded_rows", "Rows those forwards decoded: divided by snapkv_decode_steps, the mean batch size"),
    )

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        stats = self.engine.scheduler_stats()
        for name, field, documentation in self.GAUGES:
            yield GaugeMetricFamily(name, documentation, value=getattr(stats, field))


class PieceClock:
    """Times one request's pieces: the first against its arrival (TTFT), the rest against the one before."""

    def __init__(self, metrics: ServerMetrics, arrived: float):
        self.metrics = metrics
        self.last: float | None = None
        self.arrived = arrived

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now


def _prefix_hit_ratio(engine: Any) -> float:
    stats = engine.prefix_cache.stats()
    return _ratio(stats.hits, stats.lookups)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


class MemoryCollector:
    """The process's resident memory and what the C allocator holds (:mod:`snapkv_rag.model.allocator`):
    in use, and freed but kept (resident until trimmed)."""

    def collect(self):
        from ..model.allocator import malloc_stats, trim_stats
        from ..model.peak_memory import current_rss_bytes

        yield GaugeMetricFamily("snapkv_process_resident_bytes", "Resident memory of this process", value=current_rss_bytes())
        stats = malloc_stats()
        if stats is not None:
            yield GaugeMetricFamily("snapkv_malloc_in_use_bytes", "Bytes the C allocator has handed out (CPU tensors among them)", value=stats.in_use_bytes)
            yield GaugeMetricFamily("snapkv_malloc_free_bytes", "Bytes freed and still held by the C allocator", value=stats.free_bytes)
        trims, seconds = trim_stats()
        yield CounterMetricFamily("snapkv_malloc_trims", "Times the allocator's free pages were given back (every 5 s)", value=trims)
        yield CounterMetricFamily("snapkv_malloc_trim_seconds", "Seconds those trims took", value=seconds)


def gpu_memory_gauges(registry: CollectorRegistry, device: Any) -> None:
    """The GPU's memory as the engine's allocator sees it, read at each scrape."""
    import torch

    Gauge("snapkv_gpu_memory_allocated_bytes", "GPU memory held by tensors (weights, caches, activations)", registry=registry).set_function(
        lambda: torch.cuda.memory_allocated(device)
    )
    Gauge("snapkv_gpu_memory_reserved_bytes", "GPU memory reserved by PyTorch's caching allocator", registry=registry).set_function(
        lambda: torch.cuda.memory_reserved(device)
    )
    Gauge("snapkv_gpu_memory_total_bytes", "The GPU's memory", registry=registry).set_function(lambda: torch.cuda.get_device_properties(device).total_memory)
