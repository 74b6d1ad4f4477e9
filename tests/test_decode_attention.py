"""The decode attention path (one query token, CPU) against transformers' SDPA (issue 25)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_engine
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from snapkv_rag.compression import runtime
from snapkv_rag.compression.runtime import decode_attention


class Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def masks(b: int, heads: int, n: int):
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding of row 0
    additive = torch.zeros(b, 1, 1, n).masked_fill(~keep, torch.finfo(torch.float32).min)
    per_head = keep.expand(b, heads, 1, n).clone()
    per_head[:, 1, :, 5:9] = False
    return {"none": None, "bool": keep, "additive": additive, "per-head bool": per_head}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per-head bool"])
def test_matches_sdpa(dtype, tol, heads, kv_heads, mask_kind):
    torch.manual_seed(0)
    b, n, d = 2, 37, 16
    query = torch.randn(b, heads, 1, d, dtype=dtype)
    key = torch.randn(b, kv_heads, n, d, dtype=dtype)
    value = torch.randn(b, kv_heads, n, d, dtype=dtype)
    mask = masks(b, heads, n)[mask_kind]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    module = Module(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert got.shape == expected.shape == (b, 1, heads, d)
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


def _greedy(engine, prompts, **kwargs):
    return [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=12, **kwargs)]


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_is_unchanged_in_every_family(tokenizer, family, monkeypatch):
    """Greedy tokens of a padded batch, full cache and SnapKV, with and without the decode path."""
    engine = tiny_engine(family, tokenizer)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 6, "Hello world"]
    fast = [_greedy(engine, prompts), _greedy(engine, prompts, compression="snapkv:budget=24,window=4")]
    monkeypatch.setattr(runtime, "FAST_DECODE_ATTENTION", False)
    slow = [_greedy(engine, prompts), _greedy(engine, prompts, compression="snapkv:budget=24,window=4")]
    assert fast == slow


def test_gemma3_sliding_layers_are_unchanged(tokenizer, monkeypatch):
    from conftest import gemma3_engine

    engine = gemma3_engine(tokenizer, sliding_window=16)
    prompt = "Numbers like 1234 and 5678 appear in passkeys. " * 5
    fast = engine.generate(prompt, max_new_tokens=24).token_ids
    monkeypatch.setattr(runtime, "FAST_DECODE_ATTENTION", False)
    assert engine.generate(prompt, max_new_tokens=24).token_ids == fast


def test_the_decode_path_is_the_one_taken(tokenizer, monkeypatch):
    calls = []
    original = runtime.decode_attention
    monkeypatch.setattr(runtime, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    engine = tiny_engine("llama", tokenizer)
    engine.generate("Hello world", max_new_tokens=4)
    assert calls  # every decode step of every layer; prefill (many queries) stays on SDPA
