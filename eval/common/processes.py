"""Running a benchmark module again in a child process of its own (one measurement per process,
so no run inherits the memory or the thread pools of another)."""

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
