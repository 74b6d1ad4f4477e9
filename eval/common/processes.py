"""Child processes of the benchmarks: a benchmark module run again in a process of its own (one
measurement per process, so no run inherits the memory or the thread pools of another), and
``snapkv-rag serve`` started on a free port for the serving benchmarks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this interpreter (run it with :func:`child_env`)."""
    return [sys.executable, "-m", module, *args]


def child_env() -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH``, so ``eval``
    imports in the child whatever its working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(serve_args: list[str], log_path: Path, env: dict[str, str] | None = None):
    """``snapkv-rag serve serve_args...`` as a child process on a free loopback port, its output in
    ``log_path``; ``(process, base URL)`` once ``/health`` answers 200 (SystemExit if it exits first)."""
    import subprocess
    import time

    import httpx

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--port", str(port), *serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or {**os.environ, "HF_HUB_OFFLINE": "1"})
    while True:
        if process.poll() is not None:
            raise SystemExit(f"serve exited with {process.returncode}: see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
