"""One default compression for every interface, one rule for prompts past the window, and the typed
ways to change a policy (issue 73: no interface rebuilds a spec string or decides rolling by itself)."""

from __future__ import annotations

import pytest

from snapkv_rag.compression import (
    DEFAULT_COMPRESSION,
    LESS,
    ROLLING_CHUNK,
    FullCache,
    SnapKV,
    as_policy,
    can_roll,
    fit_to_window,
    parse_compression,
    reads_past_window,
)
from snapkv_rag.errors import InvalidCompressionError


def test_the_default_spec_names_the_one_object():
    assert parse_compression("default") is DEFAULT_COMPRESSION and as_policy(" Default ") is DEFAULT_COMPRESSION
    assert parse_compression(DEFAULT_COMPRESSION.spec()) == DEFAULT_COMPRESSION
    assert DEFAULT_COMPRESSION.needs_question_span and DEFAULT_COMPRESSION.max_capacity_prompt == 1024


def test_every_interface_defaults_to_the_one_compression(engine, tmp_path):
    """Asked of each interface as a user builds it, with no compression named."""
    from llama_index.llms.snapkv import SnapKVLLM

    from langchain_snapkv import ChatSnapKV
    from snapkv_rag.app.config import Settings
    from snapkv_rag.cli import build_parser
    from snapkv_rag.rag.qa import DocumentQA
    from snapkv_rag.server.app import ServerConfig

    parser = build_parser()
    for command in (["generate", "hi"], ["chat"], ["ask", "hi", "--collection", "c"]):
        assert as_policy(parser.parse_args(command).compression) is DEFAULT_COMPRESSION, command
    assert as_policy(parser.parse_args(["serve"]).compression) is DEFAULT_COMPRESSION
    assert DocumentQA(engine, store=_NoStore(), kv_reuse="off").compression is DEFAULT_COMPRESSION
    assert ServerConfig(engine).compression is DEFAULT_COMPRESSION
    assert as_policy(ChatSnapKV(engine=engine).compression) is DEFAULT_COMPRESSION
    assert as_policy(SnapKVLLM(engine).compression) is DEFAULT_COMPRESSION
    app = Settings("snapkv", DEFAULT_COMPRESSION.max_capacity_prompt, "question", 32, 1024, 96, 0.0, False)
    assert app.policy() is DEFAULT_COMPRESSION


class _NoStore:
    """DocumentQA reads nothing of its store before an ask."""

    embedder = None


def test_info_and_models_print_the_default(engine, capsys, monkeypatch):
    from fastapi.testclient import TestClient

    from snapkv_rag.server.app import ServerConfig, create_app

    with TestClient(create_app(ServerConfig(engine, model_id="tiny"))) as client:
        card = client.get("/v1/models").json()["data"][0]
    assert card["snapkv"]["compression"] == DEFAULT_COMPRESSION.spec()
    import snapkv_rag.cli as cli

    monkeypatch.setattr(cli, "load_engine", lambda args: engine)
    assert cli.main(["info"]) == 0
    assert DEFAULT_COMPRESSION.spec() in capsys.readouterr().out


def test_fit_to_window_is_the_one_rule():
    policy = SnapKV(max_capacity_prompt=128, window_size=16)
    assert fit_to_window(policy, 400, 100, 512) is policy  # fits
    assert fit_to_window(None, 40000, 100, 8192) is None and fit_to_window(FullCache(), 40000, 100, 8192) == FullCache()
    assert fit_to_window(policy, 40000, 100, 8192).rolling == ROLLING_CHUNK
    assert fit_to_window(policy, 4000, 100, 512).rolling == 512 - 128 - 16 - 100  # the chunk that still fits
    assert fit_to_window(policy.with_rolling(64), 4000, 100, 512).rolling == 64  # its own rolling= stands
    assert fit_to_window(policy, 4000, 400, 512) is policy  # not even 16 tokens fit: the engine refuses it
    assert fit_to_window(policy, 300, 1, 8192, chunk=2048, always=True).rolling == 2048  # the skim always rolls
    question = SnapKV(max_capacity_prompt=128, window_size="question", max_window=32)
    assert fit_to_window(question, 4000, 10, 512).rolling == 512 - 128 - 32 - 10  # the window's bound
    assert reads_past_window(policy, 500, 13, 512) and not reads_past_window(policy, 500, 12, 512)
    assert not reads_past_window(None, 5000, 1, 512) and not reads_past_window(policy, 5000, 1, None)
    assert can_roll(policy) and not can_roll(None) and not can_roll(FullCache()) and not can_roll(LESS(base=policy))


