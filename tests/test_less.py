"""LESS in the engine: spec strings, exact equivalences, the formula, memory, kernels files."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression import H2O, LESS, SnapKV, parse_compression
from snapkv_rag.compression.less.kernels import LessKernels, find_shipped, load_kernels, model_signature
from snapkv_rag.compression.less.state import LowRankState, evicted_mask
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.errors import InvalidCompressionError
from snapkv_rag.reuse.prefix_cache import PrefixCache

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is Paris. " * 6
BASE = SnapKV(window_size=4, max_capacity_prompt=16, kernel_size=3)


@pytest.fixture(scope="module")
def less_engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=3)


def signature(engine):
    return model_signature(engine.model)


FEATURES = ["mlp", "exp", "exp+mass"]  # exp+mass: exponential features plus 2 mass-only features


def make_kernels(sig, features: str, **options) -> LessKernels:
    kind, _, mass = features.partition("+")
    return LessKernels.initial(sig, features=kind, mass_rank=2 if mass else 0, **options)


def active_kernels(engine, seed: int = 0) -> LessKernels:
    """Random kernels whose state matters (scale 1): the outputs move away from the base policy's."""
    return LessKernels.initial(signature(engine), rank=4, hidden=8, seed=seed, scale=1.0)


# ------------------------------------------------------------------------------- specs
def test_spec_strings_wrap_the_base_policy():
    policy = parse_compression("less:base=snapkv,budget=256,window=16")
    assert isinstance(policy, LESS) and policy.base == SnapKV(window_size=16, max_capacity_prompt=256)
    assert policy.max_capacity_prompt == 256 and policy.kernels is None
    assert parse_compression(policy.spec()) == policy
    h2o = parse_compression("less:base=h2o,budget=128,kernels=/x/k.safetensors")
    assert h2o.base == H2O(max_capacity_prompt=128) and h2o.kernels == "/x/k.safetensors"
    assert h2o.with_budget(64).base.max_capacity_prompt == 64
    assert policy.settings()["base"]["max_capacity_prompt"] == 256
    for bad in ("less:base=full,budget=8", "less:base=less", "less:base=snapkv,budget=8,bogus=1"):
        with pytest.raises(InvalidCompressionError):
            parse_compression(bad)


# ------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("features", FEATURES)
def test_zero_kernels_give_the_base_policy_exactly(less_engine, features):
    kind, _, mass = features.partition("+")
    zero = LESS(base=BASE, kernels=LessKernels.zeros(signature(less_engine), features=kind, mass_rank=2 if mass else 0))
    base = less_engine.generate(PROMPT, max_new_tokens=8, compression=BASE, ignore_eos=True)
    less = less_engine.generate(PROMPT, max_new_tokens=8, compression=zero, ignore_eos=True)
    assert less.token_ids == base.token_ids
    assert less.stats.kept_tokens_per_layer == base.stats.kept_tokens_per_layer == [16, 16]
    cont = base.token_ids
    assert torch.equal(less_engine.score(PROMPT, cont, compression=zero), less_engine.score(PROMPT, cont, compression=BASE))


def test_nothing_evicted_gives_the_base_policy_exactly(less_engine):
    """A prompt within the budget evicts nothing: active kernels then change nothing."""
    roomy = SnapKV(window_size=4, max_capacity_prompt=500, kernel_size=3)
    less = LESS(base=roomy, kernels=active_kernels(less_engine))
    cont = less_engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    assert torch.equal(less_engine.score(PROMPT, cont, compression=less), less_engine.score(PROMPT, cont, compression=roomy))


def test_active_kernels_change_the_output(less_engine):
    less = LESS(base=BASE, kernels=active_kernels(less_engine))
    cont = less_engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    diff = (less_engine.score(PROMPT, cont, compression=less) - less_engine.score(PROMPT, cont, compression=BASE)).abs()
    assert diff[0].max() == 0  # the prefill's own last position attends to the full prompt
    assert diff[1:].max() > 1e-3


def test_batched_padded_rows_match_single_runs(less_engine):
    less = LESS(base=BASE, kernels=active_kernels(less_engine, seed=1))
    prompts = [PROMPT, "Numbers like 1234 and 5678 appear in passkeys. Hello world, hello engine! " * 6]
    batch = less_engine.generate_batch(prompts, max_new_tokens=6, ignore_eos=True, compression=less, prefix_cache=False)
    assert batch[0].stats.batch_size == 2
    singles = [less_engine.generate(p, max_new_tokens=6, ignore_eos=True, compression=less, prefix_cache=False) for p in prompts]
    assert [r.token_ids for r in batch] == [r.token_ids for r in singles]


