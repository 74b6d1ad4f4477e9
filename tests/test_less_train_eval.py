"""LESS training (tiny model, tiny run) and the held-out fidelity rows."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.cli import build_parser
from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.compression.less.kernels import LessKernels, load_kernels, model_signature
from snapkv_rag.harness.heldout import expand_methods, run_heldout_fidelity, state_tokens
from snapkv_rag.harness.report import gap_closed, summarize_fidelity, write_report
from snapkv_rag.harness.runner import Method, method_grid
from snapkv_rag.less_training.corpus import corpus_text, split_of
from snapkv_rag.less_training.train import TrainConfig, train

BASE_SPEC = "snapkv:window=4,kernel=3"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=5)


def small_config(**overrides) -> TrainConfig:
    settings = dict(
        base=BASE_SPEC,
        budgets=[16],
        prompt_tokens=48,
        continuation_tokens=8,
        sequences=6,
        val_sequences=2,
        epochs=6,
        batch=2,
        hidden=8,
        rank=4,
        shard=4,
        distill_epochs=0,
    )
    return TrainConfig(**{**settings, **overrides})


def test_corpus_splits_are_disjoint_and_nonempty():
    from pydoc_data.topics import topics

    held = {t for t in topics if split_of(t) == "heldout"}
    assert held and len(held) < len(topics) / 2
    train_text, held_text = corpus_text("train"), corpus_text("heldout")
    for topic in held:
        assert topics[topic].strip() in held_text and topics[topic].strip() not in train_text


@pytest.mark.parametrize("features", ["exp", "mlp", "exp+mass"])
def test_training_is_resumable_deterministic_and_lowers_the_loss(engine, tmp_path, features):
    features, _, mass = features.partition("+")
    config = small_config(features=features, mass_rank=3 if mass else 0)
    (path,) = train(engine, config, tmp_path / "work", tmp_path / "out", model_tag="tiny", progress=False)
    kernels = load_kernels(path)
    header = kernels.header
    assert header["base"] == "snapkv" and header["budget"] == 16 and header["rank"] == 4 and header["features"] == features
    assert header.get("mass_rank", 0) == (3 if mass else 0) and all(layer.mass_rank == header.get("mass_rank", 0) for layer in kernels.layers.values())
    assert header["training"]["lr"] == (1e-2 if features == "exp" else 3e-3)
    data = header["data"]
    assert data["text"] == "mixed" and data["pydoc"]["license"].startswith("PSF") and data["sequences"] == 6
    assert data["packages"] and all(p["license"] and p["version"] for p in data["packages"])  # each package README's licence is on record
    assert header["model"] == model_signature(engine.model) and header["training"]["seed"] == 0
    assert header["training"]["capture_seconds"] > 0 and header["training"]["train_seconds"] > 0
    for stats in header["validation"].values():
        assert stats["val_mse_less"] < stats["val_mse_base"]  # the state helps on held-out windows
    # Resume: drop one layer's checkpoint; only it is retrained, to the same tensors.
    (tmp_path / "work" / "kernels-b16" / "layer001.safetensors").unlink()
    (again,) = train(engine, config, tmp_path / "work", tmp_path / "out2", model_tag="tiny", progress=False)
    for name, tensor in kernels.tensors().items():
        assert torch.equal(load_kernels(again).tensors()[name], tensor), name
    with pytest.raises(ValueError, match="other settings"):
        train(
            engine,
            small_config(epochs=7, features=features, mass_rank=3 if mass else 0),
            tmp_path / "work",
            tmp_path / "out3",
            model_tag="tiny",
            progress=False,
        )
    # The trained file drives the engine.
    policy = LESS(base=SnapKV(window_size=4, kernel_size=3, max_capacity_prompt=16), kernels=str(path))
    result = engine.generate("The quick brown fox jumps over the lazy dog. " * 8, max_new_tokens=3, compression=policy)
    assert result.stats.low_rank_state_bytes > 0


def test_overlapping_windows_keep_every_length_out_of_the_validation_tail():
    from snapkv_rag.less_training.corpus import overlapping_windows

    tokens = list(range(1000))
    for length in (50, 100):
        train_windows, val = overlapping_windows(tokens, length, 8, 2, tail=2 * 100)
        assert len(train_windows) == 8 and len(val) == 2 and all(len(w) == length for w in train_windows + val)
        assert max(max(w) for w in train_windows) < 800 and [w[0] for w in val] == [800, 800 + length]
    with pytest.raises(ValueError, match="cannot hold"):
        overlapping_windows(tokens, 150, 8, 2, tail=200)


def test_training_on_several_prompt_lengths(engine, tmp_path):
    config = small_config(prompt_tokens=[40, 56], sequences=[6, 5], distill_epochs=1, distill_sequences=[3, 2])
    (path,) = train(engine, config, tmp_path / "work", tmp_path / "out", model_tag="tiny", progress=False)
    header = load_kernels(path).header
    assert header["data"]["sequences_per_prompt_length"] == {"40": 6, "56": 5} and header["data"]["sequences"] == 11
    assert header["training"]["prompt_tokens"] == [40, 56] and header["distill"]["windows"] == {"train": 5, "val": 4}
    for n, count in ((40, 6), (56, 5)):
        keys = torch.cat([torch.load(p, weights_only=True)["k"] for p in sorted((tmp_path / "work" / "capture" / f"p{n}" / "layer000").glob("shard*.pt"))])
        assert keys.shape[0] == count and keys.shape[-2] == n + 8
    for stats in header["validation"].values():
        assert stats["val_mse_less"] < stats["val_mse_base"]


def test_window_counts_per_prompt_length():
    assert TrainConfig(prompt_tokens=[2048, 4096], sequences=10).sequences == [10, 10]
    default = TrainConfig()
    assert default.prompt_tokens == [2048, 4096] and default.sequences == [40, 20] and default.distill_sequences == [120, 60]
    assert default.validation_tail == 4 * (4096 + 128)
    with pytest.raises(ValueError, match="one count per prompt length"):
        TrainConfig(prompt_tokens=[2048, 4096], sequences=[10, 10, 10]).check()
    with pytest.raises(ValueError, match="distinct positive"):
        TrainConfig(prompt_tokens=[2048, 2048]).check()
    with pytest.raises(ValueError, match="distinct positive"):
        TrainConfig(prompt_tokens=[]).check()
    assert default.features == "exp" and default.lr == 1e-2 and TrainConfig(features="mlp").lr == 3e-3
    assert default.mass_rank == 32 and TrainConfig(features="mlp").mass_rank == 0
    with pytest.raises(ValueError, match="features must be one of exp, mlp"):
        TrainConfig(features="relu").check()
    with pytest.raises(ValueError, match="mass_rank must be >= 0, and needs features='exp'"):
        TrainConfig(features="mlp", mass_rank=4).check()


def test_less_train_cli_parses():
    args = build_parser().parse_args(["less", "train", "--budgets", "64,256", "--base", "h2o", "--threads", "1", "--prompt-tokens", "2048,3072"])
    assert args.budgets == [64, 256] and args.base == "h2o" and args.func.__name__ == "cmd_less_train"
    assert args.prompt_tokens == [2048, 3072] and args.sequences is None
    assert args.features == "exp" and args.lr is None
    assert build_parser().parse_args(["less", "train", "--features", "mlp"]).features == "mlp"
    assert args.mass_rank is None and build_parser().parse_args(["less", "train", "--mass-rank", "0"]).mass_rank == 0


def test_heldout_fidelity_rows_and_gap_closed(engine, tmp_path):
    kernels = LessKernels.initial(model_signature(engine.model), rank=4, hidden=8, seed=0, scale=1.0)
    less = Method("less", LESS(base=SnapKV(window_size=4, kernel_size=3, max_capacity_prompt=16), kernels=kernels), 16)
    runs = expand_methods([less], engine)
    extra = state_tokens(engine, less.policy)
    assert extra == 3  # 2 layers x 2 heads x 4 x 17 fp32 = 1088 B; a token is 512 B
    assert [(m.label, role, m.policy.max_capacity_prompt) for m, role in runs] == [("snapkv", "base", 16), ("snapkv+", "baseline+", 19), ("less", "less", 16)]
    records = run_heldout_fidelity(engine, [less], [40], continuation_tokens=6, decode_tokens=3, progress=False)
    roles = [r["role"] for r in records]
    assert roles == ["full", "base", "baseline+", "less"]
    full, base, plus, low = records
    assert full["kl_mean"] == 0.0 and base["kl_mean"] > 0 and base["kept_tokens"] == 16 and plus["kept_tokens"] == 19
    assert low["low_rank_state_bytes"] == 1088 and low["low_rank_ms_per_step"] > 0 and base["low_rank_ms_per_step"] is None
    assert {r["heldout_start"] for r in records} == {0}
    table = summarize_fidelity(records)
    closed = gap_closed(low["kl_mean"], base["kl_mean"], 0.0)
    assert f"{closed:.3f}" in table and "baseline+" in table
    paths = write_report("fidelity", records, tmp_path, "snapkv-rag eval fidelity --text heldout")
    text = paths["markdown"].read_text()
    assert text.count("| 40 | snapkv | 16 | 1 | 3 |") == 1 and text.count("| all | snapkv | 16 | 1 | 3 |") == 1
    assert json.loads(paths["jsonl"].read_text().splitlines()[-1])["role"] == "less"
    # A second kernel file for the same base and budget gets its own rows, not a blend of both.
    other = dict(low, kl_mean=base["kl_mean"] / 2, settings=dict(low["settings"], kernels="other.safetensors"))
    two = summarize_fidelity(records + [other])
    assert "LESS kernels" in two and "LESS kernels" not in table
    rows = [line for line in two.splitlines() if line.startswith("| 40 |")]
    assert len(rows) == 2 and rows[0].endswith("| in-memory |") and rows[1].endswith("| other.safetensors |")
    assert f"| {closed:.3f} |" in rows[0] and "| 0.500 |" in rows[1]


def test_heldout_windows_are_consecutive_in_lengths_order(tokenizer):
    from snapkv_rag.harness.heldout import heldout_prompts, heldout_starts
    from snapkv_rag.less_training.corpus import corpus_tokens

    assert heldout_starts([20, 40], 5, 2) == [0, 25, 50, 95]
    assert heldout_starts([40], 5, 2) == [0, 45]  # so a length's prompts depend on the lengths before it
    tokens = corpus_tokens(tokenizer, "heldout")
    prompts = heldout_prompts(tokenizer, [20, 40], 5, 2)
    for start, (length, prompt, continuation) in zip(heldout_starts([20, 40], 5, 2), prompts):
        assert prompt == tokens[start : start + length] and continuation == tokens[start + length : start + length + 5]
    with pytest.raises(ValueError, match="too short"):
        heldout_prompts(tokenizer, [len(tokens)], 5, 1)


def test_gap_closed_definition():
    assert gap_closed(less=0.6, base=1.0, full=0.0) == pytest.approx(0.4)
    assert gap_closed(less=12.0, base=14.0, full=10.0) == pytest.approx(0.5)


def test_method_grid_takes_less_specs():
    methods = method_grid(["less:base=snapkv"], [64, 256])
    assert [m.policy.max_capacity_prompt for m in methods] == [64, 256]
    assert all(isinstance(m.policy, LESS) and m.policy.base.name == "snapkv" for m in methods)


def test_training_objective_is_the_inference_computation(engine):
    """What a layer is trained on (captured data, training formula) is what inference computes.

    Layer 0's inputs do not depend on compression, so its LESS output during a compressed
    teacher-forced run must equal the training formula applied to the full-model capture.
    """
    from snapkv_rag.compression.less.state import LowRankState
    from snapkv_rag.compression.runtime import capturing
    from snapkv_rag.engine.generation import DecodeRun
    from snapkv_rag.engine.sampling import GenerationParams
    from snapkv_rag.less_training import train as T

    tokens = engine.tokenizer("The quick brown fox jumps over the lazy dog. The capital of France is Paris. " * 4)["input_ids"]
    prompt, cont = tokens[:40], tokens[40:52]
    policy = SnapKV(window_size=4, kernel_size=3, max_capacity_prompt=16)
    kernels = LessKernels.initial(model_signature(engine.model), rank=4, hidden=8, seed=0, scale=1.0)
    seen = {}
    original = LowRankState.attend

    def spy(self, layer_idx, query, key, mask, output, scaling):
        out = original(self, layer_idx, query, key, mask, output, scaling)
        if layer_idx == 0:
            seen["base"], seen["less"] = output.clone(), out.clone()
        return out

    LowRankState.attend = spy
    try:
        DecodeRun(engine.model, [prompt], GenerationParams(max_new_tokens=12), LESS(base=policy, kernels=kernels), engine._pad_id).teacher_force(cont)
    finally:
        LowRankState.attend = original
    grab = T.Capture({16: policy}, len(prompt))
    with torch.inference_mode(), capturing(grab):
        engine.model(input_ids=torch.tensor([prompt + cont]), use_cache=False, logits_to_keep=1)
    data = T._prepare({k: torch.stack(v) for k, v in grab.layers[0].items()}, 16, len(prompt), grab.meta[0]["scaling"])
    b, hkv, g, c, d = data["sparse"].shape
    merged = T.layer_output(kernels.layers[0], data, torch.arange(b))
    as_inference = lambda t: t.reshape(b, hkv * g, c, d).permute(0, 2, 1, 3)[:, : c - 1]  # noqa: E731
    torch.testing.assert_close(as_inference(data["sparse"]), seen["base"], atol=2e-3, rtol=1e-2)  # fp16 capture
    torch.testing.assert_close(as_inference(merged), seen["less"], atol=2e-3, rtol=1e-2)
    assert (seen["less"] - seen["base"]).abs().max() > 1e-2  # the state matters here


def test_distillation_trains_on_the_inference_computation(engine, tmp_path):
    """Stage 2 rebuilds a compressed run from recorded data; its log-probs must be the engine's own."""
    from snapkv_rag.engine.generation import DecodeRun
    from snapkv_rag.engine.sampling import GenerationParams
    from snapkv_rag.less_training.distill import collect, less_log_probs

    train_paths, val_paths = collect(engine, BASE_SPEC, [16], 48, 8, 3, 1, tmp_path, progress=False)
    assert len(train_paths) == 3 and len(val_paths) == 1
    sample = torch.load(train_paths[1], weights_only=True)
    tokens = sample["tokens"].tolist()
    kernels = LessKernels.initial(model_signature(engine.model), rank=4, hidden=8, seed=0, scale=1.0)
    policy = LESS(base=SnapKV(window_size=4, kernel_size=3, max_capacity_prompt=16), kernels=kernels)
    run = DecodeRun(engine.model, [tokens[:48]], GenerationParams(max_new_tokens=8), policy, engine._pad_id)
    expected = run.teacher_force(tokens[48:]).float().log_softmax(-1)[1:]
    rebuilt = less_log_probs(engine, policy, kernels, sample, 16)
    torch.testing.assert_close(rebuilt, expected, atol=2e-3, rtol=1e-3)  # the recorded K/V are fp16
    base = DecodeRun(engine.model, [tokens[:48]], GenerationParams(max_new_tokens=8), policy.base, engine._pad_id)
    assert (base.teacher_force(tokens[48:]).float().log_softmax(-1)[1:] - expected).abs().max() > 1e-2  # the state matters
    full = DecodeRun(engine.model, [tokens[:48]], GenerationParams(max_new_tokens=8), None, engine._pad_id)
    torch.testing.assert_close(sample["log_probs"].float(), full.teacher_force(tokens[48:]).float().log_softmax(-1)[1:], atol=2e-2, rtol=1e-2)


