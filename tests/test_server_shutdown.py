"""The server's shutdown under load (issue 51): SIGTERM with requests in flight.

Requests that wait for room stop at once, those generating get ``--shutdown-grace`` seconds;
every client hears why (a ``server_shutting_down`` error event, or a 503 with Retry-After),
none sees its connection cut, and the process exits 0. The :class:`Drain` rules are tested on
a stand-in stream first; then a real ``snapkv-rag serve`` process (tiny model) gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import build_tokenizer, free_port, tiny_model

from snapkv_rag.server.draining import Drain


class SlowStream:
    """Yields a piece every ``every`` seconds after ``first`` seconds; records its cancellation."""

    def __init__(self, first: float, every: float, pieces: int):
        self.first, self.every, self.pieces = first, every, pieces
        self.cancelled = False

    async def __aiter__(self):
        try:
            await asyncio.sleep(self.first)
            for i in range(self.pieces):
                yield str(i)
                await asyncio.sleep(self.every)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def read(drain: Drain, stream: SlowStream) -> tuple[list[str], str | None]:
    got: list[str] = []
    try:
        async for piece in drain.pieces(stream):
            got.append(piece)
    except Exception as exc:
        return got, getattr(exc, "code", repr(exc))
    return got, None


def test_drain_stops_waiting_requests_at_once_and_generating_ones_after_the_grace():
    async def scenario():
        drain = Drain(grace=0.3)
        waiting = SlowStream(first=5.0, every=0.01, pieces=3)  # no piece before the signal
        generating = SlowStream(first=0.0, every=0.05, pieces=1000)  # would run 50 s
        short = SlowStream(first=0.0, every=0.05, pieces=3)  # ends within the grace
        tasks = [asyncio.ensure_future(read(drain, s)) for s in (waiting, generating, short)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        drain.begin()
        (w_got, w_error), (g_got, g_error), (s_got, s_error) = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        took = time.monotonic() - started
        return waiting, generating, (w_got, w_error), (g_got, g_error), (s_got, s_error), took

    waiting, generating, (w_got, w_error), (g_got, g_error), (s_got, s_error), took = asyncio.run(scenario())
    assert (w_got, w_error) == ([], "server_shutting_down") and waiting.cancelled
    assert g_error == "server_shutting_down" and generating.cancelled and 5 < len(g_got) < 1000
    assert (s_got, s_error) == (["0", "1", "2"], None)
    assert 0.25 < took < 2.0


def test_drain_before_begin_passes_everything_through():
    async def scenario():
        return await read(Drain(grace=0.1), SlowStream(first=0.0, every=0.0, pieces=5))

    assert asyncio.run(scenario()) == (["0", "1", "2", "3", "4"], None)


def test_a_request_after_the_signal_gets_a_503_with_retry_after():
    from starlette.testclient import TestClient

    from snapkv_rag.server import ServerConfig, create_app

    class NoEngine:
        async def open(self, config, request):  # pragma: no cover - never reached
            raise AssertionError("a request during the shutdown reached the engine")

        async def health(self):
            return {"context_length": 512, "device": "cpu", "replicas": 1}

    app = create_app(ServerConfig(None, backend=NoEngine(), model_id="m"))
    app.state.drain.begun = True
    client = TestClient(app)
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "server_shutting_down"
    assert client.get("/health").json()["status"] == "shutting_down"


def test_bad_shutdown_grace_is_one_error(capsys):
    from snapkv_rag.cli import main

    assert main(["serve", "--shutdown-grace", "-1"]) == 2
    assert "--shutdown-grace must be 0-3600 seconds" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real process


@pytest.fixture()
def server_process(tmp_path):
    folder = tmp_path / "tiny-llama"
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer), context=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--model", str(folder), "--port", str(port), "--embedder", "none"]
    command += ["--served-model-name", "tiny", "--dtype", "float32", "--threads", "1", "--max-batch-size", "4", "--shutdown-grace", "1.5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.5)
    try:
        yield base, process, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _streamed(http: httpx.AsyncClient, base: str, body: dict) -> dict:
    events: list[dict] = []
    done = False
    async with http.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return {"status": status, "events": events, "done": done}


async def _plain(http: httpx.AsyncClient, base: str, body: dict) -> dict:
    response = await http.post(f"{base}/v1/chat/completions", json=body)
    return {"status": response.status_code, "body": response.json(), "retry_after": response.headers.get("retry-after")}


def test_sigterm_under_load_ends_every_request_cleanly_and_exits_0(server_process):
    base, process, log_path = server_process
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000, "ignore_eos": True}

    async def load():
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.ensure_future((_streamed if i % 2 else _plain)(http, base, body)) for i in range(16)]
            await asyncio.sleep(2.0)  # 4 rows decode, 12 wait for room
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, signalled

    results, signalled = asyncio.run(load())
    rc = process.wait(timeout=30)
    exited_after = time.monotonic() - signalled
    log = log_path.read_text()
    assert rc == 0, log[-3000:]
    assert exited_after < 1.5 + 5, exited_after
    assert "Traceback" not in log, log[-3000:]
    stopped = 0
    for result in results:
        assert not isinstance(result, BaseException), f"a client's connection was cut: {result!r}"
        if "events" in result:  # streamed: a 200 that ends with [DONE] or with the shutdown's error event
            assert result["status"] == 200
            last = result["events"][-1]
            if "error" in last:
                assert last["error"]["code"] == "server_shutting_down" and not result["done"]
                stopped += 1
            else:
                assert result["done"] and last["choices"][0]["finish_reason"] == "length"
        elif result["status"] == 503:
            assert result["body"]["error"]["code"] == "server_shutting_down" and result["retry_after"] == "5"
            stopped += 1
        else:
            assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "length"
    assert stopped >= 12, results  # at least the 12 that waited for room
