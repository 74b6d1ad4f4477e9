"""The app's intake is safe to expose (issue 31, item 2): a collection name is validated before
anything is written and is never used as a path, uploads stay under the uploads folder,
folder ingest is off unless the operator allows a root (and then stays inside it), and a
password, when set, is asked for before anything is shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from test_app import DOCS, app_env, page, start, texts, tiny_model_dir, upload  # noqa: E402,F401 (fixtures)

from snapkv_rag.rag.intake import IntakeError, Upload, folder_files, save_uploads, upload_folder  # noqa: E402


def new_collection(at, name: str):
    at.selectbox(key="collection_choice").set_value("+ New collection…")
    at.run()
    at.text_input(key="new_collection").input(name)
    return at.run()


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("name", ["ABSOLUTE", "my docs!", "../../escape", "a/b/c"])
def test_an_invalid_collection_name_writes_nothing_anywhere(app_env, name):
    outside = app_env / "outside"
    name = str(outside) if name == "ABSOLUTE" else name
    at = new_collection(start(), name)
    upload(at, {"tram.md": DOCS["tram.md"].encode()})
    assert "is not valid" in texts(at.error)
    assert not outside.exists()
    assert files_under(app_env / "uploads") == []
    assert not (app_env / "escape").exists()


def test_uploads_go_under_a_hashed_folder_and_bad_ones_are_never_written(tmp_path):
    saved = save_uploads(
        [Upload("ok.md", b"# fine"), Upload("empty.txt", b""), Upload("blob.txt", b"\x00\x01"), Upload("../up.md", b"x"), Upload(".hidden.md", b"x")],
        tmp_path / "uploads",
        "notes",
    )
    folder = upload_folder(tmp_path / "uploads", "notes")
    assert folder.parent == (tmp_path / "uploads").resolve() and "notes" not in folder.name
    assert saved[0] == folder / "ok.md" and [p.name for p in folder.iterdir()] == ["ok.md"]
    assert [s.reason.split(" (")[0] for s in saved[1:]] == ["empty file", "binary file", "not a valid file name", "not a valid file name"]
    assert not (tmp_path / "up.md").exists()


def test_folder_ingest_is_off_by_default(app_env):
    at = start()
    assert not [t for t in at.text_input if t.key == "folder"]
    assert "--allow-folder-root" in page(at)
    with pytest.raises(IntakeError, match="not enabled"):
        folder_files(str(app_env), None)


def test_folder_ingest_stays_inside_the_allowed_root(app_env, monkeypatch, tmp_path_factory):
    root = app_env / "allowed"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "tram.md").write_text(DOCS["tram.md"])
    secret = tmp_path_factory.mktemp("secret")
    (secret / "passwords.txt").write_text("root password is hunter2")
    os.symlink(secret / "passwords.txt", root / "docs" / "link.txt")
    monkeypatch.setenv("SNAPKV_RAG_APP_FOLDER_ROOT", str(root))
    at = start()
    for path in (str(secret), str(root / ".." / "allowed" / ".." / "uploads"), "/etc"):
        at.text_input(key="folder").input(path)
        at.button(key="add_folder").click()
        at.run()
        assert "outside the folder this server allows" in texts(at.error)
    at.text_input(key="folder").input(str(root / "docs"))
    at.button(key="add_folder").click()
    at.run()
    assert "Documents in notes: 1 file" in at.expander[0].label
    assert "links outside the allowed folder" in page(at)
    assert "hunter2" not in page(at)


def test_password_is_asked_before_anything(app_env, monkeypatch):
    monkeypatch.setenv("SNAPKV_RAG_APP_PASSWORD", "open sesame")
    at = start()
    assert not at.chat_input and not at.expander and not at.file_uploader
    at.text_input(key="password").input("wrong")
    at.button(key="login_button").click()
    at.run()
    assert "Wrong password" in texts(at.error) and not at.chat_input
    at.text_input(key="password").input("open sesame")
    at.button(key="login_button").click()
    at.run()
    assert at.chat_input(key="question") and "Documents in notes" in at.expander[0].label


def test_app_command_refuses_a_public_address_without_a_password(monkeypatch, capsys):
    from snapkv_rag.cli import main

    monkeypatch.delenv("SNAPKV_RAG_APP_PASSWORD", raising=False)
    assert main(["app", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "SNAPKV_RAG_APP_PASSWORD" in capsys.readouterr().err


@pytest.mark.parametrize("blank", ["   ", "\t\n"])
def test_app_command_refuses_a_whitespace_password_for_a_public_address(monkeypatch, capsys, blank):
    from snapkv_rag.cli import main

    monkeypatch.setenv("SNAPKV_RAG_APP_PASSWORD", blank)
    assert main(["app", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "only to whitespace" in capsys.readouterr().err
