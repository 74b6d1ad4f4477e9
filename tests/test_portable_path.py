"""The portable path (issue 63): with every CPU-only shortcut off (packed weights, the CPU decode
and prefix attention kernels, the int8 K/V kernel, OpenMP release), the branch a CUDA device
takes, the engine gives the same greedy tokens and keeps the same entries as its default CPU path,
for every policy and reuse mode, on the tiny models."""

from __future__ import annotations

import pytest
import torch
from test_less import active_kernels

from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.compression.runtime import recording_kept_indices
from snapkv_rag.model.packed_linear import pack_linear_weights
from snapkv_rag.model.portable import portable_enabled, portable_path
from snapkv_rag.testing import tiny_engine

DOC = "The harbour office opens at nine. The ferry to Tessaly leaves at 6:15 and returns at noon. " * 3
PROMPTS = [DOC + "\nWhen does the ferry leave?", "Name three colours.", DOC[:150] + "\nWho opens the office?"]
SPECS = [
    None,
    "snapkv:budget=24,window=8",
    "snapkv:budget=40,window=question,max_window=16",
    "snapkv:budget=24,window=8,kv_bits=8",
    "snapkv:budget=24,window=8,kv_bits=4",
    "snapkv:budget=24,window=8,decode_budget=32,decode_interval=8",
    "snapkv:budget=32,window=8,rolling=48",
    "h2o:budget=24",
    "streaming:budget=20,sinks=4",
    "random:budget=48",
]


def engines(tokenizer, dtype):
    """The default CPU path (packed weights where oneDNN packs this dtype) and the portable one."""
    default = tiny_engine("llama", tokenizer, seed=1)
    default.model.to(dtype)
    pack_linear_weights(default.model)
    with portable_path():
        portable = tiny_engine("llama", tokenizer, seed=1)
    portable.model.to(dtype)
    for engine in (default, portable):
        engine.prefix_cache.admission = "always"
    return default, portable


def run(engine, portable: bool, call):
    """``call(engine)`` on its path, with what every compressed prefill kept."""
    if portable:
        with portable_path(), recording_kept_indices() as kept:
            return call(engine), kept
    with recording_kept_indices() as kept:
        return call(engine), kept


def same(default_run, portable_run, dtype=torch.float32):
    """Greedy tokens equal in fp32; in bf16 the first token (the prefill's) and the kept entries:
    there the two decode-attention kernels round differently, and a tiny random model's near-tied
    logits turn that into other tokens a few steps on (measured by python -m eval gpu_check)."""
    (a, kept_a), (b, kept_b) = default_run, portable_run
    results_a, results_b = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
    if dtype == torch.float32:
        assert [r.token_ids for r in results_a] == [r.token_ids for r in results_b]
    else:
        assert [r.token_ids[:1] for r in results_a] == [r.token_ids[:1] for r in results_b]
    assert len(kept_a) == len(kept_b)
    for x, y in zip(kept_a, kept_b):
        assert x.layers.keys() == y.layers.keys()
        for layer in x.layers:
            assert torch.equal(torch.sort(x.layers[layer], -1).values, torch.sort(y.layers[layer], -1).values), layer


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def pair(request, tokenizer):
    return (*engines(tokenizer, request.param), request.param)


def test_the_portable_switch_turns_every_shortcut_off_and_back(monkeypatch):
    from snapkv_rag.compression import quantized
    from snapkv_rag.model import openmp

    products = []
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *args: products.append(1) or torch.zeros(2, 4, dtype=torch.bfloat16), raising=False)
    weights, codes = torch.ones(1, 1, 2, 3, dtype=torch.bfloat16), torch.ones(1, 1, 4, 3, dtype=torch.int8)
    assert not portable_enabled()
    with portable_path():
        assert portable_enabled() and openmp.release_thread_pool() is False
        quantized._int8_product(weights, codes)
        assert products == []  # the cast-and-multiply a GPU runs
    assert not portable_enabled()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s or "full")
def test_every_policy_agrees_with_the_default_path(pair, spec):
    default, portable, dtype = pair

    def call(engine):
        return engine.generate(PROMPTS[0], compression=spec, max_new_tokens=8, ignore_eos=True, chat=False, prefix_cache=False)

    same(run(default, False, call), run(portable, True, call), dtype)


def test_padded_batches_drafts_and_reuse_agree(pair):
    default, portable, dtype = pair
    spec = "snapkv:budget=24,window=8"

    def batch(engine):
        return engine.generate_batch(PROMPTS, compression=spec, max_new_tokens=6, ignore_eos=True, chat=False, bucket=False, prefix_cache=False)

    def drafted(engine):
        return engine.generate(PROMPTS[0], compression=spec, max_new_tokens=8, ignore_eos=True, chat=False, prefix_cache=False, prompt_lookup_num_tokens=4)

    def prefix_reuse(engine):  # stores, then a second question reuses the stored document
        engine.prefix_cache.clear()
        engine.generate(DOC + "\nWhat opens at nine?", compression=spec, max_new_tokens=2, chat=False)
        again = engine.generate(PROMPTS[0], compression=spec, max_new_tokens=8, ignore_eos=True, chat=False)
        assert again.stats.reused_prompt_tokens > 0
        return again

    def chunk_reuse(engine):  # the document's K/V stored once, then blended into the prompt
        engine.segment_store.clear()
        engine.generate(PROMPTS[0], reuse_segments=[DOC], max_new_tokens=2, chat=False, prefix_cache=False)
        again = engine.generate(PROMPTS[0], reuse_segments=[DOC], compression=spec, max_new_tokens=8, ignore_eos=True, chat=False, prefix_cache=False)
        assert again.stats.segment_hits == 1
        return again

    for call in (batch, drafted, prefix_reuse, chunk_reuse):
        same(run(default, False, call), run(portable, True, call), dtype)


def test_less_agrees_with_the_default_path(tokenizer):
    default, portable = engines(tokenizer, torch.float32)
    policy = LESS(base=SnapKV(window_size=4, max_capacity_prompt=16, kernel_size=3), kernels=active_kernels(default))

    def call(engine):
        return engine.generate(PROMPTS[0], compression=policy, max_new_tokens=8, ignore_eos=True, chat=False, prefix_cache=False)

    same(run(default, False, call), run(portable, True, call))


def test_the_environment_turns_the_portable_path_on_before_any_engine():
    """SNAPKV_RAG_PORTABLE=1 is read at import: the first load (before any Engine exists) already
    keeps the weights unpacked; it was read when an Engine was built, after its weights were packed."""
    import os
    import subprocess
    import sys

    code = "from snapkv_rag.model.portable import portable_enabled; print(portable_enabled())"
    for value, expected in (("1", "True"), ("", "False")):
        env = {**os.environ, "SNAPKV_RAG_PORTABLE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert out == expected
