"""The LESS gap analysis (tiny model): its oracle state against the formulas and the full cache."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.cli import build_parser
from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.compression.less.kernels import LessKernels, model_signature
from snapkv_rag.compression.less.state import LowRankState
from snapkv_rag.less_training.distill import _kl, less_log_probs, record_window
from snapkv_rag.less_training.gap import EXACT, LEARNED, MEAN, VARIANTS, OracleState, gap_analysis, variant_kl, write_gap_report


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=7)


@pytest.fixture(scope="module")
def kernels(engine):
    return LessKernels.initial(model_signature(engine.model), rank=4, hidden=8, seed=0, scale=1.0)


@pytest.fixture(scope="module")
def policy(kernels):
    return LESS(base=SnapKV(window_size=4, kernel_size=3, max_capacity_prompt=16), kernels=kernels)


@pytest.fixture(scope="module")
def sample(engine, policy):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, engine.model.config.vocab_size, (56,), generator=generator).tolist()
    return record_window(engine, {16: policy.base}, tokens, 48, 8)


def test_oracle_estimates_follow_the_formulas(kernels):
    torch.manual_seed(0)
    signature = kernels.header["model"]
    hq, hkv, d = signature["num_query_heads"], signature["num_kv_heads"], signature["head_dim"]
    keys, values = torch.randn(2, hkv, 20, d), torch.randn(2, hkv, 20, d)
    evicted = torch.rand(2, hkv, 20) < 0.6
    query = torch.randn(2, hq, 3, d)
    reference = LowRankState(kernels, torch.device("cpu"))
    reference.fold(0, keys, values, evicted)
    learned = reference.estimate(0, query, 0.125)

    def estimate(mode):
        state = OracleState(kernels, torch.device("cpu"), {0: mode}, (LEARNED, LEARNED))
        state.fold(0, keys, values, evicted)
        return state.estimate(0, query, 0.125)

    g = hq // hkv
    scores = torch.einsum("bhgtd,bhnd->bhgtn", query.reshape(2, hkv, g, 3, d), keys) * 0.125
    scores = scores.masked_fill(~evicted[:, :, None, None], float("-inf"))
    exact_mass, exact_value = scores.logsumexp(-1), scores.softmax(-1) @ values[:, :, None]
    mean_value = (values * evicted[..., None]).sum(2) / evicted.sum(2)[..., None]

    mass, value = estimate((EXACT, LEARNED))
    torch.testing.assert_close(mass, exact_mass)
    torch.testing.assert_close(value, learned[1])
    mass, value = estimate((LEARNED, EXACT))
    torch.testing.assert_close(mass, learned[0])
    torch.testing.assert_close(value, exact_value)
    _, value = estimate((LEARNED, MEAN))
    torch.testing.assert_close(value, mean_value[:, :, None, None].expand_as(value))


def test_variants_bracket_the_base_policy_and_the_full_cache(engine, kernels, policy, sample):
    kl = {name: variant_kl(engine, policy, kernels, sample, 16, {}, mode) for name, mode in VARIANTS.items()}
    assert kl["base"] > 1e-3
    assert abs(kl["exact"]) < 0.05 * kl["base"]  # exact mass and value over the evicted entries is the full cache (up to the fp16 recording)
    with torch.no_grad():
        plain = float(_kl(sample["log_probs"], less_log_probs(engine, policy, kernels, sample, 16)))
    assert kl["less"] == pytest.approx(plain, rel=1e-5)  # learned/learned is LESS itself
    assert len(set(kl.values())) == len(kl)  # every variant changes something


def test_gap_analysis_report_and_cli(engine, kernels, policy, tmp_path, monkeypatch):
    from snapkv_rag.less_training import cli as less_cli

    rows = gap_analysis(engine, policy, [48], per_length=2, continuation_tokens=8, progress=False)
    assert [r["length"] for r in rows] == [48, 48]
    layers = engine.model.config.num_hidden_layers
    assert all(len(r["exact_value_at_layer"]) == layers for r in rows)
    report = write_gap_report(rows, tmp_path / "gap", spec=policy.spec())
    (summary,) = report["summary"]
    assert summary["gap_closed"]["base"] == 0 and summary["gap_closed"]["exact"] > 0.99
    assert len(summary["layer_gain"]) == layers
    assert {"gap.json", "gap.md", "gap_layers.png"} <= set(report["files"])
    assert "| 48 x2 |" in (tmp_path / "gap" / "gap.md").read_text()

    path = kernels.save(tmp_path / "k.safetensors")
    monkeypatch.setattr(less_cli, "load_engine", lambda args: engine)
    spec = f"less:base=snapkv,window=4,kernel=3,budget=16,kernels={path}"
    args = build_parser().parse_args(
        [
            "less",
            "gap",
            "--compression",
            spec,
            "--lengths",
            "40,48",
            "--prompts-per-length",
            "1",
            "--continuation-tokens",
            "8",
            "--no-per-layer",
            "--out",
            str(tmp_path / "cli"),
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    saved = json.loads((tmp_path / "cli" / "gap.json").read_text())
    assert [s["length"] for s in saved["summary"]] == ["40", "48", "all"]
    assert "exact_value_at_layer" not in saved["rows"][0]
    bad = build_parser().parse_args(["less", "gap", "--compression", "snapkv:budget=256"])
    with pytest.raises(ValueError, match="LESS policy"):
        bad.func(bad)
