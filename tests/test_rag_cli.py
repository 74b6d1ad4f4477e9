"""``snapkv-rag ingest`` and ``snapkv-rag ask`` on a tiny model saved to disk."""

from __future__ import annotations

import json

import pytest
from conftest import build_tokenizer, tiny_model

from snapkv_rag.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-rag")
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer), context=2048).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "ferry.md").write_text("# Ferry\n\nThe first ferry leaves the harbour at 6:40 on weekdays.")
    (folder / "library.txt").write_text("Library\nThe library opens at 9:00 and holds 40,000 books.")
    (folder / "empty.md").write_text("")
    (folder / "blob.txt").write_bytes(b"\x00\xff\x00")
    return folder


def test_ingest_reports_and_is_idempotent(docs, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["ingest", str(docs), "--collection", "notes", "--store", store, "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "2 files" in out.out and "2 skipped" in out.out
    assert "empty.md: empty file" in out.err and "blob.txt: binary file" in out.err
    assert main(["ingest", str(docs), "--collection", "notes", "--store", store, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunks_added"] == 0 and report["files_unchanged"] == 2 and report["total_chunks"] == 2
    assert {s["reason"] for s in report["skipped"]} == {"empty file", "binary file (contains NUL bytes)"}


def test_ask_json_has_answer_sources_and_stats(docs, tmp_path, model_dir, capsys):
    store = str(tmp_path / "store")
    main(["ingest", str(docs), "--collection", "notes", "--store", store, "--json"])
    capsys.readouterr()
    args = ["ask", "When does the first ferry leave?", "--collection", "notes", "--store", store, "--model", model_dir]
    assert main([*args, "--json", "--max-new-tokens", "4", "--compression", "snapkv:budget=96,window=question"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["context"]["chunks"] == 2 and payload["context"]["prompt_tokens"] == payload["usage"]["prompt_tokens"]
    assert payload["stats"]["compression"]["window_size"] == "question"
    assert payload["stats"]["kept_tokens_per_layer"] == [96, 96]
    assert set(payload["cited"]) == {"generated", "attributed"}
    assert main([*args, "--max-new-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "Sources:" in text and "Stuffed 2 chunks" in text
    # per-layer budgets: the summary gives the range of entries the layers kept
    pyramid = [*args, "--max-new-tokens", "3", "--compression", "snapkv:budget=96,window=question,layers=pyramid"]
    assert main([*pyramid, "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["stats"]["kept_tokens_per_layer"]
    assert kept[0] > kept[1]
    assert main(pyramid) == 0
    assert f"KV kept {kept[1]}-{kept[0]} per layer" in capsys.readouterr().out


def test_sources_name_each_route_once():
    from types import SimpleNamespace

    from snapkv_rag.rag.cli import _describe
    from snapkv_rag.rag.store import StoredChunk

    chunk = StoredChunk(id="a", text="t", source="f.md", title="Ferry", position=0, tokens=1, score=0.5)
    cites = [SimpleNamespace(number=1, route=r) for r in ("attributed", "attributed", "generated")]  # two sentences, one marker
    stats = SimpleNamespace(
        kept_tokens_per_layer=[],
        compression=None,
        compression_ratio=1.0,
        compression_ratio_text="1.00",
        prefill_seconds=0.1,
        decode_ms_per_token=None,
        segment_reuse=None,
        reused_prompt_tokens=0,
        policy_stats={},
    )
    context = SimpleNamespace(chunks=[chunk], document_tokens=1, budget_tokens=2, left_out=0, duplicates=0, settings={})
    answer = SimpleNamespace(
        citations=cites,
        sources=[(1, chunk)],
        invalid_citations=[],
        context=context,
        result=SimpleNamespace(stats=stats, usage=SimpleNamespace(prompt_tokens=5)),
        unsupported=[],
    )
    # chunks are numbered from 1, as in the app (position 0 is "chunk 1")
    assert "  [1] Ferry - f.md (chunk 1, similarity 0.50; attributed, generated)" in _describe(answer)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--collection", "missing"], "no collection 'missing'"),
        (["--collection", "x"], "not valid"),
        (["--collection", "notes", "--context-tokens", "999999", "--compression", "full"], "does not fit"),
        (["--collection", "notes", "--compression", "snapkv:window=questions"], "window (or 'question') must be"),
    ],
)
def test_ask_errors_exit_2_with_one_line(docs, tmp_path, model_dir, capsys, extra, message):
    store = str(tmp_path / "store")
    main(["ingest", str(docs), "--collection", "notes", "--store", store, "--json"])
    capsys.readouterr()
    assert main(["ask", "q?", "--store", store, "--model", model_dir, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapkv-rag: error:") and message in err and err.count("\n") == 1


def test_ingest_of_nothing_usable_fails_and_leaves_no_collection(docs, tmp_path, model_dir, capsys):
    (tmp_path / "only.bin").write_bytes(b"\x00")
    store = str(tmp_path / "s")
    assert main(["ingest", str(tmp_path / "only.bin"), "--collection", "empty", "--store", store, "--no-progress"]) == 1
    out = capsys.readouterr()
    assert "unsupported file type" in out.err and "no collection was created" in out.out
    assert main(["ask", "q?", "--collection", "empty", "--store", store, "--model", model_dir]) == 2
    assert "no collection 'empty'" in capsys.readouterr().err
    # a collection that already holds documents stays when a later ingest skips everything
    assert main(["ingest", str(docs), "--collection", "notes", "--store", store, "--no-progress"]) == 0
    assert main(["ingest", str(docs / "empty.md"), "--collection", "notes", "--store", store, "--json"]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["total_chunks"] == 2


def test_ask_reuses_chunk_kv_by_default_and_ingest_can_precompute_it(docs, tmp_path, model_dir, capsys):
    from pathlib import Path

    store = str(tmp_path / "store")
    assert main(["ingest", str(docs), "--collection", "notes", "--store", store, "--precompute-kv", "--model", model_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_computed"] == 2 and report["kv_dir"] == str(Path(store) / "kv-segments")
    args = ["ask", "When does the first ferry leave?", "--collection", "notes", "--store", store, "--model", model_dir, "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["segment_reuse"] == "blended" and (stats["segment_hits"], stats["segment_misses"]) == (2, 0)
    assert main([*args, "--kv-reuse", "off"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["segment_reuse"] is None and stats["reused_prompt_tokens"] == 0
    assert main([*args[:-1], "--recompute", "0"]) == 0
    assert "prompt tokens reused from stored chunk K/V, 0 recomputed; 2 chunks found, 0 computed now" in capsys.readouterr().out
    assert main([*args, "--recompute", "2"]) == 2
    assert "recompute must be a number in [0, 1]" in capsys.readouterr().err


def test_ask_on_an_empty_collection_says_so_before_loading_a_model(tmp_path, capsys):
    from snapkv_rag.rag import DocumentStore

    store = str(tmp_path / "store")
    DocumentStore("blank", path=store)  # made by hand: ingest leaves no empty collection
    assert main(["ask", "q?", "--collection", "blank", "--store", store, "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "collection 'blank' has no documents" in err and "no-such-model" not in err


def test_ask_skims_then_reads_and_says_what_the_skim_cost(docs, tmp_path, model_dir, capsys):
    store = str(tmp_path / "store")
    main(["ingest", str(docs), "--collection", "notes", "--store", store, "--json"])
    capsys.readouterr()
    args = ["ask", "When does the first ferry leave?", "--collection", "notes", "--store", store, "--model", model_dir, "--max-new-tokens", "2"]
    assert main([*args, "--skim-tokens", "400", "--context-tokens", "60"]) == 0
    out = capsys.readouterr().out
    assert "Skimmed 2 chunks (" in out and "Stuffed 1 chunks" in out
    assert main([*args, "--json", "--skim-tokens", "400", "--context-tokens", "60"]) == 0
    assert json.loads(capsys.readouterr().out)["context"]["skim"]["skimmed_documents"] == 2
    assert main([*args, "--skim-tokens", "0"]) == 2
    assert "skim_tokens must be a positive integer" in capsys.readouterr().err
    assert main([*args, "--skim-tokens", "400", "--whole-collection"]) == 2
    assert "whole_collection=True stuffs every chunk" in capsys.readouterr().err
