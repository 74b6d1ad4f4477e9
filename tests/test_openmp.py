"""Freeing a caller thread's OpenMP threads (issue 25): the call frees them, and a request handed to
the engine's worker frees the caller's."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from snapkv_rag.model.openmp import _pause_function, release_thread_pool

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc"),
    pytest.mark.skipif(_pause_function() is None, reason="no OpenMP runtime with omp_pause_resource_all is loaded"),
]


def process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(expected: int) -> int:
    """The thread count once exiting threads are gone (or after 2 s)."""
    deadline = time.monotonic() + 2
    while process_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return process_threads()


def steady() -> int:
    """The thread count once it has not changed for 0.3 s (an idle engine worker frees its pool)."""
    count, since = process_threads(), time.monotonic()
    deadline = since + 5
    while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        if process_threads() != count:
            count, since = process_threads(), time.monotonic()
    return count


def in_fresh_thread(fn):
    """Run ``fn(report)`` in a new thread with 2 torch threads; what it reported."""
    report: dict = {}

    def body():
        torch.set_num_threads(2)
        fn(report)

    previous = torch.get_num_threads()
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    torch.set_num_threads(previous)
    return report


def parallel_work() -> None:
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a


def test_release_frees_the_calling_threads_pool():
    def body(report):
        before = process_threads()
        parallel_work()  # builds this thread's pool: one more thread for 2 torch threads
        report["with_pool"] = process_threads()
        report["released"] = release_thread_pool()
        report["after"] = settle(before)
        report["before"] = before
        parallel_work()  # torch builds a new pool when needed
        report["again"] = process_threads()

    report = in_fresh_thread(body)
    assert report["with_pool"] == report["before"] + 1
    assert report["released"] is True
    assert report["after"] == report["before"]
    assert report["again"] == report["before"] + 1


def test_a_request_frees_the_callers_pool():
    from conftest import tiny_engine

    engine = tiny_engine("llama", seed=1)
    engine.generate("warm the worker up", max_new_tokens=2)
    steady()

    def body(report):
        before = process_threads()
        parallel_work()
        report["with_pool"] = process_threads()
        engine.generate("one two three", max_new_tokens=2, ignore_eos=True)
        report["after"] = settle(before)
        report["before"] = before

    report = in_fresh_thread(body)
    assert report["with_pool"] == report["before"] + 1
    assert report["after"] == report["before"]  # handing the request over freed this thread's pool
