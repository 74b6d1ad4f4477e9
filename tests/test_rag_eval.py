"""``snapkv-rag eval citation`` on the RAG pipeline: a tiny random LLM, the real small embedder, a real Chroma store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_tokenizer, tiny_engine, tiny_model

from snapkv_rag.cli import main
from snapkv_rag.harness.rag_citation import (
    EvalInputError,
    RagQuestion,
    answer_correct,
    is_gold_file,
    load_questions,
    run_rag_citation,
)
from snapkv_rag.harness.report import attribution_sweep_rows, read_jsonl, write_report
from snapkv_rag.harness.runner import method_grid
from snapkv_rag.rag import Embedder, EvidenceAttributor
from snapkv_rag.rag.attribution import choose, sweep

REQUIRED = {"task", "model", "method", "budget", "settings", "prompt_tokens", "batch_size", "dtype", "device", "threads", "version"}
TOPICS = {
    "ferry": "The Marrowick ferry leaves the harbour at 6:40 every weekday and crosses to Tessaly in forty minutes.",
    "library": "The public library of Marrowick holds 182,000 volumes and opens at nine in the morning.",
    "museum": "The glassworks museum shows the Cobalt Ewer, a blue jug blown in 1741 by the Hesketh family.",
    "tram": "Tram line 3 runs from the station to the observatory every twelve minutes until midnight.",
    "bakery": "The bakery guild bakes a spiced loaf called the harbour twist for the lantern festival.",
}


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", build_tokenizer(), context=4096)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rag-eval")
    folder = root / "corpus"
    (folder / "sub").mkdir(parents=True)
    for topic, fact in TOPICS.items():
        filler = " ".join(f"The {topic} has note {k} about its history in Marrowick." for k in range(6))
        (folder / ("sub" if topic == "tram" else "") / f"{topic}.md").write_text(f"# The {topic}\n\n{fact} {filler}\n")
    questions = root / "questions.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps(q)
            for q in (
                {"question": "When does the ferry leave the harbour?", "answer": "6:40", "gold": ["ferry.md"]},
                {"question": "How many volumes does the library hold?", "answer": "182,000", "gold": "library.md"},
                {"question": "Which line runs to the observatory?", "answer": "line 3", "gold": ["sub/tram.md"]},
            )
        )
        + "\n"
    )
    return folder, questions


def test_questions_file_and_gold_matching(corpus, tmp_path):
    _, path = corpus
    qs = load_questions(path)
    assert [q.gold for q in qs] == [("ferry.md",), ("library.md",), ("sub/tram.md",)]
    assert load_questions(path, 2) == qs[:2]
    assert is_gold_file("/data/corpus/ferry.md", ["ferry.md"])
    assert is_gold_file("/data/corpus/sub/tram.md", ["sub/tram.md"]) and not is_gold_file("/data/corpus/tram.md", ["sub/tram.md"])
    assert not is_gold_file("/data/corpus/old-ferry.md", ["ferry.md"])
    assert answer_correct("It leaves at 6:40 A.M.", "6:40 a.m.") and not answer_correct("At 7.", "6:40")
    assert answer_correct("anything", None) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": "x"}\n')
    with pytest.raises(EvalInputError, match="bad.jsonl:1"):
        load_questions(bad)
    with pytest.raises(EvalInputError, match="cannot read"):
        load_questions(tmp_path / "missing.jsonl")


def test_choose_and_sweep_agree_with_the_attributor(embedder):
    assert choose([0.2, 0.9, 0.85, 0.1], threshold=0.5, margin=0.1) == (1, 2)
    assert choose([0.2, 0.4], threshold=0.5, margin=0.1) == ()
    assert choose([], threshold=0.0, margin=0.1) == ()
    chunks = list(TOPICS.values())
    answer = "The ferry leaves at 6:40. The library holds 182,000 volumes."
    grid = [(m, t, 0.1) for m, t in (("hybrid", 0.6), ("embedding", 0.3), ("lexical", 0.3), ("lexical", 2.0))]
    got = sweep(embedder, "When?", answer, chunks, grid)
    for method, threshold, margin in grid:
        attributor = EvidenceAttributor(embedder, method=method, threshold=threshold, margin=margin)
        expected = sorted({n for s in attributor.attribute("When?", answer, chunks) for n in s.numbers})
        assert got[f"{method}:threshold={threshold:g},margin={margin:g}"] == expected
    assert got["hybrid:threshold=0.6,margin=0.1"] == [1, 2]
    # Each sentence's numbers (6:40, 182,000 volumes) are in one chunk: that is evidence enough,
    # so even an unreachable similarity threshold cites it (the key-fact gate narrows instead).
    assert got["lexical:threshold=2,margin=0.1"] == [1, 2]
    no_facts = sweep(embedder, "When?", "It is open in the morning.", chunks, [("lexical", 2.0, 0.1)])
    assert no_facts["lexical:threshold=2,margin=0.1"] == []


def test_pipeline_run_records_and_report(engine, embedder, corpus, tmp_path):
    folder, questions = corpus
    methods = method_grid(["snapkv:window=8,kernel=3", "snapkv:window=question"], [96])
    records = run_rag_citation(
        engine,
        methods,
        corpus=folder,
        questions=questions,
        context_tokens=400,
        max_new_tokens=4,
        embedder=embedder,
        attribution_grid=[("hybrid", 0.6, 0.1), ("lexical", 0.3, 0.0)],
        progress=False,
    )
    n_questions, runs = 3, 2 + len(methods)
    assert len(records) == n_questions * runs * 3  # generated, attributed, attention
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["task"] == "citation" and r["route"] in ("generated", "attributed", "attention")
        assert r["context_tokens"] == 400 and r["corpus_files"] == 5 and r["store"] == "temporary"
        assert r["settings"]["method"] in ("full", "snapkv")
    full = [r for r in records if r["method"] == "full"]
    assert all(r["agreement_f1"] == 1.0 and r["identical_text"] for r in full)
    noise = [r for r in records if r["method"] == "full (noise floor)"]
    assert len(noise) == n_questions * 3 and all(r["threads"] != full[0]["threads"] for r in noise)
    # Gold numbers are the stuffed chunks from the gold file.
    for r in full:
        expected = [i + 1 for i, s in enumerate(r["stuffed_sources"]) if is_gold_file(s.split("#")[0], r["gold_files"])]
        assert r["gold"] == expected and r["gold_retrieved"] == bool(expected)
    assert all(r["gold_retrieved"] for r in full)  # five short files all fit 400 tokens' worth of retrieval
    aligned = [r for r in records if r["method"] == "snapkv:window=question"]
    assert all(r["kept_tokens"] == 96 and r["resolved_window"] and 8 <= r["resolved_window"][0] <= 64 for r in aligned)
    sweeps = [r for r in full if r.get("attribution_sweep")]
    assert len(sweeps) == n_questions and all(r["route"] == "attributed" for r in sweeps)
    assert [row[0] for row in attribution_sweep_rows(records)] == ["hybrid:threshold=0.6,margin=0.1", "lexical:threshold=0.3,margin=0"]

    paths = write_report("citation", records, tmp_path, command="snapkv-rag eval citation")
    assert read_jsonl(paths["jsonl"]) == json.loads(json.dumps(records, default=str))
    text = paths["markdown"].read_text()
    assert "Retrieval recall (a gold file among the stuffed chunks): 3/3" in text
    assert "| snapkv:window=question @ 96 | attributed |" in text and "| full (noise floor) | generated |" in text
    assert "| snapkv:window=question @ 96 | attention |" in text
    assert "Attribution settings on the uncompressed answers" in text
    assert paths["citation_f1_vs_budget"].stat().st_size > 1000


def test_a_named_store_keeps_the_collection(engine, embedder, corpus, tmp_path):
    from snapkv_rag.rag import DocumentStore

    folder, questions = corpus
    qs = [RagQuestion("When does the ferry leave?", "6:40", ("ferry.md",))]
    run_rag_citation(
        engine,
        [],
        corpus=folder,
        questions=qs,
        context_tokens=700,
        max_new_tokens=2,
        embedder=embedder,
        store=tmp_path / "chroma",
        collection="kept",
        attribution_grid=(),
        progress=False,
    )
    assert DocumentStore("kept", path=tmp_path / "chroma", embedder=embedder, create=False).count() > 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-4k")
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer), context=4096).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_cli_runs_the_pipeline(model_dir, corpus, tmp_path, capsys):
    folder, questions = corpus
    out = tmp_path / "out"
    args = [
        "eval",
        "citation",
        "--model",
        model_dir,
        "--corpus",
        str(folder),
        "--questions-file",
        str(questions),
        "--questions",
        "1",
        "--context-tokens",
        "700",
        "--max-new-tokens",
        "3",
        "--methods",
        "snapkv:window=question",
        "--budgets",
        "96",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(out),
        "--json",
    ]
    assert main(args) == 0
    paths = json.loads(capsys.readouterr().out)
    records = read_jsonl(Path(paths["jsonl"]))
    assert len(records) == 3 * 3  # 3 runs (full, noise floor, one method) x 3 routes
    assert {r["threads"] for r in records if r["method"] == "full (noise floor)"} == {2}
    assert {r["threads"] for r in records if r["method"] != "full (noise floor)"} == {1}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--corpus", "/no/such/folder"], "corpus"),
        (["--questions-file", "/no/such.jsonl"], "questions file"),
        (["--context-tokens", "0"], "context-tokens"),
        (["--threads", "0"], "threads"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(model_dir, extra, message, capsys):
    assert main(["eval", "citation", "--model", model_dir, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapkv-rag: error:") and message in err and err.count("\n") == 1


def test_needle_records_name_the_resolved_question_window(engine):
    from snapkv_rag.harness.runner import run_needle

    records = run_needle(engine, method_grid(["snapkv:window=question", "snapkv:window=8"], [96]), [250], [0.5], max_new_tokens=2, progress=False)
    by_method = {r["method"]: r for r in records}
    assert by_method["full"]["resolved_window"] is None and by_method["snapkv:window=8"]["resolved_window"] is None
    (window,) = by_method["snapkv:window=question"]["resolved_window"]
    assert 8 <= window <= 64


def test_without_noise_floor_and_methods_only_the_full_run(engine, embedder, corpus):
    folder, questions = corpus
    records = run_rag_citation(
        engine,
        [],
        corpus=folder,
        questions=questions,
        n_questions=2,
        context_tokens=700,
        max_new_tokens=2,
        embedder=embedder,
        noise_threads=None,
        progress=False,
    )
    assert [r["method"] for r in records] == ["full"] * 6  # 2 questions x 3 routes
    assert sum(bool(r.get("attribution_sweep")) for r in records) == 2
