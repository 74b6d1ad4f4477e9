"""LESS training reads its work folder with ``torch.load(weights_only=True)`` (issue 64, case 13).

Before torch 2.6, ``torch.load`` unpickled anything by default, so a tampered work folder (a
capture shard, ``capture/meta.pt``, a recorded distillation window) ran code when training
resumed; pyproject allows torch >= 2.4. Every file the training writes is plain tensors and
numbers in dicts, so every load names ``weights_only=True``. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
gives newer torch the old default for the tests below.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression.less.kernels import load_kernels
from snapkv_rag.errors import LessTrainingError
from snapkv_rag.less_training.distill import DistillConfig, _distill
from snapkv_rag.less_training.train import TrainConfig, _load_layer, train

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["snapkv_rag", "eval", "scripts", "examples", "apps", "connectors", "tests"]


def unsafe_loads(tree: ast.AST) -> list[int]:
    """Lines of ``torch.load(...)`` (or ``load`` imported from torch) calls without ``weights_only=True``."""
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization")]
    from_torch = {alias.asname or alias.name for node in imports for alias in node.names if alias.name == "load"}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        dotted = isinstance(func, ast.Attribute) and func.attr == "load" and ast.unparse(func.value) in ("torch", "torch.serialization")
        if not (dotted or (isinstance(func, ast.Name) and func.id in from_torch)):
            continue
        if not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_what_it_should():
    tree = ast.parse(
        "import torch\nfrom torch import load as L\ntorch.load(p)\ntorch.load(p, weights_only=False)\nL(p)\n"
        "torch.serialization.load(p, map_location='cpu')\ntorch.load(p, weights_only=True)\njson.load(f)\n"
    )
    assert unsafe_loads(tree) == [3, 4, 5, 6]


def test_every_torch_load_passes_weights_only_true():
    unsafe = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "results" in path.relative_to(ROOT).parts:
                continue
            unsafe += [f"{path.relative_to(ROOT)}:{line}" for line in unsafe_loads(ast.parse(path.read_text(), str(path)))]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


class Payload:
    """Unpickled by a full unpickler, it makes the folder ``marker``: a stand-in for any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture()
def old_default(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch < 2.6: torch.load(path) unpickles anything


def test_a_tampered_capture_shard_runs_no_code(tmp_path, old_default):
    marker = tmp_path / "ran"
    shard = tmp_path / "work" / "capture" / "p8" / "layer000" / "shard0000.pt"
    shard.parent.mkdir(parents=True)
    torch.save({"k": torch.zeros(1), "extra": Payload(marker)}, shard)
    with pytest.raises(LessTrainingError, match="more than tensors and numbers"):
        _load_layer(tmp_path / "work", 0, 8)
    assert not marker.exists()


def test_a_tampered_distillation_window_runs_no_code(tmp_path, old_default):
    marker = tmp_path / "ran"
    window = tmp_path / "seq0000.pt"
    torch.save({"tokens": torch.zeros(4), "log_probs": Payload(marker)}, window)
    with pytest.raises(LessTrainingError, match="more than tensors and numbers"):
        _distill(None, None, [window], [window], 16, DistillConfig(), False)  # the validation windows are read first
    assert not marker.exists()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=5)


def test_training_resumes_from_plain_files_and_refuses_a_tampered_meta(engine, tmp_path, old_default):
    settings = dict(prompt_tokens=48, continuation_tokens=8, sequences=6, val_sequences=2, epochs=2, batch=2, hidden=8, rank=4, shard=4)
    config = TrainConfig(base="snapkv:window=4,kernel=3", budgets=[16], distill_epochs=1, distill_sequences=3, **settings)
    work = tmp_path / "work"
    (path,) = train(engine, config, work, tmp_path / "out", model_tag="tiny", progress=False)
    meta = torch.load(work / "capture" / "meta.pt", weights_only=True)
    assert all(isinstance(m["scaling"], float) and isinstance(m["o_proj"], torch.Tensor) for m in meta.values())
    # a tampered meta.pt is refused before anything in it runs
    marker = tmp_path / "ran"
    torch.save({**meta, "extra": Payload(marker)}, work / "capture" / "meta.pt")
    with pytest.raises(LessTrainingError, match="meta.pt holds more than tensors and numbers"):
        train(engine, config, work, tmp_path / "out3", model_tag="tiny", progress=False)
    assert not marker.exists()
    # a missing one is written again (one shard captured again), and the run resumes
    (work / "capture" / "meta.pt").unlink()  # (the tampered one)
    (again,) = train(engine, config, work, tmp_path / "out2", model_tag="tiny", progress=False)
    rewritten = torch.load(work / "capture" / "meta.pt", weights_only=True)
    assert rewritten.keys() == meta.keys()
    assert all(rewritten[i]["scaling"] == meta[i]["scaling"] and torch.equal(rewritten[i]["o_proj"], meta[i]["o_proj"]) for i in meta)
    # the same kernels up to float rounding: the shard captured again alone may take another GEMM
    # blocking than in the first capture (Intel hosts: 1e-6 on weights of 1e-2), a wrong resume moves them by far more
    for name, tensor in load_kernels(path).tensors().items():
        torch.testing.assert_close(load_kernels(again).tensors()[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