def test_prefix_cache_reuse_folds_the_same_state(less_engine):
    """The prefix cache stores uncompressed K/V; LESS folds at compression time, so reuse is exact."""
    less = LESS(base=BASE, kernels=active_kernels(less_engine, seed=2))
    row = less_engine.tokenizer(PROMPT)["input_ids"]
    cont = [5, 6, 7, 8]
    cache = PrefixCache(max_bytes=1 << 26, admission="always")
    cold = DecodeRun(less_engine.model, [row], GenerationParams(max_new_tokens=4), less, less_engine._pad_id, prefix_cache=cache)
    first = cold.teacher_force(cont)
    warm = DecodeRun(less_engine.model, [row + [9]], GenerationParams(max_new_tokens=4), less, less_engine._pad_id, prefix_cache=cache)
    second = warm.teacher_force(cont)
    assert warm.reused_tokens[0] > 0
    plain = DecodeRun(less_engine.model, [row + [9]], GenerationParams(max_new_tokens=4), less, less_engine._pad_id).teacher_force(cont)
    torch.testing.assert_close(second, plain, rtol=1e-5, atol=1e-5)
    assert first.shape == second.shape


# --------------------------------------------------------------------- the formula
def reference_attention(q, k_kept, v_kept, visible, k_evicted, v_evicted, phi, psi, scaling, mass_phi=None, mass_psi=None):
    """less.md written out per query: the slow loop the fast path must match. With mass-only
    features the evicted part's weight is ``mass_phi(q) . sum mass_psi(k)`` and its value still
    ``phi(q) H / phi(q) z``."""
    s = [float(q @ k_kept[i]) * scaling for i in range(len(k_kept)) if visible[i]]
    vs = [v_kept[i] for i in range(len(k_kept)) if visible[i]]
    lse_s = math.log(sum(math.exp(x) for x in s))
    fq = phi(q)
    H = sum((torch.outer(psi(k), v) for k, v in zip(k_evicted, v_evicted)), torch.zeros(fq.numel(), q.numel()))
    z = sum((psi(k) for k in k_evicted), torch.zeros(fq.numel()))
    lr = float(fq @ z) if mass_phi is None else float(mass_phi(q) @ sum(mass_psi(k) for k in k_evicted))
    lse = float(torch.logaddexp(torch.tensor(math.log(max(lr, 1e-30))), torch.tensor(lse_s)))
    softmax_v = sum(math.exp(x - lse_s) * v for x, v in zip(s, vs))
    return math.exp(lse_s - lse) * softmax_v + lr * math.exp(-lse) * (fq @ H) / float(fq @ z)


@pytest.mark.parametrize("features", FEATURES)
def test_state_attention_matches_the_formula(features):
    torch.manual_seed(0)
    sig = {"num_layers": 1, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    kernels = make_kernels(sig, features, rank=3, hidden=5, seed=4, scale=0.5)
    layer = kernels.layers[0]
    b, hq, hkv, d, n, t = 2, 4, 2, 8, 12, 3
    keys, values = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    kept = torch.stack([torch.randperm(n - t)[:5].sort().values for _ in range(b * hkv)]).reshape(b, hkv, 5)
    kept = torch.cat([kept, torch.arange(n - t, n).expand(b, hkv, t)], dim=-1)  # plus the t new entries
    padding = torch.ones(b, n, dtype=torch.long)
    padding[1, :2] = 0  # row 1 is left-padded: its first two entries are neither kept nor folded
    state = LowRankState(kernels, torch.device("cpu"))
    state.fold_selection(0, keys, values, kept, padding)
    k_kept = keys.gather(2, kept[..., None].expand(-1, -1, -1, d))
    v_kept = values.gather(2, kept[..., None].expand(-1, -1, -1, d))
    kept_padding = padding.gather(1, kept[:, 0])  # same slots per head for padding (first two)
    kept_padding[1] = padding[1].gather(0, kept[1, 0])
    m = kept.shape[-1]
    causal = torch.arange(m)[None, :] <= (m - t + torch.arange(t))[:, None]
    mask = (causal[None] & kept_padding[:, None, :].bool())[:, None]  # [b, 1, t, m] as SDPA gets it
    q = torch.randn(b, hq, t, d)
    scaling = d**-0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k_kept.repeat_interleave(2, dim=1), v_kept.repeat_interleave(2, dim=1), attn_mask=mask, scale=scaling
    ).transpose(1, 2)
    fast = state.attend(0, q, k_kept, mask, sdpa, scaling)
    assert not torch.allclose(fast, sdpa, atol=1e-3)  # the state contributes
    evicted_total = 0
    for row in range(b):
        for h in range(hq):
            g = h // 2
            evicted = [j for j in range(n) if j not in kept[row, g].tolist() and padding[row, j]]
            evicted_total += len(evicted) if h % 2 == 0 else 0

            def phi(x, h=h):
                return layer.query_features(x[None, None, None].expand(1, hq, 1, d))[0, h, 0]

            def psi(x, g=g):
                return layer.key_features(x[None, None, None].expand(1, hkv, 1, d))[0, g, 0]

            mass = {}
            if layer.mass_rank:
                mass["mass_phi"] = lambda x, h=h: layer._logits(layer.phi, x[None, None, None].expand(1, hq, 1, d), "wm", "bm").exp()[0, h, 0]
                mass["mass_psi"] = lambda x, g=g: layer._logits(layer.psi, x[None, None, None].expand(1, hkv, 1, d), "wm", "bm").exp()[0, g, 0]
            for i in range(t):
                want = reference_attention(
                    q[row, h, i], k_kept[row, g], v_kept[row, g], mask[row, 0, i], keys[row, g, evicted], values[row, g, evicted], phi, psi, scaling, **mass
                )
                torch.testing.assert_close(fast[row, i, h], want, rtol=1e-4, atol=1e-5)
    assert state.folded_entries == evicted_total


