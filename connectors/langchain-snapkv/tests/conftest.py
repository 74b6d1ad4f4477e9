"""Fixtures: tiny random engines from the project's root test helpers (no weights to fetch)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ROOT_TESTS = Path(__file__).resolve().parents[3] / "tests"


def _root_helpers():
    """The repository's tests/conftest.py, loaded under its own name (it builds tiny models)."""
    name = "snapkv_root_test_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _ROOT_TESTS / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny_engine():
    """A tiny random llama over a small byte-level tokenizer with a chat template."""
    return _root_helpers().tiny_engine("llama")


@pytest.fixture(scope="session")
def root_helpers():
    """The root tests' helpers (tiny_engine(family, **kwargs) builds a fresh engine)."""
    return _root_helpers()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    return _root_helpers().load_smollm_tokenizer()


@pytest.fixture(scope="session")
def tool_engine(smollm_tokenizer):
    """A tiny random model over the real SmolLM2 tokenizer (its chat template renders tools),
    biased toward closing JSON so constrained outputs end quickly."""
    helpers = _root_helpers()
    return helpers.tiny_tool_engine(smollm_tokenizer, bias=helpers.terse_bias(smollm_tokenizer))


@pytest.fixture(scope="session")
def embedder():
    from snapkv_rag.rag import Embedder

    return Embedder()
