"""The app's intake is safe to expose (issue 31, item 2): a collection name is validated before
anything is written and is never used as a path, uploads stay under the uploads folder,
folder ingest is off unless the operator allows a root (and then stays inside it), and a
password, when set, is asked for before anything is shown. The model is the operator's (issue
64, case 1): users choose only among the models offered at start, at most one engine is held per
offered model, and a failed load says nothing about the file system."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from streamlit.testing.v1 import AppTest  # noqa: E402
from test_app import (  # noqa: E402
    APP,
    DOCS,
    TIMEOUT,
    app_env,  # noqa: F401 (a fixture)
    ask,
    other_model_dir,  # noqa: F401 (a fixture)
    page,
    small_settings,
    start,
    texts,
    tiny_model_dir,  # noqa: F401 (a fixture)
    upload,
    with_documents,
)

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


# ----------------------------------------------------------------------------- issue 64, case 1: the model is the operator's
def model_fields(at) -> list:
    """Every sidebar widget that could take a model name typed by the user."""
    return [t for t in at.sidebar.text_input if t.key == "model" or "model" in t.label.lower()] + list(at.sidebar.text_area)


def test_the_sidebar_has_no_field_to_type_a_model(app_env, tiny_model_dir):
    at = start()
    assert not model_fields(at)
    assert not [s for s in at.sidebar.selectbox if s.key == "model"]  # one model: nothing to choose
    assert texts(at.sidebar.caption).startswith(tiny_model_dir.name) and "parameters" in texts(at.sidebar.caption)
    assert str(tiny_model_dir) not in page(at) + texts(at.sidebar.caption)  # named, not shown as a path


def test_two_offered_models_are_listed_by_name_and_switching_loads_the_other(app_env, monkeypatch, tiny_model_dir, other_model_dir):
    monkeypatch.setenv("SNAPKV_RAG_APP_MODELS", str(other_model_dir))
    at = start()
    assert not model_fields(at)
    choice = at.selectbox(key="model")
    assert choice.options == [tiny_model_dir.name, other_model_dir.name]  # exactly the offered models, by name
    assert choice.value == str(tiny_model_dir) and "context 512" in texts(at.sidebar.caption)
    choice.set_value(str(other_model_dir))
    at.run()
    assert not at.exception and not texts(at.sidebar.error)
    caption = texts(at.sidebar.caption)
    assert caption.startswith(other_model_dir.name) and "context 1,024" in caption  # the other engine
    at = small_settings(with_documents(at))
    ask(at, "When does the first ferry leave?")
    assert not at.chat_message[1].error and "prefill" in texts(at.chat_message[1].caption)
    at.selectbox(key="model").set_value(str(tiny_model_dir))
    at.run()
    assert texts(at.sidebar.caption).startswith(tiny_model_dir.name) and "context 512" in texts(at.sidebar.caption)


@pytest.mark.parametrize("offered", [1, 2])
def test_a_session_cannot_make_the_app_load_a_model_it_does_not_offer(app_env, monkeypatch, tiny_model_dir, other_model_dir, offered):
    """The widget's state is the only way in; a value the operator did not offer is not loaded."""
    if offered == 2:
        monkeypatch.setenv("SNAPKV_RAG_APP_MODELS", str(other_model_dir))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["model"] = str(app_env / "not-offered")
    at.run()
    assert not at.exception and not texts(at.sidebar.error) and not texts(at.error)
    assert texts(at.sidebar.caption).startswith(tiny_model_dir.name)
    assert not at.chat_input(key="question").disabled


def test_a_model_that_fails_to_load_says_nothing_about_the_file_system(app_env, monkeypatch, caplog):
    """A missing path, a file and a folder that holds no model fail alike: one message, the
    detail only in the log."""
    missing = app_env / "no-such-model"
    a_file = app_env / "just-text"
    a_file.write_text("root:x:0:0:root:/root:/bin/bash\n")
    a_folder = app_env / "nothing-here"
    a_folder.mkdir()
    bad = [missing, a_file, a_folder]
    monkeypatch.setenv("SNAPKV_RAG_APP_MODELS", ",".join(map(str, bad)))
    at = start()
    shown = {}
    for path in bad:
        at.selectbox(key="model").set_value(str(path))
        at.run()
        assert not at.exception, at.exception
        errors = texts(at.error)  # the sidebar's and the page's
        assert "could not be loaded" in errors and at.chat_input(key="question").disabled
        everything = page(at) + texts(at.sidebar.caption) + "".join(at.selectbox(key="model").options)
        assert not [str(p) for p in [*bad, app_env] if str(p) in everything]
        assert not [word for word in ("exist", "is a file", "directory", "folder", "not found", "no such") if word in errors.lower()]
        shown[path] = errors.replace(path.name, "NAME")
    assert len(set(shown.values())) == 1, shown  # nothing tells the three apart
    assert "model path does not exist" in caplog.text and str(missing) in caplog.text  # the operator's log has the detail


