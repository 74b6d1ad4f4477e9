"""Peak memory during a call: allocator peak on CUDA, sampled resident set size on CPU."""

from __future__ import annotations

import os
import resource
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:  # not Linux: lifetime peak is the best available
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Context manager; after exit ``peak_bytes`` and ``kind`` describe the block's peak."""

    def __init__(self, device: torch.device, interval_s: float = 0.005):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