def test_two_stage_training_distils_resumes_and_leaves_the_model_alone(engine, tmp_path):
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    config = small_config(distill_epochs=3, distill_sequences=6, distill_lr=1e-2)
    (path,) = train(engine, config, tmp_path / "work", tmp_path / "out", model_tag="tiny", progress=False)
    report = load_kernels(path).header["distill"]
    assert report["windows"] == {"train": 6, "val": 2} and report["collect_seconds"] > 0
    history = report["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3] and report["best_epoch"] in (0, 1, 2, 3)
    assert report["val_kl"] == min(h["val_kl"] for h in history)
    assert report["val_kl_base"] > 0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, weights[name]), name
    # Calibration (the default) moves only the biases of the (default, exp) feature maps.
    stage1, distilled = load_kernels(tmp_path / "work" / "kernels-b16" / "layer000.safetensors").layers[0], load_kernels(path).layers[0]
    assert distilled.kind == stage1.kind == "exp"
    for part in ("phi", "psi"):
        assert torch.equal(getattr(distilled, part)["w"], getattr(stage1, part)["w"]), part
    assert not torch.equal(distilled.psi["b"], stage1.psi["b"]) or report["best_epoch"] == 0

    # Resume: the distilled checkpoint is reused as it is.
    (again,) = train(engine, config, tmp_path / "work", tmp_path / "out2", model_tag="tiny", progress=False)
    for name, tensor in load_kernels(path).tensors().items():
        assert torch.equal(load_kernels(again).tensors()[name], tensor), name


