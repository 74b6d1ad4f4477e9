"""Fixtures for the connector's tests: the root test suite's tiny models, loaded under another name.

The root ``tests/conftest.py`` builds tiny random models and the in-memory tokenizer; it is
imported here by path (as ``snapkv_root_conftest``) so both test trees share one definition.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[3]
CONNECTOR = Path(__file__).resolve().parents[1]
if str(CONNECTOR) not in sys.path:  # runs without `pip install -e` too
    sys.path.insert(0, str(CONNECTOR))


def _root_conftest():
    name = "snapkv_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_root_conftest()
# Every public name of the root conftest, fixtures included. pytest keeps one module called
# "conftest" at a time, so root tests that do `from conftest import ...` may get this one;
# this module's own tests import helpers from `snapkv_root_conftest` and use fixtures instead.
from snapkv_root_conftest import *  # noqa: E402,F401,F403


@pytest.fixture(scope="session")
def sample_corpus() -> Path:
    return ROOT / "examples" / "sample_corpus"
