"""Evaluation harness end to end on a tiny random model: records, settings, reports, plots."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_engine

from snapkv_rag.errors import InvalidCompressionError
from snapkv_rag.harness.citation import build_questions
from snapkv_rag.harness.needle import build_needle_case
from snapkv_rag.harness.report import read_jsonl, write_report
from snapkv_rag.harness.runner import method_grid, run_fidelity, run_needle, run_speed

REQUIRED = {"task", "model", "method", "budget", "settings", "prompt_tokens", "batch_size", "dtype", "device", "threads", "version"}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer, context=4096)


@pytest.fixture(scope="module")
def methods():
    return method_grid(["snapkv:window=8,kernel=3", "streamingllm", "h2o", "random:recent=8"], [48, 96])


def test_method_grid_validates_every_combination():
    grid = method_grid(["snapkv", "full", "h2o"], [64, 128])
    assert [(m.label, m.budget) for m in grid] == [("snapkv", 64), ("snapkv", 128), ("h2o", 64), ("h2o", 128)]
    assert grid[0].settings()["window_size"] == 32 and grid[0].settings()["question_aware"] is True
    with pytest.raises(InvalidCompressionError, match="budget 16"):
        method_grid(["snapkv"], [16])


def test_needle_cases_hit_their_length_and_depth(tokenizer):
    for depth in (0.0, 0.5, 1.0):
        case = build_needle_case(tokenizer, 300, depth, seed=3)
        n = len(tokenizer(case.prompt)["input_ids"])
        assert 250 <= n <= 350
        position = case.prompt.index(case.answer) / len(case.prompt)
        assert abs(position - depth) < 0.15
    assert build_needle_case(tokenizer, 300, 0.5, seed=3) == build_needle_case(tokenizer, 300, 0.5, seed=3)


def test_the_second_needle_wording_shares_nothing_with_the_first(tokenizer):
    first = build_needle_case(tokenizer, 400, 0.3, seed=5)
    other = build_needle_case(tokenizer, 400, 0.3, seed=5, wording="code")
    assert len(other.answer) == 4 and other.answer in other.haystack and other.haystack in other.prompt
    assert first.haystack in first.prompt and first.question.endswith("?") and first.question in first.prompt.replace("what", "What")
    assert 350 <= len(tokenizer(other.prompt)["input_ids"]) <= 450
    assert not set(first.haystack.split(". ")) & set(other.haystack.split(". "))
    varied = build_needle_case(tokenizer, 400, 0.3, seed=5, wording="code", varied=True)
    assert varied.answer == other.answer and varied.haystack != other.haystack
    assert sorted(varied.haystack.split()) == sorted(other.haystack.split())  # the same sentences, reordered
    with pytest.raises(ValueError, match="wording must be one of"):
        build_needle_case(tokenizer, 400, 0.3, wording="riddle")


def test_citation_questions_have_gold_documents():
    questions = build_questions(12, 8, seed=1)
    for q in questions:
        context = q.messages[1]["content"]
        assert all(f"Document [{g}]" in context for g in q.gold)
        for g, city in zip(q.gold, q.answers):
            line = next(candidate for candidate in context.splitlines() if candidate.startswith(f"Document [{g}]"))
            assert city in line
        assert q.messages[-1]["content"].endswith("?")
    assert build_questions(12, 8, seed=1) == questions


def _check(records, task, tmp_path, n_expected):
    assert len(records) == n_expected
    for r in records:
        assert REQUIRED <= set(r), set(REQUIRED) - set(r)
        assert r["task"] == task
    paths = write_report(task, records, tmp_path, command=f"snapkv-rag eval {task}")
    assert read_jsonl(paths["jsonl"]) == json.loads(json.dumps(records, default=str))
    text = paths["markdown"].read_text()
    assert "| method" in text or "| prompt tokens" in text
    pngs = [p for k, p in paths.items() if k not in ("jsonl", "markdown")]
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    return text


def test_needle_run(engine, methods, tmp_path):
    records = run_needle(engine, methods, [200], [0.0, 1.0], max_new_tokens=4, progress=False)
    text = _check(records, "needle", tmp_path, 2 * (1 + len(methods)))
    assert "snapkv:window=8,kernel=3 @ 48" in text
    compressed = [r for r in records if r["method"] != "full"]
    assert all(r["prompt_kv_bytes_kept"] < records[0]["prompt_kv_bytes_kept"] for r in compressed)


def test_fidelity_run(engine, methods, tmp_path):
    records = run_fidelity(engine, methods[:2], [250], continuation_tokens=5, progress=False)
    _check(records, "fidelity", tmp_path, 2)
    for r in records:
        assert r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 1 and r["continuation_tokens"] == 5


def test_fidelity_of_a_budget_above_the_prompt_is_perfect(engine, tmp_path):
    records = run_fidelity(engine, method_grid(["snapkv:window=8"], [480]), [150], continuation_tokens=5, progress=False)
    assert records[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert records[0]["agreement_prefix"] == 1.0 and records[0]["top1_agreement"] == 1.0


def test_speed_run(engine, methods, tmp_path):
    records = run_speed(engine, methods[:1], [150, 300], new_tokens=4, progress=False)
    text = _check(records, "speed", tmp_path, 4)
    assert "decode speed-up vs full" in text
    for r in records:
        assert r["decode_floor_ms"] > 0 and r["bandwidth_bytes_per_second"] > 0 and r["new_tokens"] == 4


def test_speed_batch_vs_single(engine, methods, tmp_path):
    records = run_speed(engine, methods[:1], [150], new_tokens=3, batch_sizes=[3], progress=False)
    batch = [r for r in records if r.get("kind") == "batch"]
    assert len(batch) == 2 and all(r["batch_size"] == 3 and r["same_tokens"] for r in batch)
    assert all(r["largest_bucket"] == 3 and r["invariant"] is False for r in batch)  # the batch really ran as one
    assert all(r["batch_tokens_per_second"] > 0 and r["single_tokens_per_second"] > 0 for r in batch)
    text = write_report("speed", records, tmp_path)["markdown"].read_text()
    assert "throughput batch / single" in text and "decode speed-up vs full" in text


def test_the_eval_measures_speed_as_users_run_and_compares_answers_invariant():
    """Speed and memory run the engine users get (the invariant mode off unless asked for); needle,
    citation and fidelity run invariant unless --no-invariant; an explicit choice always stands."""
    from snapkv_rag.harness.cli import task_invariant

    assert task_invariant("speed", None) is None  # the engine's own default: off unless SNAPKV_RAG_INVARIANT
    assert all(task_invariant(task, None) is True for task in ("needle", "citation", "fidelity"))
    assert task_invariant("speed", True) is True and task_invariant("fidelity", False) is False