@pytest.mark.parametrize("features", FEATURES)
def test_one_decode_query_without_a_mask_sees_every_cached_key(features):
    """attend() skips building the mask for one unmasked query: same result as an all-visible mask."""
    torch.manual_seed(1)
    sig = {"num_layers": 1, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    state = LowRankState(make_kernels(sig, features, rank=3, hidden=5, seed=4, scale=0.5), torch.device("cpu"))
    b, n, d = 2, 12, 8
    keys, values = torch.randn(b, 2, n, d), torch.randn(b, 2, n, d)
    kept = torch.stack([torch.randperm(n)[:5].sort().values for _ in range(b * 2)]).reshape(b, 2, 5)
    state.fold_selection(0, keys, values, kept, None)
    k_kept = keys.gather(2, kept[..., None].expand(-1, -1, -1, d))
    v_kept = values.gather(2, kept[..., None].expand(-1, -1, -1, d))
    q = torch.randn(b, 4, 1, d)
    base = torch.nn.functional.scaled_dot_product_attention(q, k_kept.repeat_interleave(2, dim=1), v_kept.repeat_interleave(2, dim=1)).transpose(1, 2)
    unmasked = state.attend(0, q, k_kept, None, base, d**-0.5)
    masked = state.attend(0, q, k_kept, torch.ones(b, 1, 1, 5, dtype=torch.bool), base, d**-0.5)
    assert not torch.allclose(unmasked, base, atol=1e-3)
    torch.testing.assert_close(unmasked, masked)


# ---------------------------------------------------------------------------- memory
def test_stats_report_the_real_state_and_cache(less_engine):
    kernels = active_kernels(less_engine)
    less = LESS(base=BASE, kernels=kernels)
    row = less_engine.tokenizer(PROMPT)["input_ids"]
    run = DecodeRun(less_engine.model, [row], GenerationParams(max_new_tokens=3), less, less_engine._pad_id)
    list(run.steps())
    tensors = [t for H, z in run.policy_state.low_rank.layers.values() for t in (H, z)]
    real = sum(t.numel() * t.element_size() for t in tensors)
    assert real == run.policy_stats()["low_rank_state_bytes"] == 2 * 2 * (4 * 16 + 4) * 4  # layers x KV heads x R(d+1) fp32
    result = less_engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True, compression=less)
    info = less_engine.info()
    assert result.stats.low_rank_state_bytes == real
    assert result.stats.low_rank_state_tokens == pytest.approx(real / info.kv_bytes_per_token)
    assert result.stats.prompt_kv_bytes_kept == 16 * info.kv_bytes_per_token  # evicted K/V really left the cache
    assert result.stats.low_rank_ms_per_step is not None and result.stats.low_rank_ms_per_step > 0
    base = less_engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True, compression=BASE)
    assert base.stats.low_rank_state_bytes == 0 and base.stats.low_rank_ms_per_step is None
    assert result.stats.compression["method"] == "less" and result.stats.compression["kernels"] == "in-memory"


