"""A model's window read without loading it: what a connector's profile shows before the first call."""

from __future__ import annotations

import pytest

from snapkv_rag.model.loading import declared_context_length, embedded_gguf_path
from snapkv_rag.testing import tiny_config


def test_a_model_directory_declares_its_config_window(tmp_path):
    config = tiny_config("llama", 64, context=1234)
    config.save_pretrained(tmp_path)
    assert declared_context_length(str(tmp_path)) == 1234


def test_unknown_names_declare_nothing(tmp_path):
    assert declared_context_length("some-org/not-downloaded") is None
    assert declared_context_length(str(tmp_path / "missing.gguf")) is None
    assert declared_context_length(str(tmp_path)) is None  # a directory without config.json


def test_a_gguf_file_declares_its_header_window_before_any_conversion(tmp_path):
    try:
        shipped = embedded_gguf_path()
    except Exception as exc:  # noqa: BLE001  (not installed: nothing to read)
        pytest.skip(f"the embedded model is not installed: {exc}")
    renamed = tmp_path / "renamed-copy.gguf"  # another stem: no converted directory to read instead
    renamed.symlink_to(shipped)
    assert declared_context_length(str(renamed)) == 8192
    assert declared_context_length("default") == 8192
