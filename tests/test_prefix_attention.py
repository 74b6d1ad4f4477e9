"""A prompt's rest over a cached prefix attends at a causal prefill's cost (issue 48): two
maskless flash-attention calls merged by their log-sum-exp, not SDPA with an explicit mask.
Exact: the same attention as the causal mask with an offset, the same logits as a whole
prefill, and the same entries kept by the compression."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tokenizer, tiny_engine
from transformers import DynamicCache

import snapkv_rag.compression.runtime as runtime
from snapkv_rag.compression.runtime import cached_prefix_attention
from snapkv_rag.engine.generation import model_forward


def offset_causal_reference(query, key, value):
    q, n = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    mask = torch.ones(q, n, dtype=torch.bool).tril(n - q)
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("cached", "new"), [(1, 40), (100, 7), (64, 64), (3, 2)])
def test_the_merged_attention_is_the_offset_causal_one(dtype, tolerance, cached, new):
    torch.manual_seed(cached + new)
    query = torch.randn(2, 6, new, 16, dtype=dtype)
    key, value = torch.randn(2, 2, cached + new, 16, dtype=dtype), torch.randn(2, 2, cached + new, 16, dtype=dtype)
    got = cached_prefix_attention(query, key, value)
    assert got.shape == (2, new, 6, 16) and got.dtype == dtype
    torch.testing.assert_close(got.float(), offset_causal_reference(query, key, value).float(), atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", build_tokenizer(), context=1024)


class Counted:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = runtime.cached_prefix_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(runtime, "cached_prefix_attention", counted)


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 0.9])
def test_a_suffix_over_a_cached_prefix_gives_the_whole_prefills_logits(engine, monkeypatch, share):
    model = engine.model
    torch.manual_seed(1)
    ids = torch.randint(10, engine.tokenizer.vocab_size, (1, 300))
    positions = torch.arange(300)[None]
    cut = int(300 * share)
    whole = model_forward(model, DynamicCache(config=model.config), ids, None, positions, last_only=False)
    counted = Counted(monkeypatch)
    cache = DynamicCache(config=model.config)
    model_forward(model, cache, ids[:, :cut], None, positions[:, :cut])
    rest = model_forward(model, cache, ids[:, cut:], None, positions[:, cut:], last_only=False)
    assert counted.calls == model.config.num_hidden_layers  # every layer took the merged path
    torch.testing.assert_close(rest, whole[:, cut:], atol=2e-5, rtol=1e-4)


def test_an_explicit_mask_keeps_sdpa(engine, monkeypatch):
    model = engine.model
    ids = torch.randint(10, engine.tokenizer.vocab_size, (1, 40))
    counted = Counted(monkeypatch)
    cache = DynamicCache(config=model.config)
    model_forward(model, cache, ids[:, :20], torch.ones(1, 20, dtype=torch.long), torch.arange(20)[None])
    model_forward(model, cache, ids[:, 20:], torch.ones(1, 40, dtype=torch.long), torch.arange(20, 40)[None])
    assert counted.calls == 0


def test_reuse_at_a_small_share_keeps_the_same_answer_and_entries(engine, monkeypatch):
    """A stored prefix of a fifth of the prompt, reused: the same greedy text and the same kept entries as no reuse."""
    from snapkv_rag.compression.runtime import recording_kept_indices
    from snapkv_rag.reuse import prefix_cache

    monkeypatch.setattr(prefix_cache, "MIN_REUSE_SHARE", 0.0)
    opening = "The harbour office logs each ferry's departure and its cargo. " * 3
    prompt = opening + "The weather at the pier is recorded at noon. " * 12 + "What does the office log?"
    engine.prefix_cache.clear()
    with recording_kept_indices() as cold_kept:
        cold = engine.generate(prompt, max_new_tokens=24, compression="snapkv:budget=96", chat=False)
    engine.prefix_cache.clear()
    engine.generate(opening, max_new_tokens=1, compression="full", chat=False)  # stores the opening alone
    counted = Counted(monkeypatch)
    with recording_kept_indices() as warm_kept:
        warm = engine.generate(prompt, max_new_tokens=24, compression="snapkv:budget=96", chat=False)
    share = warm.stats.reused_prompt_tokens / warm.usage.prompt_tokens
    assert 0.1 < share < 0.35, share
    assert counted.calls > 0
    assert warm.text == cold.text
    assert len(warm_kept) == len(cold_kept) == 1
    assert {i: t.tolist() for i, t in warm_kept[0].layers.items()} == {i: t.tolist() for i, t in cold_kept[0].layers.items()}