def test_mass_only_features_cost_one_number_each_and_count_in_baseline_plus(less_engine):
    from snapkv_rag.harness.heldout import state_tokens

    less = LESS(base=BASE, kernels=make_kernels(signature(less_engine), "exp+mass", rank=4, seed=0, scale=1.0))
    result = less_engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True, compression=less)
    real = 2 * 2 * (4 * 17 + 2) * 4  # layers x KV heads x (R(d+1) + Rm) fp32
    assert result.stats.low_rank_state_bytes == real
    assert state_tokens(less_engine, less) == math.ceil(real / less_engine.info().kv_bytes_per_token)
    with pytest.raises(InvalidCompressionError, match="mass-only features need exponential"):
        LessKernels.zeros(signature(less_engine), features="mlp", mass_rank=2)


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("features", FEATURES)
def test_kernel_files_round_trip_and_refuse_other_models(less_engine, tokenizer, tmp_path, features):
    kernels = make_kernels(signature(less_engine), features, rank=4, hidden=8, seed=0, scale=1.0)
    kernels.header.update(base="snapkv", budget=16)
    path = kernels.save(tmp_path / "k.safetensors")
    loaded = load_kernels(path)
    assert loaded.header["budget"] == 16 and loaded.rank == 4
    kind = features.partition("+")[0]
    assert loaded.header["features"] == kind and all(layer.kind == kind for layer in loaded.layers.values())
    assert all(layer.mass_rank == (2 if "mass" in features else 0) for layer in loaded.layers.values())
    for name, tensor in kernels.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor)
    by_path = LESS(base=BASE, kernels=str(path))
    in_memory = LESS(base=BASE, kernels=loaded)
    assert (
        less_engine.generate(PROMPT, max_new_tokens=5, compression=by_path).token_ids
        == less_engine.generate(PROMPT, max_new_tokens=5, compression=in_memory).token_ids
    )
    other_weights = tiny_engine("llama", tokenizer, seed=4)  # same shape, other weights
    with pytest.raises(InvalidCompressionError, match="other weights"):
        other_weights.generate(PROMPT, max_new_tokens=2, compression=by_path)
    other_shape = tiny_engine("qwen3", tokenizer)
    with pytest.raises(InvalidCompressionError, match="do not fit"):
        other_shape.generate(PROMPT, max_new_tokens=2, compression=by_path)
    unknown = LessKernels(kernels.layers, {**kernels.header, "features": "relu"}).save(tmp_path / "u.safetensors")
    with pytest.raises(InvalidCompressionError, match="feature kind 'relu'"):
        load_kernels(unknown)


def test_no_shipped_kernels_for_a_tiny_model_names_what_exists(less_engine):
    with pytest.raises(InvalidCompressionError, match="no shipped kernels.*shipped:"):
        find_shipped(signature(less_engine), "snapkv", 16)
    with pytest.raises(InvalidCompressionError, match="no shipped kernels"):
        less_engine.generate(PROMPT, max_new_tokens=2, compression="less:base=snapkv,budget=16,window=4")


@pytest.mark.parametrize("features", FEATURES)
def test_folding_in_parts_equals_folding_at_once(features):
    """Decode-time eviction folds entries one by one; the state is the same as one fold."""
    sig = {"num_layers": 1, "num_query_heads": 2, "num_kv_heads": 1, "head_dim": 4}
    kernels = make_kernels(sig, features, rank=2, hidden=3, seed=1, scale=1.0)
    keys, values = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    whole, parts = LowRankState(kernels, torch.device("cpu")), LowRankState(kernels, torch.device("cpu"))
    whole.fold(0, keys, values, torch.ones(1, 1, 6, dtype=torch.bool))
    for j in range(6):
        parts.fold(0, keys[:, :, j : j + 1], values[:, :, j : j + 1], torch.ones(1, 1, 1, dtype=torch.bool))
    assert len(whole.layers[0]) == len(parts.layers[0]) == (3 if "mass" in features else 2)
    for a, b in zip(whole.layers[0], parts.layers[0]):
        torch.testing.assert_close(a, b)
    assert whole.folded_entries == parts.folded_entries == 6


