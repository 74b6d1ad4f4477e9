"""The CPU default dtype follows the CPU's native bf16 support (issue 25)."""

from __future__ import annotations

import pytest
import torch

from snapkv_rag.model import loading
from snapkv_rag.model.loading import choose_device, cpu_bf16_support

X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "flags\t\t: avx512f amx_bf16 amx_tile\n"
ARM = "Features\t: fp asimd bf16 i8mm\n"
OLD = "flags\t\t: fpu sse2 avx2 avx512f\n"


@pytest.mark.parametrize("text, feature", [(X86, "AVX512-BF16"), (AMX, "AMX-BF16"), (ARM, "ARM BF16"), (OLD, None), ("", None)])
def test_features_are_read_from_cpuinfo(text, feature):
    assert cpu_bf16_support(text) == feature


@pytest.mark.parametrize("feature, dtype", [("AVX512-BF16", torch.bfloat16), (None, torch.float32)])
def test_cpu_default_follows_the_feature(monkeypatch, feature, dtype):
    monkeypatch.setattr(loading, "cpu_bf16_support", lambda: feature)
    assert choose_device("cpu").dtype == dtype
    assert choose_device("cpu", "float32").dtype == torch.float32  # --dtype still overrides
    assert choose_device("cpu", "bfloat16").dtype == torch.bfloat16


def test_a_tiny_model_loads_in_the_chosen_dtype(tmp_path, monkeypatch):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine

    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for feature, dtype in (("AVX512-BF16", "bfloat16"), (None, "float32")):
        monkeypatch.setattr(loading, "cpu_bf16_support", lambda feature=feature: feature)
        engine = Engine.from_pretrained(str(tmp_path), device="cpu")
        assert engine.info().dtype == dtype
        assert engine.generate("Hello world", max_new_tokens=3).usage.completion_tokens == 3
