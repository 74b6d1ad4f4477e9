"""Attacks on the server found by review (issue 64), each reproduced in process on a tiny model:
a web page's blind POST, an unauthenticated scrape of /metrics, and a 500 that told the client
what went wrong inside."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from snapkv_rag.server import ServerConfig, create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2}
KEY = {"Authorization": "Bearer k3y"}


@pytest.fixture(scope="module")
def plain(engine):
    with TestClient(create_app(ServerConfig(engine, model_id="tiny", compression="snapkv:budget=64"))) as client:  # one event loop for all requests
        yield client


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_a_web_page_can_send_without_a_preflight_is_refused_unread(plain, content_type):
    import json

    headers = {"content-type": content_type} if content_type else {}
    response = plain.post("/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_are_read(plain, content_type):
    import json

    response = plain.post("/v1/chat/completions", content=json.dumps(CHAT).encode(), headers={"content-type": content_type})
    assert response.status_code == 200, response.text


def test_the_size_bound_comes_before_the_media_type(engine):
    client = TestClient(create_app(ServerConfig(engine, model_id="tiny", max_request_bytes=100)))
    assert client.post("/v1/chat/completions", content=b"x" * 1000, headers={"content-type": "text/plain"}).status_code == 413


def test_metrics_sit_behind_the_api_key_unless_made_public(engine):
    guarded = TestClient(create_app(ServerConfig(engine, model_id="tiny", api_key="k3y")))
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/metrics", headers=KEY).status_code == 200
    assert guarded.get("/health").status_code == 200  # a load balancer's probe needs no key
    public = TestClient(create_app(ServerConfig(engine, model_id="tiny", api_key="k3y", public_metrics=True)))
    assert public.get("/metrics").status_code == 200
    assert public.post("/v1/chat/completions", json=CHAT).status_code == 401
    assert TestClient(create_app(ServerConfig(engine, model_id="tiny"))).get("/metrics").status_code == 200  # no key: nothing to guard


def test_the_public_metrics_option_reaches_the_server_config(engine):
    from snapkv_rag.cli import build_parser
    from snapkv_rag.server.config import build_config

    args = build_parser().parse_args(["serve", "--api-key", "k3y", "--public-metrics", "--embedder", "none"])
    assert build_config(args, engine=engine).public_metrics is True
    assert build_config(build_parser().parse_args(["serve", "--embedder", "none"]), engine=engine).public_metrics is False


class BrokenBackend:
    """A backend with a bug whose message holds what a client must not see."""

    async def open(self, config, request):
        raise RuntimeError("cannot read /srv/tenants/acme/secret-prompt.txt for user 42")

    async def health(self):
        return {"context_length": 512, "device": "cpu", "replicas": 1}


def test_a_server_bug_answers_with_an_id_and_logs_the_details(caplog):
    client = TestClient(create_app(ServerConfig(None, backend=BrokenBackend(), model_id="tiny")))
    with caplog.at_level(logging.ERROR, logger="snapkv_rag.server"):
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    error = response.json()["error"]
    assert "secret" not in response.text and "/srv" not in response.text and "RuntimeError" not in response.text
    assert error["type"] == "server_error" and error["code"].startswith("error-") and error["code"] in error["message"]
    logged = [r for r in caplog.records if error["code"] in r.getMessage()]
    assert logged and "secret-prompt.txt" in logging.Formatter().formatException(logged[0].exc_info)


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/nonexistent", "/root/.ssh", "snapkv_rag/compression/less/shipped"])
def test_a_request_cannot_make_the_server_open_a_path(plain, monkeypatch, path):
    """LESS kernels named in a request were loaded from the server's disk, and the error told a file
    from a folder from nothing: a file-system probe. Now every path gets the same 400, unopened."""
    import snapkv_rag.compression.less.kernels as kernels

    def never(*args, **kwargs):
        raise AssertionError("a request's path was opened")

    monkeypatch.setattr(kernels, "load_kernels", never)
    response = plain.post("/v1/chat/completions", json={**CHAT, "compression": f"less:base=snapkv,budget=256,kernels={path}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("compression", "unsupported_parameter")
    assert path not in error["message"] and "exist" not in error["message"] and "readable" not in error["message"]


def test_an_invalid_request_compression_is_a_400_before_anything_runs(plain):
    response = plain.post("/v1/chat/completions", json={**CHAT, "compression": "snapkv:budget=-3"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "compression"


def test_a_huge_schema_is_refused_by_its_size_before_it_is_compiled(plain, monkeypatch):
    import snapkv_rag.tools.constraints as constraints

    branches = [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(8000)]
    schema = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {"anyOf": branches}}}
    monkeypatch.setattr(constraints, "grammar_for", lambda spec: pytest.fail("a schema over the bound reached the grammar"))
    response = plain.post("/v1/chat/completions", json={**CHAT, "response_format": schema})  # 7.2 s of grammar compilation before
    assert response.status_code == 400 and response.json()["error"]["code"] == "schema_too_large"
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "x" * 100, "parameters": {"type": "object"}}} for i in range(1000)]
    response = plain.post("/v1/chat/completions", json={**CHAT, "tools": tools})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_slow_clients_hold_no_queue_place_and_are_cut_off(engine):
    """Two sockets trickling a body used to take both places of --max-queue 2 for as long as they
    liked: every real request got 429. Now a body is read before its request is admitted, within
    the body timeout."""
    import socket
    import time

    import httpx
    from conftest import running

    config = ServerConfig(engine, model_id="tiny", compression="snapkv:budget=64", max_queue=2, body_timeout=2.0)
    with running(config) as url:
        port = int(url.rsplit(":", 1)[1])
        slow = []
        for _ in range(4):  # more trickling sockets than queue places
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            slow.append(s)
        time.sleep(0.3)  # the server has accepted them and is waiting for their bodies
        response = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 200, response.text
        for s in slow:
            s.settimeout(10)
            answer = s.recv(65536).decode("latin-1")
            s.close()
            assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer


def test_a_slow_body_is_a_408_where_asyncio_has_its_own_timeout_class(plain, monkeypatch):
    """On Python 3.10 (the package supports it) asyncio.wait_for raises asyncio.TimeoutError, a class
    of its own there (an alias of TimeoutError from 3.11): catching TimeoutError alone answered 500."""
    import asyncio

    from snapkv_rag.server import app as app_module

    class Python310TimeoutError(Exception):
        """asyncio.TimeoutError as Python 3.10 defines it: no subclass of the builtin TimeoutError."""

    async def body_too_slow(awaitable, timeout):
        awaitable.close()
        raise asyncio.TimeoutError  # noqa: UP041 -- the patched 3.10 class, not the builtin

    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    monkeypatch.setattr(app_module.asyncio, "wait_for", body_too_slow)
    response = plain.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout", response.text


def test_rolling_cannot_take_a_prompt_past_the_servers_bound(engine):
    """``rolling=`` in a request read prompts of any length (a 56K-token prompt was a 400 alone and a
    200 rolled). Now a rolled prompt is held to --max-prompt-tokens, the model's context by default."""
    words = " ".join(f"w{i % 97}" for i in range(1500))  # well past the tiny model's 512-token context
    rolled = {**CHAT, "messages": [{"role": "user", "content": words}], "compression": "snapkv:budget=64,window=16,rolling=128"}
    with TestClient(create_app(ServerConfig(engine, model_id="tiny"))) as client:
        response = client.post("/v1/chat/completions", json=rolled)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert "--max-prompt-tokens" in response.json()["error"]["message"]
    with TestClient(create_app(ServerConfig(engine, model_id="tiny", max_prompt_tokens=100_000))) as client:
        assert client.post("/v1/chat/completions", json=rolled).status_code == 200  # the operator raised it


