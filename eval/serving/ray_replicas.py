"""Replicas on Ray Serve (issue 27): 1 engine x 2 threads against 2 x 1, affinity against round-robin.

Replicas on Ray Serve (issue 27): one engine with 2 threads against 2 replicas with 1 thread
each, and cache-affinity routing against round-robin, on the embedded model.

Not a test. For each setting it starts ``snapkv-rag serve`` as users do (a subprocess on
loopback), then ``--clients`` streaming clients each hold ``--conversations`` conversations and
take turns between them: a long opening (``--opening`` tokens of documents, a different set
per conversation) and ``--follow-ups`` follow-ups, each repeating the whole history (the
answers included) plus a short new question, ``--tokens`` new tokens per turn (``ignore_eos``).
Reports per setting: the share of each follow-up's prompt tokens whose K/V came from a cache
(the replica's prefix cache), how many follow-ups ran on the replica of their conversation's
previous turn, TTFT p50/p95 for openings and follow-ups, and aggregate completion tokens/s
over the wall time.

    .venv/bin/python -m eval ray_replicas --out eval/serving/results/ray_replicas
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval.common.results_io import write_records, write_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

# name, replicas, threads per engine, routing; "1 engine" is the plain single-process server
SETTINGS = [
    ("1 engine x 2 threads (no Ray)", 1, 2, None),
    ("1 replica x 2 threads on Ray", 1, 2, "affinity"),
    ("2 replicas x 1 thread, affinity", 2, 1, "affinity"),
    ("2 replicas x 1 thread, round-robin", 2, 1, "round-robin"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openings(count: int, tokens: int) -> list[str]:
    """``count`` different document sets of about ``tokens`` tokens (4 characters a token)."""
    docs = [f"## {p.stem}\n{p.read_text()}" for p in sorted((ROOT / "examples" / "sample_corpus").glob("*"))]
    per = tokens * 4
    out = []
    for i in range(count):
        text, k = "", i
        while len(text) < per:
            text += docs[k % len(docs)] + "\n\n"
            k += count
        out.append("Documents:\n" + text[:per] + "\n\nQuestion: what is the first document about?")
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def turn(http, base: str, messages: list[dict], tokens: int) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first, text, stats = None, "", None
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-snapkv-replica", "local")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter()
                text += delta
            stats = chunk.get("snapkv") or stats
    assert stats is not None
    return {
        "ttft": (first or time.perf_counter()) - sent,
        "answer": text,
        "replica": replica,
        "prompt_tokens": stats["prompt_tokens_padded"],
        "reused": stats["reused_prompt_tokens"],
        "completion_tokens": stats["decode_steps"] + 1,
    }


async def client(base: str, conversations: list[str], follow_ups: int, tokens: int, records: list[dict], setting: str) -> None:
    import httpx

    histories = [[{"role": "user", "content": opening}] for opening in conversations]
    last_replica: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=900) as http:
        for step in range(follow_ups + 1):
            for c, history in enumerate(histories):  # the conversations take turns
                record = await turn(http, base, history, tokens)
                history += [{"role": "assistant", "content": record.pop("answer")}, {"role": "user", "content": f"Follow-up {step + 1}: and the next one?"}]
                record.update(setting=setting, step=step, same_replica=last_replica.get(c) == record["replica"])
                last_replica[c] = record["replica"]
                records.append(record)


def start_server(replicas: int, threads: int, routing: str | None, port: int, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--port", str(port), "--threads", str(threads), "--embedder", "none"]
    if routing is not None:
        command += ["--replicas", str(replicas), "--routing", routing]
        if replicas == 1:
            command += ["--ray-address", "local"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(base: str, replicas: int, process: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).json().get("replicas") == replicas:
                return
        except Exception:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval ray_replicas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=2, help="conversations per client, taking turns")
    parser.add_argument("--opening", type=int, default=1200, help="document tokens in each conversation's opening")
    parser.add_argument("--follow-ups", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per turn (ignore_eos)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ray_replicas")
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = openings(args.clients * args.conversations, args.opening)
    records: list[dict] = []
    walls: dict[str, float] = {}
    for name, replicas, threads, routing in SETTINGS:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = start_server(replicas, threads, routing, port, Path(tempfile.gettempdir()) / f"snapkv-ray-replicas-{len(walls)}.log")
        try:
            wait_ready(base, replicas, process)
            mine: list[dict] = []
            started = time.perf_counter()

            async def run_clients() -> None:
                per = args.conversations
                jobs = [client(base, texts[i * per : (i + 1) * per], args.follow_ups, args.tokens, mine, name) for i in range(args.clients)]  # noqa: B023
                await asyncio.gather(*jobs)

            asyncio.run(run_clients())
            walls[name] = time.perf_counter() - started
            records += mine
            write_records(args.out, records)
            print(f"{name}: {len(mine)} requests in {walls[name]:.0f} s", flush=True)
        finally:
            stop_server(process)
    lines = [
        f"{args.clients} clients x {args.conversations} conversations, ~{args.opening}-token openings, {args.follow_ups} follow-ups each, "
        f"{args.tokens} new tokens per turn; server default compression (snapkv:budget=1024), bf16.",
        "",
        "| setting | follow-up prompt tokens reused | follow-ups on their previous replica | TTFT p50 / p95, openings (s) "
        "| TTFT p50 / p95, follow-ups (s) | aggregate tok/s | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, *_ in SETTINGS:
        mine = [r for r in records if r["setting"] == name]
        if not mine:
            continue
        opening_ttft = [r["ttft"] for r in mine if r["step"] == 0]
        follow = [r for r in mine if r["step"] > 0]
        reused = sum(r["reused"] for r in follow) / max(1, sum(r["prompt_tokens"] for r in follow))
        same = sum(r["same_replica"] for r in follow)
        tokens = sum(r["completion_tokens"] for r in mine)
        follow_ttft = [r["ttft"] for r in follow]
        lines.append(
            f"| {name} | {reused:.0%} | {same}/{len(follow)} | {statistics.median(opening_ttft):.2f} / {percentile(opening_ttft, 0.95):.2f} "
            f"| {statistics.median(follow_ttft):.2f} / {percentile(follow_ttft, 0.95):.2f} | {tokens / walls[name]:.1f} | {walls[name]:.0f} |"
        )
    write_table(args.out, lines)


if __name__ == "__main__":
    raise SystemExit(main())
