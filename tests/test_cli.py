"""The CLI on a tiny random model saved to disk."""

from __future__ import annotations

import io
import json

import pytest
from conftest import build_tokenizer, tiny_model

from snapkv_rag.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_generate_json(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--json", "--max-new-tokens", "5", "Hello world"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["usage"]["completion_tokens"] <= 5
    assert set(payload["stats"]) >= {"prefill_seconds", "decode_ms_per_token", "kept_tokens_per_layer", "prompt_kv_bytes_kept", "peak_memory_bytes"}


def test_generate_with_prompt_lookup_drafts(model_dir, capsys):
    args = ["generate", "--model", model_dir, "--json", "--max-new-tokens", "8", "--ignore-eos", "--prompt-lookup-num-tokens", "3"]
    assert main([*args, "Hello world, hello"]) == 0
    drafts = json.loads(capsys.readouterr().out)["stats"]["drafts"]
    assert drafts["prompt_lookup_num_tokens"] == 3 and "draft_forwards" in drafts


def test_generate_with_compression_from_stdin(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("The quick brown fox jumps over the lazy dog. " * 8))
    args = ["generate", "--model", model_dir, "--json", "--max-new-tokens", "3", "--compression", "snapkv:budget=24,window=8,kernel=3"]
    assert main(args) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["stats"]["kept_tokens_per_layer"] == [24, 24]
    assert payload["stats"]["compression"]["method"] == "snapkv"


def test_generate_with_kept_entries_in_fewer_bits(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("The quick brown fox jumps over the lazy dog. " * 30))
    sizes = {}
    for spec in ("snapkv:budget=200,window=8", "snapkv:budget=200,window=8,kv_bits=8"):
        assert main(["generate", "--model", model_dir, "--json", "--max-new-tokens", "3", "--compression", spec, "-"]) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        sizes[stats["compression"].get("kv_bits")] = stats["prompt_kv_bytes_kept"]
        monkeypatch.setattr("sys.stdin", io.StringIO("The quick brown fox jumps over the lazy dog. " * 30))
    assert sizes[8] < sizes[None]


def test_info_json(model_dir, capsys):
    assert main(["info", "--model", model_dir, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["num_layers"], data["num_query_heads"], data["num_kv_heads"], data["head_dim"]) == (2, 4, 2, 16)
    # bf16 by default on a CPU that computes it natively, fp32 elsewhere (issue 25)
    assert data["dtype"] == ("float32" if data["cpu_native_bf16"] == "no" else "bfloat16")
    assert data["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * {"float32": 4, "bfloat16": 2}[data["dtype"]]
    assert data["kv_bits"].startswith("8, 4 ")


def test_chat_reads_turns(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nHow are you?\n"))
    assert main(["chat", "--model", model_dir, "--json", "--max-new-tokens", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    assert lines[1]["usage"]["prompt_tokens"] > lines[0]["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "/no/such/dir", "hi"],
        ["generate", "--compression", "zip", "hi"],
        ["generate", "--max-new-tokens", "0", "hi"],
        ["generate", "   "],
        ["generate", "--prompt-lookup-num-tokens", "65", "hi"],
    ],
)
def test_errors_exit_2_with_one_message(args, model_dir, capsys):
    if "--model" not in args:
        args = [*args, "--model", model_dir]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapkv-rag: error:") and err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--dtype", "foo"], ["--device", "foo"], ["--device", "cuda:99"]])
def test_bad_device_or_dtype_exit_2(flags, model_dir, capsys):
    assert main(["generate", "--model", model_dir, *flags, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapkv-rag: error:") and err.count("\n") == 1


def test_stdin_trailing_newline_is_dropped(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello world\n"))
    assert main(["generate", "--model", model_dir, "--json", "--raw", "--max-new-tokens", "2"]) == 0
    with_newline = json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"]
    assert main(["generate", "--model", model_dir, "--json", "--raw", "--max-new-tokens", "2", "Hello world"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"] == with_newline


def test_broken_pipe_exits_quietly(model_dir):
    import subprocess
    import sys

    code = f"import sys; from snapkv_rag.cli import main; sys.exit(main(['generate', '--model', {model_dir!r}, '--max-new-tokens', '60', 'Hello world']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # like `| head -c 1`
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err
