"""Kept entries stored in 8 or 4 bits (issue 50): the quantize/dequantize bounds, the layer's
residual and flushes, attention over the codes, bytes held, and the engine paths it composes with."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression import as_policy, parse_compression
from snapkv_rag.compression.quantized import (
    KEY_GROUP,
    MIN_RESIDUAL,
    QuantizedKeys,
    QuantizedLayer,
    QuantizedValues,
    _pack,
    _unpack,
    cache_kv_bits,
    is_quantized,
)
from snapkv_rag.compression.runtime import decode_attention
from snapkv_rag.engine.generation import DecodeRun, cache_bytes
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.errors import InvalidCompressionError


def dense(batch=2, heads=3, n=300, dim=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=gen) * torch.linspace(0.5, 8, dim)  # channels of different ranges
    keys[..., 5] += 30.0  # an outlier channel, as real keys have
    values = torch.randn(batch, heads, n, dim, generator=gen)
    return keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_four_bit_codes_pack_two_to_a_byte_and_back(bits):
    half = 1 << (bits - 1)
    codes = torch.randint(-half, half, (2, 3, 6, 64), dtype=torch.int8)  # centred codes
    for dim in (-1, -2):
        packed = _pack(codes, bits, dim)
        assert packed.dtype == torch.int8 and packed.shape[dim] == codes.shape[dim] // (8 // bits)
        assert torch.equal(_unpack(packed, bits, dim), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_round_trip_within_half_a_step_per_channel_and_group(bits):
    keys, _ = dense(n=4 * KEY_GROUP)
    quantized = QuantizedKeys.of(keys, bits)
    error = (quantized.dequantize(torch.float32) - keys).abs()
    grouped = keys.reshape(2, 3, 4, KEY_GROUP, 64)
    step = (grouped.amax(3) - grouped.amin(3)) / ((1 << bits) - 1)  # [b, h, groups, dim]: per channel and group
    bound = (step / 2 + step * 1e-2 + 1e-2 * grouped.abs().amax(3) * 2**-10)[:, :, :, None, :]
    assert (error.reshape(grouped.shape) <= bound).all()
    # per channel: the outlier channel's range does not widen the others' steps
    assert error[..., 0].max() < error[..., 5].max()


@pytest.mark.parametrize("bits", [8, 4])
def test_values_round_trip_within_half_a_step_per_entry(bits):
    _, values = dense(n=100)
    quantized = QuantizedValues.of(values, bits)
    error = (quantized.dequantize(torch.float32) - values).abs()
    step = (values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)) / ((1 << bits) - 1)
    assert (error <= step / 2 + step * 1e-2 + 1e-3).all()
    relative = float((quantized.dequantize(torch.float32) - values).norm() / values.norm())
    assert relative < (0.01 if bits == 8 else 0.12)


def test_a_constant_slice_quantizes_without_dividing_by_zero():
    keys = torch.full((1, 1, KEY_GROUP, 8), 2.5)
    assert torch.allclose(QuantizedKeys.of(keys, 4).dequantize(torch.float32), keys)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_layer_quantizes_whole_groups_and_keeps_the_latest_entries_at_full_width(bits):
    keys, values = dense(n=300)
    layer = QuantizedLayer(bits, residual=40)
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    assert layer.quantized_entries == (300 - 40) // KEY_GROUP * KEY_GROUP == 256
    assert layer.get_seq_length() == 300
    assert torch.equal(layer.keys[:, :, 256:], keys[:, :, 256:])  # the residual is exact
    assert torch.allclose(layer.keys, keys, atol=float(keys.abs().max()) / (2 ** (bits - 1)))
    # appending: the residual grows to residual + group, then its oldest whole groups are quantized
    for step in range(KEY_GROUP):
        layer.update(keys[:, :, :1], values[:, :, :1])
        rest = layer.get_seq_length() - layer.quantized_entries
        assert 40 <= rest < 40 + KEY_GROUP, step
    assert layer.get_seq_length() == 300 + KEY_GROUP
    assert layer.quantized_entries == 320


def test_the_residual_is_at_least_the_minimum():
    assert QuantizedLayer(8, residual=4).residual == MIN_RESIDUAL


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_held_are_the_tensors_held_and_near_the_ideal(bits):
    keys, values = dense(batch=1, n=64 * 64 + 32, dtype=torch.bfloat16)
    layer = QuantizedLayer.from_layer(_Dense(keys, values), bits, residual=32)
    tensors = [*layer._key_body.tensors(), *layer._value_body.tensors(), layer._key_rest, layer._value_rest]
    assert layer.held_bytes() == sum(t.untyped_storage().nbytes() for t in tensors)  # no view holds a bigger buffer
    body = layer._key_body.nbytes + layer._value_body.nbytes
    ideal = 2 * keys[:, :, : layer.quantized_entries].numel() * 2 * bits / 16  # bits/16 of bf16
    assert ideal <= body <= 1.15 * ideal


class _Dense:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_attention_over_the_codes_equals_attention_over_the_dequantized_entries(dtype, bits, mask_kind):
    keys, values = dense(batch=2, heads=2, n=333, dim=64, dtype=dtype)
    layer = QuantizedLayer.from_layer(_Dense(keys, values), bits, residual=40)
    query = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(1)).to(dtype)  # 3 query heads per KV head
    mask = None
    if mask_kind is not None:
        allowed = torch.ones(2, 1, 1, 333, dtype=torch.bool)
        allowed[1, ..., :50] = False  # row 1 is left-padded
        mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).to(dtype)
    got = layer.attend(query, mask, 0.125)
    want, _ = decode_attention(None, query.float(), layer.keys.float(), layer.values.float(), mask, scaling=0.125)
    assert got.shape == want.shape == (2, 1, 6, 64) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    else:  # bf16 rounds the products in another order: no further from float32 than the engine's bf16 attention is
        engine_bf16, _ = decode_attention(None, query, layer.keys, layer.values, mask, scaling=0.125)
        relative, engine_relative = ((out.float() - want).norm() / want.norm() for out in (got, engine_bf16))
        assert relative <= max(2 * engine_relative, 0.02)
    # and near attention over the original entries (these keys have a +30 outlier channel and wide ranges)
    exact, _ = decode_attention(None, query.float(), keys.float(), values.float(), mask, scaling=0.125)
    relative = float((got.float() - exact).norm() / exact.norm())
    assert relative < (0.05 if bits == 8 else 0.4), relative


def test_crop_takes_rejected_drafts_from_the_residual_or_the_body():
    keys, values = dense(batch=1, n=200)
    layer = QuantizedLayer.from_layer(_Dense(keys, values), 8, residual=40)
    before = layer.keys
    layer.crop(-5)
    assert layer.get_seq_length() == 195 and torch.equal(layer.keys, before[:, :, :195])
    layer.crop(-100)  # more than the residual holds
    assert layer.get_seq_length() == 95
    assert torch.allclose(layer.keys, before[:, :, :95], atol=0.2)


def test_kv_bits_is_a_setting_of_every_policy_and_bad_values_are_one_clear_error():
    assert parse_compression("snapkv:budget=256,kv_bits=4").kv_bits == 4
    assert parse_compression("streamingllm:budget=256,kv_bits=8").kv_bits == 8
    assert parse_compression("h2o:budget=256,kv_bits=8").kv_bits == 8
    assert parse_compression("random:budget=256,kv_bits=4").kv_bits == 4
    assert parse_compression("less:base=snapkv,budget=256,kv_bits=4").kv_bits == 4
    assert as_policy("full:kv_bits=8") is not None and as_policy("full") is None
    assert "kv_bits=4" in parse_compression("snapkv:budget=256,kv_bits=4").spec()
    assert "kv_bits" not in parse_compression("snapkv:budget=256").spec()
    for bad, needle in [
        ("snapkv:budget=256,kv_bits=3", "kv_bits must be 8 or 4"),
        ("full:kv_bits=16", "kv_bits must be 8 or 4"),
        ("snapkv:budget=256,kv_bits=true", "kv_bits must be 8 or 4"),
        ("snapkv:budget=256,heads=adaptive,kv_bits=8", "does not combine with heads='adaptive'"),
    ]:
        with pytest.raises(InvalidCompressionError, match=needle):
            parse_compression(bad)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return tiny_engine(tokenizer=tokenizer)


def _prompt(tokenizer, words=110):
    return " ".join(f"word{i % 50}" for i in range(words))


def _decode_logits(engine, rows, policy, tokens):
    """Logits of each step when ``tokens`` are fed one at a time after the prefill."""
    run = DecodeRun(engine.model, rows, GenerationParams(max_new_tokens=len(tokens) + 1), policy, engine._pad_id)
    with torch.inference_mode():
        out = [run.prefill()]
        for token in tokens:
            out.append(run.decode_step(torch.tensor([token] * len(rows))))
    return run, torch.stack(out)


@pytest.mark.parametrize("spec", ["full:kv_bits=8", "snapkv:budget=200,kv_bits=8", "snapkv:budget=200,kv_bits=4"])
def test_decoding_over_quantized_entries_stays_close_to_the_same_policy_unquantized(tiny, tokenizer, spec, monkeypatch):
    rows = [tokenizer(_prompt(tokenizer))["input_ids"]]
    fused = []
    original = QuantizedLayer.attend
    monkeypatch.setattr(QuantizedLayer, "attend", lambda self, *a: fused.append(1) or original(self, *a))
    tokens = list(range(10, 40))
    run, quantized = _decode_logits(tiny, rows, parse_compression(spec), tokens)
    _, reference = _decode_logits(tiny, rows, as_policy(spec.replace(",kv_bits=8", "").replace(",kv_bits=4", "").replace(":kv_bits=8", "")), tokens)
    assert all(is_quantized(layer) for layer in run.cache.layers) and cache_kv_bits(run.cache) == int(spec[-1])
    assert len(fused) == len(tokens) * len(run.cache.layers)  # every decode step attended over the codes
    assert torch.equal(quantized[0], reference[0])  # the prefill itself is full precision
    kl = torch.nn.functional.kl_div(quantized.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert float(kl.max()) < (1e-3 if "8" in spec else 2e-2)


def test_bytes_reported_are_the_bytes_held(tiny, tokenizer):
    prompt = _prompt(tokenizer)
    result = tiny.generate(prompt, max_new_tokens=4, compression="snapkv:budget=200,kv_bits=4")
    unquantized = tiny.generate(prompt, max_new_tokens=4, compression="snapkv:budget=200")
    rows = [tokenizer(prompt)["input_ids"]]
    run = DecodeRun(tiny.model, rows, GenerationParams(max_new_tokens=1), parse_compression("snapkv:budget=200,kv_bits=4"), tiny._pad_id)
    with torch.inference_mode():
        run.prefill()
    held = sum(t.numel() * t.element_size() for layer in run.cache.layers for t in _stored(layer))
    assert cache_bytes(run.cache) == held == run.prompt_kv_bytes_kept
    assert run.row_kv_bytes(0)[0] == held
    assert result.stats.prompt_kv_bytes_full == unquantized.stats.prompt_kv_bytes_full
    assert result.stats.prompt_kv_bytes_kept < unquantized.stats.prompt_kv_bytes_kept
    assert result.stats.compression["kv_bits"] == 4


def _stored(layer):
    return [*layer._key_body.tensors(), *layer._value_body.tensors(), layer._key_rest, layer._value_rest]


def test_decode_time_cuts_keep_the_layers_quantized_and_within_budget(tiny, tokenizer):
    spec = "snapkv:budget=200,decode_budget=150,decode_interval=16,kv_bits=8"
    result = tiny.generate(_prompt(tokenizer), max_new_tokens=80, min_new_tokens=80, compression=spec)
    assert result.usage.completion_tokens == 80
    run = DecodeRun(
        tiny.model,
        [tokenizer(_prompt(tokenizer))["input_ids"]],
        GenerationParams(max_new_tokens=40, min_new_tokens=40),
        parse_compression("snapkv:budget=200,decode_budget=150,decode_interval=16,kv_bits=8"),
        tiny._pad_id,
    )
    for _ in run.steps():
        pass
    assert all(is_quantized(layer) for layer in run.cache.layers)
    assert max(layer.get_seq_length() for layer in run.cache.layers) <= 150 + 16


def test_a_padded_batch_decodes_over_quantized_entries(tiny, tokenizer):
    prompts = [_prompt(tokenizer, 110), _prompt(tokenizer, 60)]
    results = tiny.generate_batch(prompts, max_new_tokens=12, compression="snapkv:budget=150,kv_bits=8")
    alone = [tiny.generate(p, max_new_tokens=12, compression="snapkv:budget=150") for p in prompts]
    assert [r.usage.completion_tokens for r in results] == [12, 12]
    assert results[0].stats.prompt_kv_bytes_kept < alone[0].stats.prompt_kv_bytes_kept


def test_requests_share_a_decode_group_only_with_entries_of_their_width(tiny, tokenizer):
    from snapkv_rag.engine.scheduler import SharedGroup

    rows = [tokenizer(_prompt(tokenizer))["input_ids"]]

    def prefilled(spec):
        run = DecodeRun(tiny.model, rows, GenerationParams(max_new_tokens=4), as_policy(spec), tiny._pad_id)
        with torch.inference_mode():
            run.prefill()
        return run

    group = SharedGroup(tiny.model)
    group.cache = prefilled("snapkv:budget=200,kv_bits=8").cache
    group.members = [object()]  # one member already decoding
    assert group.fits(prefilled("snapkv:budget=200,kv_bits=8"))
    assert not group.fits(prefilled("snapkv:budget=200,kv_bits=4"))
    assert not group.fits(prefilled("snapkv:budget=200"))


def test_concurrent_quantized_requests_decode_together(tiny, tokenizer):
    import threading

    prompts = [_prompt(tokenizer, 110), _prompt(tokenizer, 90), _prompt(tokenizer, 70)]
    results: dict[int, object] = {}

    def ask(i):
        results[i] = tiny.generate(prompts[i], max_new_tokens=10, min_new_tokens=10, compression="snapkv:budget=150,kv_bits=4")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i].usage.completion_tokens for i in range(3)] == [10, 10, 10]


def test_drafts_over_quantized_entries(tiny, tokenizer):
    prompt = _prompt(tokenizer)
    result = tiny.generate(prompt, max_new_tokens=24, compression="snapkv:budget=200,kv_bits=8", prompt_lookup_num_tokens=4)
    assert result.usage.completion_tokens > 0
    assert result.stats.drafts is not None and result.stats.drafts.get("off") is None


def test_less_keeps_its_state_at_full_width_over_quantized_entries(tiny, tokenizer):
    from snapkv_rag.compression import LESS, SnapKV
    from snapkv_rag.compression.less.kernels import LessKernels, model_signature

    kernels = LessKernels.initial(model_signature(tiny.model), rank=4, hidden=8, seed=0, scale=1.0)
    plain = LESS(base=SnapKV(window_size=16, max_capacity_prompt=200), kernels=kernels)
    narrow = LESS(base=SnapKV(window_size=16, max_capacity_prompt=200, kv_bits=8), kernels=kernels)
    prompt = _prompt(tokenizer)
    results = [tiny.generate(prompt, max_new_tokens=6, ignore_eos=True, compression=p, prefix_cache=False) for p in (plain, narrow)]
    assert results[1].stats.low_rank_state_bytes == results[0].stats.low_rank_state_bytes > 0
    assert results[1].stats.prompt_kv_bytes_kept < results[0].stats.prompt_kv_bytes_kept
    scores = [tiny.score(prompt, results[0].token_ids, compression=p) for p in (plain, narrow)]
    kl = torch.nn.functional.kl_div(scores[1].log_softmax(-1), scores[0].log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert float(kl.max()) < 1e-3


def test_rows_leave_a_batch_without_being_quantized_again():
    keys, values = dense(batch=3, n=300)
    layer = QuantizedLayer.from_layer(_Dense(keys, values), 4, residual=40)
    before_keys, before_values = layer.keys, layer.values
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert torch.equal(layer.keys, before_keys[[0, 2]]) and torch.equal(layer.values, before_values[[0, 2]])
    assert layer.get_seq_length() == 300 and layer.batch_size == 2


def test_a_rolling_prefill_past_the_window_ends_in_quantized_entries(tiny, tokenizer):
    prompt = _prompt(tokenizer, 220)  # past the tiny model's 512 positions
    assert len(tokenizer(prompt)["input_ids"]) > 512
    rolled = "snapkv:budget=200,window=16,rolling=128"
    wide, narrow = (tiny.generate(prompt, max_new_tokens=4, compression=spec) for spec in (rolled, rolled + ",kv_bits=8"))
    assert narrow.stats.policy_stats["rolled_chunks"] == wide.stats.policy_stats["rolled_chunks"] > 1
    assert narrow.stats.kept_tokens_per_layer == wide.stats.kept_tokens_per_layer
    assert narrow.stats.prompt_kv_bytes_kept < wide.stats.prompt_kv_bytes_kept
