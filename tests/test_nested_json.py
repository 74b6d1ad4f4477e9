"""A deeply nested JSON upload is one skipped file (issue 64, case 10).

A 100,000-level ``[[[...`` in a ``.json`` or ``.jsonl`` file made Python's JSON parser raise
RecursionError out of the loader: the whole batch stopped, the app showed a traceback and the
uploads stayed on disk. Now its nesting is measured before parsing (:data:`MAX_JSON_DEPTH`),
the file is skipped with that reason, the other files are ingested, and its upload is removed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapkv_rag.rag import loaders
from snapkv_rag.rag.intake import Upload, remove_skipped_uploads, save_uploads, upload_folder
from snapkv_rag.rag.loaders import MAX_JSON_DEPTH, Skipped, json_too_deep, load_file

DEEP = 100_000
DEEP_JSON = ("[" * DEEP + "]" * DEEP).encode()
DEEP_JSONL = (json.dumps({"text": "a flat record"}) + "\n" + "[" * DEEP + "]" * DEEP + "\n").encode()
GOOD_TEXT = "Harbour ferry. The first ferry leaves Marrowick at 6:40 on weekdays and the last one at 22:10."
GOOD_JSON = json.dumps([{"title": "Trams", "text": "Tram line 3 runs every 12 minutes from the station to the observatory."}]).encode()


def nested(depth: int) -> str:
    return json.dumps({"text": "kept", "meta": json.loads("[" * (depth - 1) + "]" * (depth - 1))})


def test_nesting_is_measured_without_parsing():
    assert not json_too_deep(nested(MAX_JSON_DEPTH))
    assert json_too_deep(nested(MAX_JSON_DEPTH + 1))
    assert json_too_deep(DEEP_JSON.decode()) and json_too_deep("{" * DEEP)  # unclosed as well
    assert not json_too_deep(json.dumps({"text": "[[[{{{" * 1000 + '\\"' * 100}))  # brackets inside strings do not count


@pytest.mark.parametrize(("name", "data", "where"), [("deep.json", DEEP_JSON, ""), ("deep.jsonl", DEEP_JSONL, "line 2 is ")])
def test_a_deeply_nested_file_is_skipped_with_its_reason(tmp_path, name, data, where):
    path = tmp_path / name
    path.write_bytes(data)
    skipped = load_file(path)
    assert isinstance(skipped, Skipped)
    assert skipped.reason == f"{where}nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects (the most a JSON record may nest)"
    flat = tmp_path / "flat.json"
    flat.write_text(nested(MAX_JSON_DEPTH))
    assert [d.text for d in load_file(flat)] == ["kept"]  # the limit itself is fine


def test_recursion_in_a_parser_is_a_skipped_file_too(tmp_path, monkeypatch):
    """The last resort: should a file get past the depth check, its RecursionError is still one skip."""
    monkeypatch.setattr(loaders, "json_too_deep", lambda text, limit=MAX_JSON_DEPTH: False)
    path = tmp_path / "deep.json"
    path.write_bytes(DEEP_JSON)
    skipped = load_file(path)
    assert isinstance(skipped, Skipped) and "nested too deeply" in skipped.reason


@pytest.fixture(scope="module")
def embedder():
    from snapkv_rag.rag import Embedder

    return Embedder()


def test_the_other_uploads_are_ingested_and_the_deep_ones_removed(tmp_path, embedder):
    from snapkv_rag.rag.store import DocumentStore

    uploads = [Upload("ferry.txt", GOOD_TEXT.encode()), Upload("deep.json", DEEP_JSON), Upload("trams.json", GOOD_JSON), Upload("deep.jsonl", DEEP_JSONL)]
    saved = save_uploads(uploads, tmp_path / "uploads", "notes")
    store = DocumentStore("notes", path=tmp_path / "chroma", embedder=embedder)
    report = store.ingest(saved)
    assert report.files == 2 and sorted(Path(f["file"]).name for f in store.files()) == ["ferry.txt", "trams.json"]
    assert sorted((Path(s.source).name, "nested deeper than" in s.reason) for s in report.skipped) == [("deep.json", True), ("deep.jsonl", True)]
    assert remove_skipped_uploads(saved, report.skipped) == 2
    assert sorted(p.name for p in upload_folder(tmp_path / "uploads", "notes").iterdir()) == ["ferry.txt", "trams.json"]


# ----------------------------------------------------------------------------- the app
pytest.importorskip("streamlit")
from test_app import app_env, page, start, texts, tiny_model_dir, upload  # noqa: E402,F401 (fixtures)


def test_the_app_reports_the_deep_upload_and_keeps_only_the_good_one(app_env):
    at = upload(start(), {"ferry.txt": GOOD_TEXT.encode(), "deep.json": DEEP_JSON})  # no exception in the page
    summary = texts(at.warning)
    assert "2 uploaded files" in summary and "1 files" in summary and "1 skipped" in summary
    assert "deep.json" in page(at) and f"nested deeper than {MAX_JSON_DEPTH} levels" in page(at)
    assert "Documents in notes: 1 file," in at.expander[0].label
    assert [p.name for p in upload_folder(app_env / "uploads", "notes").iterdir()] == ["ferry.txt"]


def test_an_ingest_that_stops_leaves_no_upload_behind(app_env, monkeypatch):
    from snapkv_rag.rag.store import DocumentStore, StoreUnavailableError

    at = upload(start(), {"ferry.txt": GOOD_TEXT.encode()})
    folder = upload_folder(app_env / "uploads", "notes")
    assert [p.name for p in folder.iterdir()] == ["ferry.txt"]

    def failing(self, paths, **kwargs):
        raise StoreUnavailableError("the Chroma server went away")

    monkeypatch.setattr(DocumentStore, "ingest", failing)
    upload(at, {"ferry.txt": b"A new version of the ferry times.", "library.md": b"# Library\n\nOpen at 9:00."})
    assert "the Chroma server went away" in texts(at.error)
    assert [p.name for p in folder.iterdir()] == ["ferry.txt"]  # the new upload is gone, the file the collection holds stays