def test_less_distill_cli_runs_stage_two_on_a_stage_one_file(engine, tmp_path, monkeypatch):
    from snapkv_rag.less_training import cli as less_cli

    (stage1,) = train(engine, small_config(distill_epochs=0), tmp_path / "work", tmp_path / "out", model_tag="tiny", progress=False)
    assert "distill" not in load_kernels(stage1).header
    monkeypatch.setattr(less_cli, "load_engine", lambda args: engine)
    args = build_parser().parse_args(
        [
            "less",
            "distill",
            str(stage1),
            "--out",
            str(tmp_path / "d.safetensors"),
            "--epochs",
            "1",
            "--sequences",
            "4",
            "--work-dir",
            str(tmp_path / "dw"),
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    header = load_kernels(tmp_path / "d.safetensors").header
    assert header["distill"]["windows"] == {"train": 4, "val": 2} and header["training"]["distill_epochs"] == 1
    args = build_parser().parse_args(["less", "distill", str(tmp_path / "d.safetensors"), "--work-dir", str(tmp_path / "dw")])
    with pytest.raises(ValueError, match="already distilled"):
        args.func(args)


def test_calibration_trains_the_mass_only_biases_too(engine, tmp_path):
    from snapkv_rag.less_training.distill import DistillConfig, collect, distill

    train_paths, val_paths = collect(engine, BASE_SPEC, [16], 48, 8, 4, 1, tmp_path, progress=False)
    start = LessKernels.initial(model_signature(engine.model), rank=4, seed=0, scale=1.0, features="exp", mass_rank=3, base_spec=BASE_SPEC + ",budget=16")
    best, report = distill(engine, start, train_paths, val_paths, 16, DistillConfig(epochs=2, lr=3e-2, scale_lr=3e-2), progress=False)
    assert report["history"][-1]["train_kl"] < report["history"][1]["train_kl"]
    for part in ("phi", "psi"):
        params = getattr(best.layers[0], part)
        moved = {n for n, t in params.items() if not torch.equal(t, getattr(start.layers[0], part)[n])}
        assert moved == {"b", "bm"}, (part, moved)


@pytest.mark.parametrize("params", ["calibration", "all"])
def test_distillation_lowers_the_end_to_end_kl(engine, tmp_path, params):
    from snapkv_rag.less_training.distill import DistillConfig, collect, distill

    train_paths, val_paths = collect(engine, BASE_SPEC, [16], 48, 8, 4, 1, tmp_path, progress=False)
    start = LessKernels.initial(model_signature(engine.model), rank=4, hidden=8, seed=0, scale=1.0, base_spec=BASE_SPEC + ",budget=16")
    before = {i: {n: t.clone() for n, t in layer.phi.items()} for i, layer in start.layers.items()}
    best, report = distill(engine, start, train_paths, val_paths, 16, DistillConfig(epochs=4, lr=3e-2, scale_lr=3e-2, params=params), progress=False)
    history = report["history"]
    assert history[-1]["train_kl"] < 0.5 * history[1]["train_kl"]
    assert report["val_kl"] < 0.5 * report["val_kl_stage1"] and report["val_kl_stage1"] < report["val_kl_base"]
    for i, layer in start.layers.items():  # the caller's kernels are copied, not trained in place
        assert all(torch.equal(layer.phi[n], t) for n, t in before[i].items())
    moved = {n for n in ("w1", "b2") if not torch.equal(best.layers[0].phi[n], start.layers[0].phi[n])}
    assert moved == ({"b2"} if params == "calibration" else {"w1", "b2"})
    with pytest.raises(ValueError, match="collected for budgets"):
        collect(engine, BASE_SPEC, [16, 20], 48, 8, 4, 1, tmp_path, progress=False)


def test_less_cli_bad_input_is_one_clear_error(tmp_path, capsys):
    from snapkv_rag.cli import main
    from snapkv_rag.errors import InvalidCompressionError

    assert main(["less", "train", "--budgets", "4096"]) == 2
    assert "budget 4096 must be below prompt_tokens 2048" in capsys.readouterr().err
    assert main(["less", "distill", str(tmp_path / "any.safetensors"), "--epochs", "0"]) == 2
    assert "--epochs and --sequences must be positive" in capsys.readouterr().err
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a kernel file")
    with pytest.raises(InvalidCompressionError, match="not a readable safetensors file"):
        load_kernels(broken)