class FakeEmbedder:
    """What /v1/embeddings uses of an embedder: its limit, token_counts(), embed_array()."""

    max_tokens = 256

    def token_counts(self, texts):
        return [len(t.split()) for t in texts]

    def embed_array(self, texts):
        import numpy as np

        return np.tile(np.array([[1.0, 0.0]], dtype=np.float32), (len(texts), 1))


def test_embeddings_are_capped_and_queue_like_completions(engine):
    """3,000 inputs on /v1/embeddings ran on the engine's thread outside the queue and slowed a
    4-token chat from 0.29 s to 7.8 s. Now a list is capped (2,048, as OpenAI) and a request takes
    a place in the queue like a completion."""
    config = ServerConfig(engine, model_id="tiny", embedder=FakeEmbedder(), embedder_id="e", max_queue=1)
    with TestClient(create_app(config)) as client:
        response = client.post("/v1/embeddings", json={"model": "e", "input": ["x"] * 2049})
        assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_inputs"
        assert client.post("/v1/embeddings", json={"model": "e", "input": ["x"] * 2048}).status_code == 200
        client.app.state.in_flight = 1  # the one place is taken
        response = client.post("/v1/embeddings", json={"model": "e", "input": "x"})
        assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
        client.app.state.in_flight = 0
        assert client.post("/v1/embeddings", json={"model": "e", "input": "x"}).status_code == 200
        assert client.app.state.in_flight == 0  # released


