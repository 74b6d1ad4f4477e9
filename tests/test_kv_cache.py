"""The in-place appending cache (issue 25): appends without copying the whole layer, re-seats after
anyone replaces its tensors, never writes into a tensor handed out before, decodes like DynamicCache."""

from __future__ import annotations

import pytest
import torch

from snapkv_rag.kv_cache import SPARE_ENTRIES, AppendLayer, new_cache


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g)


def test_appends_land_in_the_same_storage_until_it_is_full():
    layer = AppendLayer()
    k, v = kv(5)
    keys, values = layer.update(k, v)
    storage = keys.data_ptr()
    expected_k, expected_v = [k], [v]
    for step in range(SPARE_ENTRIES):
        k1, v1 = kv(1, seed=step + 1)
        keys, values = layer.update(k1, v1)
        expected_k.append(k1)
        expected_v.append(v1)
        assert keys.data_ptr() == storage  # no new allocation, no copy of the entries before
    assert torch.equal(keys, torch.cat(expected_k, dim=2)) and torch.equal(values, torch.cat(expected_v, dim=2))
    keys, _ = layer.update(*kv(1, seed=999))  # full: one copy into bigger storage
    assert keys.data_ptr() != storage and keys.shape[2] == 5 + SPARE_ENTRIES + 1
    assert torch.equal(keys[:, :, :-1], torch.cat(expected_k, dim=2))
    assert layer.get_seq_length() == 5 + SPARE_ENTRIES + 1


@pytest.mark.parametrize(
    "replace",
    [
        lambda t: t.index_select(2, torch.tensor([0, 2, 4])),  # a compression's gather
        lambda t: t[:, :, :3],  # a crop: a view of the same storage, shorter
        lambda t: t[[1, 0]],  # rows reordered (a batch that lost or gained members)
    ],
)
def test_a_replaced_tensor_is_never_written_into(replace):
    layer = AppendLayer()
    layer.update(*kv(5))
    layer.keys, layer.values = replace(layer.keys), replace(layer.values)
    kept_keys, kept_values = layer.keys.clone(), layer.values.clone()
    old_storage = layer._key_storage  # a crop still shares it: the next entry must not land there
    before = old_storage.clone()
    k1, v1 = kv(1, seed=7)
    keys, values = layer.update(k1, v1)
    assert torch.equal(old_storage, before)
    assert torch.equal(keys[:, :, :-1], kept_keys) and torch.equal(keys[:, :, -1:], k1)
    assert torch.equal(values[:, :, :-1], kept_values) and torch.equal(values[:, :, -1:], v1)


def test_views_handed_out_earlier_keep_their_entries():
    layer = AppendLayer()
    layer.update(*kv(4))
    earlier, _ = layer.update(*kv(1, seed=1))
    held = earlier.clone()
    for step in range(3):
        layer.update(*kv(1, seed=10 + step))
    assert torch.equal(earlier, held)


def test_the_engine_decodes_as_with_transformers_own_cache():
    """Greedy tokens through the engine (its cache) match a plain transformers loop over DynamicCache."""
    from conftest import tiny_engine
    from transformers import DynamicCache

    from snapkv_rag.prompts import render_prompt

    engine = tiny_engine("llama", seed=4)
    prompt = "alpha beta gamma delta epsilon zeta eta theta " * 4
    result = engine.generate(prompt, max_new_tokens=10, ignore_eos=True, compression=None, prefix_cache=False)
    ids = torch.tensor([render_prompt(engine.tokenizer, prompt)])
    cache = DynamicCache(config=engine.model.config)
    tokens = []
    with torch.inference_mode():
        logits = engine.model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(10):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(int(token))
            logits = engine.model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    assert result.token_ids == tokens
    assert all(type(layer) is AppendLayer for layer in new_cache(engine.model.config).layers)
