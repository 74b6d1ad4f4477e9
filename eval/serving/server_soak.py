"""Does a long-running server's memory plateau? A soak of ``snapkv-rag serve`` (issue 51).

Not a test. Starts ``snapkv-rag serve`` (the embedded model unless ``--model``) as its own
process and runs ``--clients`` concurrent clients for ``--minutes``, after ``--warmup``
seconds of the same traffic: prompts of about 40, 600, 2,000 and 4,500 tokens, each opening
with its own number (so the prefix cache keeps filling with new entries and every prefill has a
new shape), streamed and plain replies, tool calls, JSON output and clients that leave
mid-stream. Every 15 s it samples the server's resident memory (/proc) and its ``/metrics``
(the allocator's and the caches' bytes). Then it idles for a minute, and at the end sends
SIGTERM with requests in flight, and records how each ended and the exit code.

Reports RSS after the warm-up and after each minute, the growth over the last half of the soak
(a plateau: near 0), and what the allocator holds free. Writes ``records.jsonl`` and ``table.md`` under ``--out``.

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval server_soak --clients 32 --minutes 12 --out eval/serving/results/server_soak
    # the same traffic with another allocator setting (the server's default is bounded_allocator):
    ... --serve-env SNAPKV_RAG_MALLOC=system --out eval/serving/results/server_soak_system
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from eval.common.processes import start_serve
from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"


SENTENCE = "The harbour office logs each ferry's departure, its cargo, the crew on duty and the weather at the pier. "
LENGTHS = {"short": 1, "medium": 25, "long": 85, "very long": 190}  # sentences: about 40, 600, 2,000, 4,500 tokens
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
METRICS = (
    "snapkv_process_resident_bytes",
    "snapkv_malloc_in_use_bytes",
    "snapkv_malloc_free_bytes",
    "snapkv_prefix_cache_bytes",
    "snapkv_chunk_kv_bytes",
    "snapkv_kv_bytes_in_use",
    "snapkv_requests_running",
    "snapkv_malloc_trims_total",
    "snapkv_malloc_trim_seconds_total",
)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for name in METRICS:
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        if match:
            values[name] = float(match.group(1))
    statuses: dict[str, float] = {}
    for match in re.finditer(r'^snapkv_requests_total\{endpoint="chat",status="(\d+)"\} (\S+)$', text, re.M):
        statuses[match.group(1)] = float(match.group(2))
    values["requests_by_status"] = statuses  # type: ignore[assignment]
    return values


def request_body(rng: random.Random, serial: int) -> tuple[dict, str]:
    size = rng.choices(list(LENGTHS), weights=(4, 3, 2, 1))[0]
    kind = rng.choices(["plain", "stream", "leave", "tools", "json"], weights=(3, 3, 1, 1, 1))[0]
    prompt = f"Report {serial}. " + SENTENCE * LENGTHS[size] + "What does the office log?"
    body: dict = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.choice((16, 32, 64)), "temperature": 0}
    if kind == "tools":
        body.update(tools=TOOLS, tool_choice="required", max_tokens=64)
    elif kind == "json":
        body.update(response_format={"type": "json_object"}, max_tokens=64)
    elif kind in ("stream", "leave"):
        body["stream"] = True
    return body, kind


async def one_request(http: httpx.AsyncClient, base: str, body: dict, kind: str) -> str:
    if not body.get("stream"):
        response = await http.post(base + "/v1/chat/completions", json=body)
        return str(response.status_code)
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        pieces = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"error"' in line:
                return "error-event"
            pieces += line.startswith("data: ")
            if kind == "leave" and pieces >= 3:
                return "left"
    return "200"


async def clients(base: str, count: int, seconds: float, seed: int, outcomes: dict[str, int]) -> None:
    deadline = time.monotonic() + seconds
    serial = [seed * 1_000_000]

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=600) as http:
            while time.monotonic() < deadline:
                serial[0] += 1
                body, kind = request_body(rng, serial[0])
                try:
                    outcome = await one_request(http, base, body, kind)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(client(i) for i in range(count)))


async def sampled(process: subprocess.Popen, base: str, phase: str, seconds: float, samples: list[dict], started: float, work=None) -> None:
    task = asyncio.ensure_future(work) if work is not None else None
    end = time.monotonic() + seconds
    while True:
        sample = {"phase": phase, "t": round(time.monotonic() - started, 1), "rss": rss_bytes(process.pid)}
        try:
            sample.update(await asyncio.get_running_loop().run_in_executor(None, scrape, base))
        except httpx.HTTPError:
            pass
        samples.append(sample)
        print(
            f"  {phase:7} t={sample['t']:7.1f}s rss={sample['rss'] / 2**30:.2f} GiB "
            + " ".join(f"{k[7:]}={v / 2**20:.0f}M" for k, v in sample.items() if k.endswith("bytes") and isinstance(v, float)),
            flush=True,
        )
        if time.monotonic() >= end and (task is None or task.done()):
            break
        await asyncio.sleep(15)
    if task is not None:
        await task


async def sigterm_under_load(process: subprocess.Popen, base: str, requests: int) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell a long story about the harbour."}], "max_tokens": 400, "ignore_eos": True}
    endings: dict[str, int] = {}

    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            try:
                if i % 2:
                    response = await http.post(base + "/v1/chat/completions", json=body)
                    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
                    outcome = f"{response.status_code} {code or ''}".strip()
                    if response.status_code == 503:
                        outcome += f" retry-after={response.headers.get('retry-after')}"
                else:
                    outcome = "stream cut"
                    async with http.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as response:
                        async for line in response.aiter_lines():
                            if line == "data: [DONE]":
                                outcome = "stream [DONE]"
                            elif line.startswith("data: {") and '"error"' in line:
                                outcome = f"stream error event {json.loads(line[6:])['error']['code']}"
            except httpx.HTTPError as exc:
                outcome = f"cut ({type(exc).__name__})"
            endings[outcome] = endings.get(outcome, 0) + 1

    tasks = [asyncio.ensure_future(one(i)) for i in range(requests)]
    await asyncio.sleep(8)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    await asyncio.gather(*tasks)
    rc = await asyncio.get_running_loop().run_in_executor(None, process.wait, 60)
    return {"requests": requests, "endings": endings, "exit_code": rc, "exit_seconds": round(time.monotonic() - signalled, 1)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval server_soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=120, help="seconds of traffic before the soak is measured")
    parser.add_argument("--minutes", type=float, default=12)
    parser.add_argument("--idle", type=float, default=60)
    parser.add_argument("--serve-env", action="append", default=[], help="NAME=VALUE for the server's environment (repeatable)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra option for snapkv-rag serve (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "server_soak")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(item.split("=", 1) for item in args.serve_env)}
    process, base = start_serve(["--model", args.model, *args.serve_arg], args.out / "serve.log", env)
    try:
        samples: list[dict] = []
        outcomes: dict[str, int] = {}
        started = time.monotonic()
        samples.append({"phase": "start", "t": 0.0, "rss": rss_bytes(process.pid), **scrape(base)})

        async def run() -> dict:
            await sampled(process, base, "warmup", args.warmup, samples, started, clients(base, args.clients, args.warmup, 1, outcomes))
            await sampled(process, base, "soak", args.minutes * 60, samples, started, clients(base, args.clients, args.minutes * 60, 2, outcomes))
            await sampled(process, base, "idle", args.idle, samples, started)
            return await sigterm_under_load(process, base, 16)

        shutdown = asyncio.run(run())
    finally:
        if process.poll() is None:
            process.kill()
    report = summarize(samples, outcomes, shutdown, args)
    write_records(args.out, [{"samples": samples, "outcomes": outcomes, "shutdown": shutdown, **report}])
    write_table(args.out, report["table"])
    return 0


def summarize(samples: list[dict], outcomes: dict[str, int], shutdown: dict, args: argparse.Namespace) -> dict:
    gib = 2**30
    soak = [s for s in samples if s["phase"] == "soak"]
    warm = [s for s in samples if s["phase"] == "warmup"][-1]
    half = soak[len(soak) // 2]
    last, idle = soak[-1], [s for s in samples if s["phase"] == "idle"][-1]
    growth_second_half = last["rss"] - half["rss"]
    table = [
        f"Server soak: {args.clients} clients, {args.warmup:.0f} s warm-up, {args.minutes:g} min measured, model {args.model}, "
        f"env {' '.join(args.serve_env) or '(default)'}",
        "",
        "| when | t (s) | RSS (GiB) | malloc in use (GiB) | malloc free, held (GiB) | prefix cache (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for s in [samples[0], warm, *soak[3::4], last, idle]:
        table.append(
            f"| {s['phase']} | {s['t']:.0f} | {s['rss'] / gib:.2f} | {s.get('snapkv_malloc_in_use_bytes', 0) / gib:.2f} | "
            f"{s.get('snapkv_malloc_free_bytes', 0) / gib:.2f} | {s.get('snapkv_prefix_cache_bytes', 0) / gib:.2f} |"
        )
    table += [
        "",
        f"RSS after warm-up {warm['rss'] / gib:.2f} GiB, after the soak {last['rss'] / gib:.2f} GiB, idle {idle['rss'] / gib:.2f} GiB; "
        f"growth over the soak's second half {growth_second_half / 2**20:+.0f} MiB.",
        f"Requests: {json.dumps(dict(sorted(outcomes.items())))}.",
        f"SIGTERM with {shutdown['requests']} in flight: exit code {shutdown['exit_code']} after {shutdown['exit_seconds']} s; "
        f"endings {json.dumps(dict(sorted(shutdown['endings'].items())))}.",
    ]
    return {"rss_after_warmup": warm["rss"], "rss_after_soak": last["rss"], "rss_idle": idle["rss"], "growth_second_half": growth_second_half, "table": table}


if __name__ == "__main__":
    raise SystemExit(main())
