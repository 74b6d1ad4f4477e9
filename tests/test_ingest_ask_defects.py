"""Defects a new user hit with ``snapkv-rag ingest``/``ask`` (issue 31): exit codes, silent
drops, noise, encodings, budgets that hold nothing, a mistyped store, chunk numbering."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_rag_cli import model_dir  # noqa: F401 (a tiny Llama saved to disk, shared fixture)

from snapkv_rag.cli import main
from snapkv_rag.rag.loaders import iter_files, load_file

FERRY = "# Ferry\n\nThe first ferry leaves the harbour at 6:40 on weekdays. Tickets cost 3.40 crowns."


@pytest.fixture()
def store_with_ferry(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ferry.md").write_text(FERRY)
    store = tmp_path / "store"
    assert main(["ingest", str(docs), "--collection", "notes", "--store", str(store), "--no-progress"]) == 0
    capsys.readouterr()
    return store


def test_ingest_of_a_missing_path_alone_exits_2(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["ingest", str(tmp_path / "nope.md"), "--collection", "notes", "--store", str(store)]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_ingest_with_a_missing_path_beside_a_good_file_exits_2_and_ingests_nothing(tmp_path, capsys):
    good = tmp_path / "good.md"
    good.write_text(FERRY)
    store = tmp_path / "store"
    code = main(["ingest", str(good), str(tmp_path / "typo.md"), "--collection", "notes", "--store", str(store), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "typo.md" in err and "nothing was ingested" in err
    assert not store.exists()  # refused before the store was opened


def test_jsonl_record_without_text_is_reported(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"text": "kept record"}\n{"title": "no text here"}\n\n{"text": "another"}\n')
    dropped = []
    docs = load_file(path, dropped=dropped)
    assert [d.text for d in docs] == ["kept record", "another"]
    assert len(dropped) == 1 and "line 2" in dropped[0].reason and "'text'" in dropped[0].reason


def test_hidden_file_in_a_folder_is_reported_not_dropped_silently(tmp_path):
    (tmp_path / "seen.txt").write_text("hello")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.txt").write_text("x")
    items = list(iter_files([tmp_path]))
    skipped = {os.path.basename(i.source): i.reason for i in items if not isinstance(i, os.PathLike)}
    assert set(skipped) == {".hidden.txt", ".git"}  # the hidden folder once, not each file under it
    assert "hidden file" in skipped[".hidden.txt"] and "hidden folder" in skipped[".git"]


def test_latin1_text_is_decoded(tmp_path):
    path = tmp_path / "cafe.txt"
    path.write_bytes("Café crème au lait, très bon. Le marché ouvre à neuf heures près du château.".encode("latin-1"))
    (doc,) = load_file(path)
    assert "Café crème" in doc.text and "château" in doc.text


def test_broken_pdf_is_one_skip_line_without_pypdf_noise(tmp_path, capsys):
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF")
    (tmp_path / "good.md").write_text(FERRY)
    code = subprocess.run(
        [sys.executable, "-m", "snapkv_rag.cli", "ingest", str(tmp_path), "--collection", "notes", "--store", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert code.returncode == 0, code.stderr
    lines = [line for line in code.stderr.splitlines() if line.strip() and "ingest" not in line.split(":")[0]]
    assert [line for line in lines if "broken.pdf" in line] and all("snapkv-rag:" in line for line in lines), code.stderr


def test_ask_with_a_budget_that_holds_no_chunk_exits_2(store_with_ferry, model_dir, capsys):
    code = main(["ask", "When does the ferry leave?", "--collection", "notes", "--store", str(store_with_ferry), "--model", model_dir, "--context-tokens", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "holds none of the" in err


def test_ask_with_a_mistyped_store_creates_nothing(tmp_path, model_dir, capsys):
    typo = tmp_path / "stroe"
    code = main(["ask", "When?", "--collection", "notes", "--store", str(typo), "--model", model_dir])
    assert code == 2 and "no store at" in capsys.readouterr().err
    assert not typo.exists()


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    description = capsys.readouterr().out.split("\n\n", 1)[1].split("positional arguments")[0]
    for command in ("ingest", "ask", "serve", "app", "eval", "less"):
        assert command in description


def test_a_short_latin1_word_is_not_read_as_cjk(tmp_path):
    path = tmp_path / "cafe.md"
    path.write_bytes("café".encode("latin-1"))
    (doc,) = load_file(path)
    assert doc.text == "café"
