"""The server under load (issue 26): 32 concurrent clients mixing streaming, non-streaming, tool
calls, JSON output and clients that disconnect, on a tiny model over loopback.

Bounded: ``SNAPKV_RAG_SOAK_SECONDS`` (default 15 here; the documented full run uses 180) of
traffic. Checks: no 5xx, every completed answer equals the same request run alone, resident
memory bounded, requests really decoded together (``/metrics``). (A full queue's 429 is in
test_server.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import running, terse_bias, tiny_tool_engine

from snapkv_rag.model.peak_memory import current_rss_bytes
from snapkv_rag.server import ServerConfig

httpx = pytest.importorskip("httpx")

SOAK_SECONDS = float(os.environ.get("SNAPKV_RAG_SOAK_SECONDS", "15"))
CLIENTS = 32
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
PROMPTS = [f"Question {i}: what does the harbour office log each day?" + " More context." * (i % 4 * 5) for i in range(8)]


def request_body(kind: str, prompt: str) -> dict:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    if kind == "tools":
        body.update(tools=TOOLS, tool_choice="required", max_tokens=60)
    elif kind == "json":
        body.update(response_format={"type": "json_object"}, max_tokens=60)
    elif kind == "stream":
        body["stream"] = True
    return body


def engine_kwargs(body: dict) -> dict:
    kwargs = {"max_new_tokens": body["max_tokens"], "compression": "snapkv:budget=1024"}
    for key in ("tools", "tool_choice", "response_format"):
        if key in body:
            kwargs[key] = body[key]
    return kwargs


def answer_of(body: dict, payload: dict) -> tuple:
    message = payload["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message.get("content") or "", calls


async def stream_answer(http, base: str, body: dict, disconnect: bool) -> tuple | None:
    text = ""
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        assert response.status_code < 500, response.status_code
        if response.status_code == 429:
            return None
        seen = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["delta"].get("content") or "" if chunk.get("choices") else ""
            seen += 1
            if disconnect and seen >= 2:
                return None  # leaving the block closes the connection mid-stream
    return text, []


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


def test_thirty_two_clients_mixed_traffic(engine):
    engine.max_batch_size = 16
    rng = random.Random(0)
    outcomes: list[tuple[str, dict, tuple]] = []
    statuses: list[int] = []
    disconnects: list[bool] = []

    async def client(base: str, deadline: float, seed: int) -> None:
        local = random.Random(seed)
        async with httpx.AsyncClient(timeout=120) as http:
            while time.monotonic() < deadline:
                kind = local.choice(["stream", "stream", "plain", "tools", "json", "disconnect"])
                body = request_body("stream" if kind == "disconnect" else kind, local.choice(PROMPTS))
                if kind in ("stream", "disconnect"):
                    got = await stream_answer(http, base, body, disconnect=kind == "disconnect")
                    statuses.append(200)
                    disconnects.append(kind == "disconnect")
                    if got is not None:
                        outcomes.append((kind, body, got))
                    continue
                response = await http.post(f"{base}/v1/chat/completions", json=body)
                statuses.append(response.status_code)
                assert response.status_code < 500, response.text
                if response.status_code == 200:
                    outcomes.append((kind, body, answer_of(body, response.json())))

    config = ServerConfig(engine, model_id="m", max_queue=CLIENTS, embedder=None)
    with running(config) as base:

        async def main() -> str:
            deadline = time.monotonic() + 3  # warm-up: the grammar compiler, the thread pool
            await asyncio.gather(*(client(base, deadline, rng.random()) for _ in range(4)))
            rss_warm = current_rss_bytes()
            deadline = time.monotonic() + SOAK_SECONDS
            await asyncio.gather(*(client(base, deadline, rng.random()) for _ in range(CLIENTS)))
            growth = current_rss_bytes() - rss_warm
            print(f"\nsoak: {SOAK_SECONDS:.0f} s, {len(statuses)} requests, RSS {rss_warm / 2**20:.0f} MiB after warm-up, grew {growth / 2**20:+.0f} MiB")
            assert growth < 400 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB"
            async with httpx.AsyncClient() as http:
                return (await http.get(f"{base}/metrics")).text

        metrics = asyncio.run(main())
    assert statuses and all(s < 500 for s in statuses)
    kinds = {kind for kind, _, _ in outcomes}
    assert {"stream", "plain", "tools", "json"} <= kinds, kinds
    # every completed answer equals the same request run alone
    lone: dict[str, tuple] = {}
    for kind, body, got in outcomes:
        key = json.dumps(body, sort_keys=True)
        if key not in lone:
            result = engine.generate(body["messages"], **engine_kwargs(body))
            lone[key] = (result.text, [(c.name, c.arguments) for c in result.tool_calls])
        assert got == lone[key], (kind, body["messages"][0]["content"][:20])
    steps = float(re.search(r"^snapkv_decode_steps (\S+)$", metrics, re.M).group(1))
    rows = float(re.search(r"^snapkv_decoded_rows (\S+)$", metrics, re.M).group(1))
    counts = {k: sum(1 for kind, _, _ in outcomes if kind == k) for k in sorted(kinds)}
    print(f"soak: completed {counts}, {sum(disconnects)} disconnected mid-stream, {statuses.count(429)} got 429, mean decode batch {rows / steps:.1f}")
    assert rows / steps > 2, (rows, steps)  # requests really decoded together
    assert re.search(r'^snapkv_requests_total\{endpoint="chat",status="200"\} ', metrics, re.M)
    assert engine.scheduler_stats().running_requests == 0


class BlockedEmbedder:
    """An embedder whose every job waits for ``release``, as long 2,048-input calls hold their threads."""

    max_tokens = 512

    def __init__(self):
        self.release = threading.Event()

    def token_counts(self, texts: list[str]) -> list[int]:
        self.release.wait()
        return [len(text.split()) for text in texts]

    def embed_array(self, texts: list[str]):
        import numpy as np

        return np.zeros((len(texts), 4), dtype=np.float32)


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn in a thread (as conftest.running, with the app in the test's hands)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_chat_opens_while_embedding_jobs_hold_their_threads(engine):
    """Embedding jobs ran on the event loop's default pool, which opens every completion (renders and
    tokenizes its prompt): as many long embedding calls as its threads (6 on 2 cores) held every new
    chat before it was tokenized. Here more embedding jobs than that pool has threads are blocked
    while a chat is asked for: it opens and answers."""
    from snapkv_rag.server import create_app

    embedder = BlockedEmbedder()
    config = ServerConfig(engine, model_id="m", compression="snapkv:budget=64", embedder=embedder, embedder_id="emb", max_queue=128)
    app = create_app(config)
    jobs = min(32, (os.cpu_count() or 1) + 4) + 2  # the default pool's threads (asyncio's rule), and more
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2}
    with serving(app) as url, ThreadPoolExecutor(jobs) as clients:
        try:
            calls = [clients.submit(httpx.post, url + "/v1/embeddings", json={"model": "emb", "input": ["a b c"]}, timeout=300) for _ in range(jobs)]
            while app.state.in_flight < jobs:  # every job admitted, and so handed to its executor
                assert not any(call.done() for call in calls), [call.result().text for call in calls if call.done()]
                time.sleep(0.01)
            answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
            assert answer.status_code == 200, answer.text
            assert not any(call.done() for call in calls)  # the chat answered while every embedding job still waited
        finally:
            embedder.release.set()
        assert all(call.result().status_code == 200 for call in calls)