@pytest.mark.integration
def test_shipped_kernels_run_on_the_embedded_model(embedded_engine):
    """`less:base=snapkv,budget=256` works right after setup: the shipped kernels match the model."""
    text = " ".join(f"Line {i}: the archive lists item {i * 7} under shelf {i % 13}." for i in range(60))
    base = embedded_engine.generate(text, max_new_tokens=4, ignore_eos=True, compression="snapkv:budget=256")
    less = embedded_engine.generate(text, max_new_tokens=4, ignore_eos=True, compression="less:base=snapkv,budget=256")
    info = embedded_engine.info()
    assert base.usage.prompt_tokens > 256
    assert less.stats.kept_tokens_per_layer == base.stats.kept_tokens_per_layer == [256] * info.num_layers
    assert less.stats.low_rank_state_bytes == info.num_layers * info.num_kv_heads * (8 * (info.head_dim + 1) + 32) * 4  # rank 8 plus 32 mass-only features
    assert less.stats.compression["kernels"] == "shipped"
    with pytest.raises(InvalidCompressionError, match="no shipped kernels for base=snapkv budget=300"):
        embedded_engine.generate(text, max_new_tokens=1, compression="less:base=snapkv,budget=300")


def test_less_through_the_cli_options_and_the_llama_index_connector(less_engine):
    """A spec string works where a policy is taken: CLI generation options and the connector."""
    from snapkv_rag.cli import _gen_kwargs, build_parser

    args = build_parser().parse_args(["generate", "hi", "--compression", "less:base=snapkv,budget=256,window=16"])
    policy = _gen_kwargs(args)["compression"]
    assert isinstance(policy, LESS) and policy.base == SnapKV(window_size=16, max_capacity_prompt=256)
    connector = pytest.importorskip("llama_index.llms.snapkv")
    llm = connector.SnapKVLLM(less_engine, compression=LESS(base=BASE, kernels=active_kernels(less_engine)), max_new_tokens=4)
    raw = llm.complete(PROMPT).raw
    assert raw["stats"]["low_rank_state_bytes"] > 0 and raw["stats"]["compression"]["method"] == "less"


# ------------------------------------------------------------------- decode-time cuts
def test_less_folds_what_decode_time_cuts_evict(less_engine):
    import dataclasses

    kernels = active_kernels(less_engine)
    cutting = dataclasses.replace(BASE, decode_budget=12, decode_interval=4)
    prompt_only = less_engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, compression=LESS(base=BASE, kernels=kernels))
    decoding = less_engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, compression=LESS(base=cutting, kernels=kernels))
    folded_at_prefill = prompt_only.stats.policy_stats["low_rank_folded_entries"]
    stats = decoding.stats.policy_stats
    assert stats["decode_compactions"] >= 4 and stats["decode_evicted_entries"] > 0
    # every entry a decode cut evicts (row x layer x KV head) is folded into the state too
    assert stats["low_rank_folded_entries"] == folded_at_prefill + stats["decode_evicted_entries"]
    assert stats["decode_cache_entries_max"] <= max(16, 12) + 4  # max(kept prompt, decode_budget) + decode_interval
    # the state changes what the model says: LESS with cuts differs from the base with the same cuts
    sparse = less_engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, compression=cutting)
    run_less = DecodeRun(
        less_engine.model,
        [less_engine.tokenizer(PROMPT)["input_ids"]],
        GenerationParams(max_new_tokens=20),
        LESS(base=cutting, kernels=kernels),
        less_engine._pad_id,
    )
    run_base = DecodeRun(less_engine.model, [less_engine.tokenizer(PROMPT)["input_ids"]], GenerationParams(max_new_tokens=20), cutting, less_engine._pad_id)
    cont = sparse.token_ids
    assert not torch.allclose(run_less.teacher_force(cont)[-1], run_base.teacher_force(cont)[-1], atol=1e-4)


# ------------------------------------------------------------------------- head checks
def test_probe_in_spec_strings_and_bad_values():
    policy = parse_compression("less:base=snapkv,budget=256,probe=32")
    assert policy.probe == 32 and parse_compression(policy.spec()) == policy and policy.settings()["probe"] == 32
    assert parse_compression("less:base=snapkv,budget=256").probe == 0
    for bad in ("less:base=snapkv,budget=256,probe=-1", "less:base=snapkv,budget=256,probe=x"):
        with pytest.raises(InvalidCompressionError, match="probe"):
            parse_compression(bad)


class _Estimates:
    """Stands in for one layer's kernels: returns given (log mass, value) estimates."""

    def __init__(self, estimate):
        self.estimate = estimate


HKV, GROUP, N, D, EVICTED = 2, 2, 16, 8, 10  # the first EVICTED of N positions are evicted


