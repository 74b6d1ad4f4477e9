"""Free a caller thread's OpenMP threads when it hands torch work to the engine's worker.

Each thread that runs a parallel torch op gets its own OpenMP thread pool. GNU libgomp (torch's
OpenMP on Linux) lets idle pool threads spin between parallel regions only while the process
has no more OpenMP threads than CPUs; past that, every thread sleeps at once and each of the
hundreds of small parallel regions in a decode step pays a futex wake-up. So once the thread that
loaded the model (or embedded a query) had a pool, a decode loop on another thread took 63-69 ms
per token instead of 23-28 here (eval/decoding/RESULTS.md, "Packed weights and the caller's OpenMP
threads"). OpenMP 5's
``omp_pause_resource_all`` frees the calling thread's pool; torch builds a new one if that thread
runs torch again. Where no OpenMP runtime with that call is loaded, nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _loaded_runtimes() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return []
    paths = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(_RUNTIMES))


@functools.cache
def _pause_function() -> Callable[[int], int] | None:
    import torch  # noqa: F401  (loads torch's OpenMP runtime, the one to find)

    for path in _loaded_runtimes():
        try:
            function = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:
            continue
        if function is not None:
            function.argtypes = [ctypes.c_int]
            function.restype = ctypes.c_int
            return function
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP threads (call it outside any parallel region); whether it could."""
    from .portable import portable_enabled

    if portable_enabled():  # the portable path: the branch a CUDA device takes, which releases nothing
        return False
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
