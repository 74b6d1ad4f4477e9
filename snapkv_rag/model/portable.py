"""The portable path: the engine with every CPU-only optimisation off, the branch a CUDA device takes.

On a CPU the engine takes shortcuts a GPU never sees: linear weights packed for oneDNN
(:mod:`.packed_linear`), one query token's attention as a matmul and a softmax and a reused
prefix's attention through two maskless flash calls (:mod:`snapkv_rag.compression.runtime`),
PyTorch's int8 weight kernel over quantized K/V (:mod:`snapkv_rag.compression.quantized`), and
OpenMP threads released between calls (:mod:`.openmp`). With the portable path on, none of them
runs, so CPU tests exercise the code a CUDA device runs (tests/test_portable_path.py checks that
both paths give the same greedy tokens and kept entries). ``SNAPKV_RAG_PORTABLE=1`` turns it on
for the process (engines created afterwards load unpacked weights); :func:`portable_path` for a block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

ENVIRONMENT = "SNAPKV_RAG_PORTABLE"
# read at call time by the shortcuts' own checks (compression.runtime and .quantized, .openmp, .loading);
# from the environment at import, so the first load already sees it (an engine is built after its weights load)
_PORTABLE = os.environ.get(ENVIRONMENT, "").strip().lower() in ("1", "true", "yes", "on")


def portable_enabled() -> bool:
    return _PORTABLE


def set_portable(on: bool) -> None:
    """Turn the CPU-only shortcuts off (``on``) or back on, for the whole process."""
    global _PORTABLE
    _PORTABLE = bool(on)


@contextmanager
def portable_path() -> Iterator[None]:
    """The portable path inside the block (engines built inside it load unpacked weights)."""
    was = portable_enabled()
    set_portable(True)
    try:
        yield
    finally:
        set_portable(was)