def test_engines_are_held_only_for_offered_names_and_at_most_one_per_offered_model(monkeypatch):
    import dataclasses
    import gc
    import uuid
    import weakref

    from snapkv_rag.app import config as ui_config

    class FakeEngine:
        pass

    loaded: list[str] = []
    alive: weakref.WeakSet = weakref.WeakSet()

    def from_pretrained(model, **options):
        loaded.append(model)
        engine = FakeEngine()
        alive.add(engine)
        return engine

    monkeypatch.setattr(ui_config.Engine, "from_pretrained", staticmethod(from_pretrained))
    a, b = (f"/models/case1-{uuid.uuid4().hex}/{name}" for name in "ab")
    cfg = ui_config.AppConfig(a, None, None, None, "/s", "/u", "c", allowed_models=(b, a, b))
    assert cfg.models == (a, b)
    for model in (a, b, a, b):
        ui_config.load_engine(cfg, model)
    assert loaded == [a, b]  # once per offered model
    for spelling in (a + "/", a + "/.", a.replace("/models/", "/models//"), a.replace("/a", "/../" + Path(a).parent.name + "/a"), "/etc/passwd", "/root/.ssh"):
        with pytest.raises(ui_config.ModelNotOffered):
            ui_config.load_engine(cfg, spelling)
    assert loaded == [a, b]  # another spelling of an offered path loads nothing
    other = dataclasses.replace(cfg, dtype="float32")  # new cache keys; still at most two engines held
    for model in (a, b):
        ui_config.load_engine(other, model)
    gc.collect()
    assert len(loaded) == 4 and len(alive) <= len(cfg.models)


def test_app_command_forwards_the_allowed_models():
    from snapkv_rag.app.cli import app_command
    from snapkv_rag.app.config import app_config
    from snapkv_rag.cli import build_parser

    command = app_command(build_parser().parse_args(["app", "--model", "/m", "--allow-model", "/models/a", "--allow-model", "org/b"]))
    after = command[command.index("--") + 1 :]
    assert after == ["--model", "/m", "--allow-model", "/models/a", "--allow-model", "org/b"]
    assert app_config(after).models == ("/m", "/models/a", "org/b")


def test_app_config_reads_the_offered_models_from_the_environment(monkeypatch):
    from snapkv_rag.app.config import AUTO_DOCUMENTS, app_config, model_names

    monkeypatch.setenv("SNAPKV_RAG_APP_MODEL", "/m")
    monkeypatch.setenv("SNAPKV_RAG_APP_MODELS", " /x , org/y,,/m ,/x")
    monkeypatch.delenv("SNAPKV_RAG_APP_ADAPTER", raising=False)
    assert app_config([]).models == ("/m", "/x", "org/y")
    assert app_config(["--allow-model", "/z"]).models == ("/m", "/z")  # the command line wins
    monkeypatch.delenv("SNAPKV_RAG_APP_MODELS")
    assert app_config([]).models == ("/m",)
    tuned = app_config(["--adapter", "/adapter", "--allow-model", "default"])
    assert (tuned.adapter_for("/m"), tuned.adapter_for("default")) == ("/adapter", AUTO_DOCUMENTS)  # an adapter goes with --model
    bare = app_config(["--base-model", "--allow-model", "default"])
    assert (bare.adapter_for("/m"), bare.adapter_for("default")) == (None, None)
    names = model_names(("default", "/a/model/", "/b/model", "org/Qwen2.5-7B", "x.gguf"))
    assert list(names.values()) == ["SmolLM2-135M-Instruct (embedded)", "model", "model (2)", "Qwen2.5-7B", "x.gguf"]
