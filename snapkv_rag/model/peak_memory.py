"""Peak memory during a call: allocator peak on CUDA, sampled resident set size on CPU."""

from __future__ import annotations

import os
import resource
import threading
import time

import torch

from .placement import placed_with

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:  # not Linux: lifetime peak is the best available
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _RssSampler:
    """One thread samples the resident set size for every open :class:`PeakMemory` (concurrent
    requests share it rather than each waking a thread every few milliseconds)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._open: set[PeakMemory] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, peak: PeakMemory) -> None:
        with self._lock:
            self._open.add(peak)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="snapkv-rag-rss", daemon=True)
                self._thread.start()

    def remove(self, peak: PeakMemory) -> None:
        with self._lock:
            self._open.discard(peak)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            rss = current_rss_bytes()
            with self._lock:
                if not self._open:
                    self._thread = None
                    return
                for peak in self._open:
                    peak.peak_bytes = max(peak.peak_bytes, rss)


_SAMPLER = _RssSampler(0.005)


class PeakMemory:
    """Context manager; after exit ``peak_bytes`` and ``kind`` describe the block's peak, and
    ``added_bytes`` what the block added over the memory in use when it began (on CUDA the
    weights and the prefix cache's contents are in use before; on a CPU the process's RSS).

    On CUDA the allocator's peak counter is process-wide: it is reset only when no other block
    on the device is being measured (concurrent requests would reset each other's peaks), so a
    block that overlaps another reports the peak of both (``shared`` says so). Under a
    ``device_map`` the figures add up every GPU the model spans (:func:`.placement.placed_with`)."""

    _open_on_cuda: dict[torch.device, set[PeakMemory]] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = device
        self.gpus = [d for d in placed_with(device) if d.type == "cuda"] if device.type == "cuda" else []
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.shared = False
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_sampled"

    @property
    def added_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            with PeakMemory._lock:
                for gpu in self.gpus:
                    self._open_on(gpu)
                self.baseline_bytes = sum(int(torch.cuda.memory_allocated(gpu)) for gpu in self.gpus)
        else:
            self.peak_bytes = self.baseline_bytes = current_rss_bytes()
            _SAMPLER.add(self)
        return self

    def _open_on(self, gpu: torch.device) -> None:
        others = PeakMemory._open_on_cuda.setdefault(gpu, set())
        if others:
            for other in others:
                other.shared = True
            self.shared = True
        else:
            torch.cuda.reset_peak_memory_stats(gpu)
        others.add(self)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            with PeakMemory._lock:
                self.peak_bytes = sum(int(torch.cuda.max_memory_allocated(gpu)) for gpu in self.gpus)
                for gpu in self.gpus:
                    PeakMemory._open_on_cuda.get(gpu, set()).discard(self)
        else:
            _SAMPLER.remove(self)
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