def test_typed_changes_replace_string_surgery():
    policy = DEFAULT_COMPRESSION
    assert policy.with_bits(None) is policy and policy.with_rolling(None) is policy and policy.with_settings(budget=1024) is policy
    four = policy.with_bits(4)
    assert four.kv_bits == 4 and parse_compression(four.spec()) == four
    assert policy.with_settings(budget=256, window=16, chunk=8) == parse_compression("snapkv:budget=256,window=16,chunk=8,chunk_from=2")
    assert FullCache().with_bits(8) == parse_compression("full:kv_bits=8")
    assert LESS(base=SnapKV(max_capacity_prompt=128)).with_bits(8).kv_bits == 8
    with pytest.raises(InvalidCompressionError, match="budget"):  # told in the names the user wrote
        policy.with_settings(budget=16)
    with pytest.raises(InvalidCompressionError, match="no setting 'windw'"):
        policy.with_settings(windw=3)
    with pytest.raises(InvalidCompressionError, match="rolling="):
        FullCache().with_rolling(64)


def test_token_runs_read_through_the_engines_worker(engine):
    """Engine.token_run is the harness's way in (no DecodeRun built outside the engine): its logits are the
    engine's own teacher forcing, and every forward of it runs on the engine's worker thread."""
    import threading

    import torch

    prompt = engine.tokenizer("The harbour ferry leaves at seven and returns at noon.")["input_ids"]
    continuation = [11, 12, 13]
    threads: list[str] = []
    hook = engine.model.register_forward_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    try:
        run = engine.token_run(prompt, compression="snapkv:budget=8,window=4", max_new_tokens=len(continuation))
        forced = run.teacher_force(continuation)
        decoded = engine.token_run(prompt, compression="snapkv:budget=8,window=4", max_new_tokens=3).decode()
    finally:
        hook.remove()
    assert threads and set(threads) == {"snapkv-rag-model"}
    assert run.kept_tokens_per_layer[0] == 8 and run.prompt_kv_bytes_kept > 0 and decoded["decode_ms_per_token"] > 0
    text = engine.tokenizer.decode(prompt, skip_special_tokens=True)
    scored = engine.score(text, continuation, compression="snapkv:budget=8,window=4", chat=False, prefix_cache=False)
    assert engine.count_tokens(text, chat=False) == len(prompt)  # the same ids either way: the same logits
    torch.testing.assert_close(forced.float(), scored.float())


def test_only_the_engine_runs_the_model_and_only_compression_decides_rolling():
    """Source checks (issue 73's targets): no DecodeRun built outside engine/, in the package or the
    benchmarks; no interface decides by itself whether a prompt rolls (it asks compression's rule)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [p for folder in ("snapkv_rag", "eval", "connectors", "apps") for p in (root / folder).rglob("*.py") if ".venv" not in p.parts]
    builds = [p for p in sources if "DecodeRun(" in p.read_text() and p.parent.name != "engine"]
    assert [str(p.relative_to(root)) for p in builds] == []
    deciding = re.compile(r"rolling\"?,? None\)? is not None|\.rolling is not None|def (rolled_if_needed|rolls)\(")
    own_rule = [p for p in sources if deciding.search(p.read_text()) and not {"compression", "engine"} & set(p.relative_to(root).parts)]
    assert [str(p.relative_to(root)) for p in own_rule] == []
