"""The C allocator under a long-running server: what it holds, and keeping it bounded.

On a CPU every tensor is malloc'd. glibc's malloc keeps what a request frees for later
requests instead of giving it back, in one arena per thread that allocated (up to eight per
core), and raises its mmap threshold up to 32 MiB after a large block is freed, so K/V caches
and activations of ever-new shapes come from those arenas and fragment them. A server's
resident memory then grows with no plateau although the tensors in use do not
(eval/serving/RESULTS.md, "Server memory over a soak").

:func:`bound_allocator` (``snapkv-rag serve`` calls it before the model loads) caps the arenas
and returns free pages to the system every few seconds (``malloc_trim``).
``SNAPKV_RAG_MALLOC=system`` leaves glibc's defaults, for comparison. :func:`malloc_stats`
reads the allocator's bytes in use and held free, for ``/metrics``. Off glibc (musl, macOS)
all of this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import time
from dataclasses import dataclass

M_ARENA_MAX = -8  # mallopt parameters (malloc.h)
ARENAS = 2
TRIM_EVERY_SECONDS = 5.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "mallinfo2")):  # glibc 2.33+
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


@dataclass(frozen=True)
class MallocStats:
    in_use_bytes: int  # handed out and not freed (small blocks and mmapped ones)
    free_bytes: int  # freed and still held by the allocator (in its arenas): resident until trimmed


def malloc_stats() -> MallocStats | None:
    """The allocator's bytes, or None off glibc. (mallinfo2 walks every arena: milliseconds.)"""
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return MallocStats(in_use_bytes=info.uordblks + info.hblkhd, free_bytes=info.fordblks)


def trim() -> float:
    """Give the allocator's free pages back to the system; the seconds it took."""
    libc = _libc()
    if libc is None:
        return 0.0
    started = time.perf_counter()
    libc.malloc_trim(0)
    return time.perf_counter() - started


class _Trimmer:
    def __init__(self, every: float):
        self.every = every
        self.trims = 0
        self.seconds = 0.0
        threading.Thread(target=self._run, name="snapkv-rag-malloc-trim", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            self.seconds += trim()
            self.trims += 1


_TRIMMER: _Trimmer | None = None


def bound_allocator(every: float = TRIM_EVERY_SECONDS) -> bool:
    """Cap glibc's arenas and trim its free pages every ``every`` seconds from now on (once per
    process); False where it does not apply (not glibc, or ``SNAPKV_RAG_MALLOC=system``)."""
    global _TRIMMER
    setting = os.environ.get("SNAPKV_RAG_MALLOC", "bounded")
    if setting not in ("bounded", "system"):
        raise ValueError(f"SNAPKV_RAG_MALLOC must be 'bounded' or 'system', got {setting!r}")
    libc = _libc()
    if setting == "system" or libc is None:
        return False
    if _TRIMMER is None:
        libc.mallopt(M_ARENA_MAX, ARENAS)
        _TRIMMER = _Trimmer(every)
    return True


def trim_stats() -> tuple[int, float]:
    """Trims done by :func:`bound_allocator`'s thread, and the seconds they took."""
    return (_TRIMMER.trims, _TRIMMER.seconds) if _TRIMMER is not None else (0, 0.0)
