"""``snapkv-rag less calibrate`` (issue 30): LESS fitted on a collection's documents, used only where it beats its base."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_engine

from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.compression.less.collection_kernels import REPORT, calibration_dir, calibration_key, calibration_note, policy_for_collection
from snapkv_rag.compression.less.kernels import LessKernels, load_kernels, model_signature
from snapkv_rag.errors import InvalidCompressionError, LessTrainingError
from snapkv_rag.less_training.collection_fit import CalibrationConfig, calibrate, collection_text, describe_calibration
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.embeddings import Embedder

WORDS = "harbour ferry crowns ticket museum glass river bridge market library council tower garden station".split()


def document(i: int) -> str:
    return " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]} {j + i}" for j in range(60)) + "."


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=3)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("calibrate")
    folder = root / "docs"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(document(i))
    store = DocumentStore("calib", path=root / "chroma", embedder=Embedder())
    store.ingest([folder], chunk_tokens=64, overlap=8)
    return store


CONFIG = CalibrationConfig(budget=16, base="snapkv:window=4", prompt_tokens=48, continuation_tokens=8, windows=3, val_windows=2, epochs=1)


def start_kernels(engine) -> LessKernels:
    # exponential features with mass-only ones, as shipped; scale 1: the state claims real mass from the start
    return LessKernels.initial(model_signature(engine.model), rank=4, features="exp", mass_rank=2, seed=0, scale=1.0, base="snapkv", budget=16)


def test_calibration_writes_kernels_and_a_report_that_decides_by_held_out_kl(engine, store):
    summary = calibrate(engine, store, CONFIG, kernels=start_kernels(engine), progress=False)
    assert summary["windows"]["train"] == 3 and summary["windows"]["val"] == 2
    assert summary["use"] == ("less" if summary["val_kl_calibrated"] < summary["val_kl_base"] else "base")
    assert summary["val_kl_calibrated"] <= summary["val_kl_start"]  # the best epoch, the start included
    stored = json.loads((calibration_dir(store) / REPORT).read_text())
    assert list(stored.values()) == [summary]
    kernels = load_kernels(summary["kernels"])
    assert kernels.header["calibration"]["collection"] == "calib"
    assert kernels.header["budget"] == 16
    assert "held-out KL" in describe_calibration(summary)
    policy = policy_for_collection(LESS(base=SnapKV(max_capacity_prompt=16, window_size=4)), store, engine.model)
    if summary["use"] == "less":
        assert isinstance(policy, LESS) and policy.kernels == summary["kernels"]
    else:
        assert policy == SnapKV(max_capacity_prompt=16, window_size=4)


def _write(store, engine, base, summary: dict) -> None:
    out = calibration_dir(store)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).write_text(json.dumps({calibration_key(model_signature(engine.model), base): summary}))


def test_document_qa_uses_the_calibration_and_the_base_where_less_measured_worse(engine, store, tmp_path):
    path = start_kernels(engine).save(tmp_path / "k.safetensors")
    base = SnapKV(max_capacity_prompt=16, window_size=4)
    qa = DocumentQA(engine, store, compression=LESS(base=base), context_tokens=200, max_new_tokens=4)
    _write(store, engine, base, {"use": "less", "kernels": str(path)})
    assert qa.policy() == LESS(base=base, kernels=str(path))
    assert qa.policy("less:base=snapkv,budget=16,window=4") == LESS(base=base, kernels=str(path))
    assert qa.policy("less:base=snapkv,budget=32,window=4").kernels is None  # no calibration at that budget: as given
    assert qa.policy("less:base=snapkv,budget=16,window=8").kernels is None  # nor for another window
    assert calibration_note(LESS(base=base), qa.policy()) is not None
    _write(store, engine, base, {"use": "base", "kernels": str(path)})
    assert qa.policy() == base
    assert "worse" in calibration_note(LESS(base=base), base)
    answer = qa.ask("Which ferry?")  # runs with the base policy: no kernels needed
    assert answer.result.stats.compression["method"] == "snapkv"
    explicit = LESS(base=base, kernels=str(path))
    assert qa.policy(explicit) is explicit  # kernels given: the calibration does not override them
    assert qa.policy("snapkv:budget=16") == "snapkv:budget=16"
    _write(store, engine, base, {"use": "less", "kernels": str(tmp_path / "gone.safetensors")})
    with pytest.raises(InvalidCompressionError, match="calibrate again"):
        qa.policy()
    (calibration_dir(store) / REPORT).unlink()


@pytest.mark.parametrize("base", ["full", "less:base=snapkv", "snapkv:window=4,heads=adaptive"])
def test_a_base_that_is_not_a_uniform_sparse_policy_is_one_clear_error(engine, store, base):
    with pytest.raises(LessTrainingError, match="sparse policy"):
        calibrate(
            engine, store, CalibrationConfig(budget=16, base=base, prompt_tokens=48, continuation_tokens=8), kernels=start_kernels(engine), progress=False
        )


def test_too_little_text_is_one_clear_error(engine, store):
    assert len(collection_text(store)) > 0
    with pytest.raises(LessTrainingError, match="needs at least"):
        calibrate(
            engine,
            store,
            CalibrationConfig(budget=16, base="snapkv:window=4", prompt_tokens=4000, val_windows=2),
            kernels=start_kernels(engine),
            progress=False,
        )