def _inputs():
    torch.manual_seed(0)
    return torch.randn(1, HKV * GROUP, N, D), torch.randn(1, HKV, N, D), torch.randn(1, HKV, N, D)


def _exact_evicted(q):
    """The evicted entries' exact (logsumexp, softmax-weighted value) for queries ``q [1, hq, t, d]``."""
    _, keys, values = _inputs()
    t = q.shape[2]
    s = (q.reshape(1, HKV, GROUP * t, D) @ keys[:, :, :EVICTED].transpose(-1, -2)).view(1, HKV, GROUP, t, -1) * D**-0.5
    return s.logsumexp(-1), s.softmax(-1) @ values[:, :, None, :EVICTED]


def _wrong(q):
    """Claims a huge mass with a far-off value."""
    shape = (1, HKV, GROUP, q.shape[2])
    return torch.full(shape, 50.0), torch.full(shape + (D,), 100.0)


def _check(estimate, probe=4) -> LowRankState:
    query, keys, values = _inputs()
    state = LowRankState(LessKernels({}), torch.device("cpu"), probe)
    state.kernels = LessKernels({0: _Estimates(lambda q, _state: estimate(q))})
    state.layers[0] = (torch.zeros(1),)
    evicted = evicted_mask(keys, torch.arange(EVICTED, N).expand(1, HKV, N - EVICTED), None)
    state.check_heads(0, query, keys, values, evicted, None, None)
    return state


def test_a_state_that_recovers_the_evicted_attention_stays_on():
    state = _check(_exact_evicted)
    assert state.heads_checked == HKV and state.heads_off == 0 and state.has_state(0)


def test_a_state_that_makes_the_probe_worse_is_switched_off_and_estimates_no_mass():
    state = _check(_wrong)
    assert state.heads_off == HKV and not state.has_state(0)  # every head off: the layer's state is dropped

    def wrong_in_head_1(q):
        log_mass, value = _exact_evicted(q)
        bad_mass, bad_value = _wrong(q)
        log_mass[:, 1], value[:, 1] = bad_mass[:, 1], bad_value[:, 1]
        return log_mass, value

    state = _check(wrong_in_head_1)
    assert state.heads_on[0].tolist() == [[True, False]] and state.heads_off == 1
    log_mass, _ = state.estimate(0, _inputs()[0][:, :, -1:], D**-0.5)
    assert torch.isfinite(log_mass[:, 0]).all() and torch.isneginf(log_mass[:, 1]).all()


def test_probe_only_uses_queries_after_the_last_evicted_position():
    seen = []

    def record(q):
        seen.append(q.shape[2])
        return _exact_evicted(q)

    _check(record, probe=32)
    assert seen == [N - EVICTED]  # the queries at positions 10-15, not 32


def test_probe_switches_off_a_state_that_hurts_end_to_end(less_engine, monkeypatch):
    """Kernels whose estimate claims a huge mass of a far-off value make every probe worse: with
    the check LESS gives the base policy's logits exactly, without it they differ. (Random
    kernels are no test here: on a random tiny model attention is nearly flat, and their
    mean-of-evicted-values state helps.)"""
    from snapkv_rag.compression.less.kernels import LayerKernels

    real_estimate = LayerKernels.estimate

    def wrong(self, queries, state):
        log_mass, value = real_estimate(self, queries, state)
        return log_mass + 50.0, torch.full_like(value, 100.0)

    monkeypatch.setattr(LayerKernels, "estimate", wrong)
    kernels = active_kernels(less_engine)
    cont = less_engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    base = less_engine.score(PROMPT, cont, compression=BASE)
    unchecked = less_engine.score(PROMPT, cont, compression=LESS(base=BASE, kernels=kernels))
    checked_policy = LESS(base=BASE, kernels=kernels, probe=4)
    assert (unchecked - base).abs().max() > 1e-3
    assert torch.equal(less_engine.score(PROMPT, cont, compression=checked_policy), base)
    stats = less_engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True, compression=checked_policy).stats.policy_stats
    assert stats["low_rank_heads_off"] == stats["low_rank_heads_checked"] > 0 and stats["low_rank_state_bytes"] == 0


def test_less_train_writes_to_the_shipped_kernels_by_default():
    from snapkv_rag.compression.less.kernels import SHIPPED_DIR
    from snapkv_rag.less_training.cli import DEFAULT_OUT

    assert DEFAULT_OUT.resolve() == SHIPPED_DIR.resolve() and any(SHIPPED_DIR.glob("*.safetensors"))