def test_a_long_embedding_list_yields_the_engines_thread_between_batches():
    """Each batch of inputs is one call on the engine's thread, so decode steps run in between."""
    from snapkv_rag.rag import Embedder

    embedder = Embedder(batch_size=8)
    texts = [f"text number {i}" for i in range(30)]
    alone = embedder.embed(texts)
    calls = []
    embedder.runner = lambda fn: calls.append(fn) or fn()
    batched = embedder.embed(texts)
    assert len(calls) == 4  # 30 inputs in batches of at most 8
    assert len(batched) == 30 and all(a == pytest.approx(b, abs=1e-5) for a, b in zip(batched, alone))


def test_embeddings_take_smaller_batches_while_requests_decode():
    """Beside decoding requests a runner call holds BUSY_BATCH_SIZE texts (a chat beside a flood
    of 2,048-input requests took 3.4x its time alone with 32 a call)."""
    from snapkv_rag.rag import Embedder
    from snapkv_rag.rag.embeddings import BUSY_BATCH_SIZE

    embedder = Embedder(batch_size=32)
    assert embedder.dimension  # loaded before the runner is set
    sizes: list[int] = []
    embedder.runner = lambda fn: sizes.append(len(fn.args[0])) or fn()
    embedder.embed_array([f"t{i}" for i in range(64)])
    assert sizes == [32, 32]
    sizes.clear()
    embedder.busy = lambda: True
    out = embedder.embed_array([f"t{i}" for i in range(20)])
    assert sizes == [BUSY_BATCH_SIZE, BUSY_BATCH_SIZE, 20 - 2 * BUSY_BATCH_SIZE] and out.shape == (20, embedder.dimension)


def test_the_embeddings_body_is_the_openai_shape_in_floats_and_base64():
    import base64
    import json

    import numpy as np

    from snapkv_rag.server.protocol import embedding_response, json_bytes

    vectors = np.array([[0.1, -2.5, 3.0], [1e-8, 0.0, 1.0]], dtype=np.float32)
    floats = json.loads(json_bytes(embedding_response("e", vectors, "float", 7)))
    assert floats["data"][1] == {"object": "embedding", "index": 1, "embedding": pytest.approx([1e-8, 0.0, 1.0])}
    assert np.array(floats["data"][0]["embedding"], dtype=np.float32).tolist() == vectors[0].tolist()  # float32 round-trips
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    packed = json.loads(json_bytes(embedding_response("e", vectors, "base64", 7)))["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == vectors[0].tolist()


def test_background_work_goes_last_and_within_its_share_while_requests_decode():
    """Embeddings run as background tasks: a prefill queued after them goes first, and beside
    decoding requests they take at most BACKGROUND_SHARE of the decode steps' time."""
    import contextvars
    from types import SimpleNamespace

    from snapkv_rag.engine.scheduler import BACKGROUND_SHARE, Scheduler, _Task

    scheduler = Scheduler(model=None, max_batch_size=4)
    context = contextvars.copy_context()
    background, prefill = _Task(lambda: 1, 0, context, background=True), _Task(lambda: 2, 1, context)
    scheduler._tasks.extend([background, prefill])
    assert scheduler._next_task() is prefill
    scheduler._groups = [SimpleNamespace(rows=1)]  # a request decoding
    scheduler._decode_seconds, scheduler._background_seconds = 1.0, BACKGROUND_SHARE + 0.01
    assert scheduler._next_task() is None  # over its share: the decode step runs instead
    scheduler._background_seconds = BACKGROUND_SHARE - 0.01
    assert scheduler._next_task() is background
    scheduler._tasks.append(background)
    scheduler._groups, scheduler._background_seconds = [], 5.0  # nobody decoding: no share to keep
    assert scheduler._next_task() is background
