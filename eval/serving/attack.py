"""The review's attacks (issue 64) against a started ``snapkv-rag serve``: what each request got.

Not a test (tests/test_server_security.py reproduces each case in process). Starts
``snapkv-rag serve`` (the embedded model unless ``--model``; ``--api-key KEY`` to run every
request with a key, as a multi-tenant operator would) and sends, one case after another:
a request naming LESS kernels by path (two paths, compared: a probe learns nothing if both
answers are the same), a body sent as text/plain, a 0.7 MB ``anyOf`` schema, a 56K-token prompt
with ``rolling=``, 2,049 embedding inputs, an unauthenticated ``/metrics``, and, timed against
the same chat alone (medians of 3), a chat sent beside trickling clients (more than ``--max-queue``) and beside a
flood of 2,048-input embedding requests. The prefix-cache side channel (case 6): a victim's
prompt sent under its own ``cache_salt`` (keyless) or API key (keyed: the server gets a second key,
the attacker's), then the ``reused_prompt_tokens`` a wrong and a right guess get (both 0 when the
namespaces hold), and the victim's own repeat (reuse kept within one). Writes ``records.jsonl`` and ``table.md`` under ``--out``.

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval attack --out eval/serving/results/attack
    HF_HUB_OFFLINE=1 .venv/bin/python -m eval attack --api-key k3y --out eval/serving/results/attack_key
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path

import httpx

from eval.common.processes import start_serve
from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"
ATTACKER_KEY = "attacker-tenant-key"  # a second tenant's key on a keyed server
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8}


def chat_with(content: str, **extra) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": content}], **extra}


def outcome(response: httpx.Response) -> dict:
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {}
    return {"status": response.status_code, "code": error.get("code"), "message": (error.get("message") or "")[:160]}


def timed_chat(http: httpx.Client, base: str) -> float:
    started = time.perf_counter()
    response = http.post(base + "/v1/chat/completions", json=CHAT, timeout=300)
    response.raise_for_status()
    return time.perf_counter() - started


def median_chat(http: httpx.Client, base: str, times: int = 3) -> float:
    """The median of ``times`` chats one after another (one chat's time varies by ~20%)."""
    return statistics.median(timed_chat(http, base) for _ in range(times))


def trickling_sockets(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        sockets.append(s)
    return sockets


async def embeddings_flood(base: str, headers: dict, requests: int, stop: asyncio.Event) -> list[int]:
    async with httpx.AsyncClient(headers=headers, timeout=600) as http:

        async def one() -> int:
            statuses = []
            while not stop.is_set() and len(statuses) < requests:
                response = await http.post(base + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["a short text to embed"] * 2048})
                statuses.append(response.status_code)
            return statuses[-1] if statuses else 0

        return list(await asyncio.gather(*(one() for _ in range(2))))


def run_cases(base: str, port: int, headers: dict, max_queue: int, attacker_headers: dict | None = None) -> list[dict]:
    rows = []
    with httpx.Client(headers=headers, timeout=300) as http:

        def case(number: int, what: str, expect: str, response: httpx.Response, **extra) -> None:
            rows.append({"case": number, "what": what, "expect": expect, **outcome(response), **extra})

        for path in ("/etc/passwd", "/etc/nonexistent"):
            body = chat_with("hi", compression=f"less:base=snapkv,budget=256,kernels={path}")
            case(2, f"LESS kernels={path}", "400, the same for every path", http.post(base + "/v1/chat/completions", json=body))
        started = time.perf_counter()
        branches = [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(8000)]
        schema = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {"anyOf": branches}}}
        response = http.post(base + "/v1/chat/completions", json={**CHAT, "response_format": schema})
        case(7, "0.7 MB anyOf schema", "400 before compiling", response, seconds=round(time.perf_counter() - started, 2))
        text = json.dumps(CHAT).encode()
        case(8, "a body sent as text/plain", "415", http.post(base + "/v1/chat/completions", content=text, headers={"content-type": "text/plain"}))
        long_prompt = "word " * 56_000
        body = chat_with(long_prompt, compression="snapkv:budget=256,window=32,rolling=512")
        case(5, "56K-token prompt with rolling=512", "400 (over --max-prompt-tokens)", http.post(base + "/v1/chat/completions", json=body))
        inputs = {"model": "all-MiniLM-L6-v2", "input": ["x"] * 2049}
        case(4, "2,049 embedding inputs", "400", http.post(base + "/v1/embeddings", json=inputs))
        case(15, "/metrics without the key", "401 with --api-key, else 200", httpx.get(base + "/metrics"))

        timed_chat(http, base)  # warm-up
        alone = median_chat(http, base)
        slow = trickling_sockets(port, max_queue + 4)
        time.sleep(0.5)
        beside_slow = median_chat(http, base)
        for s in slow:
            s.close()
        rows.append(
            {
                "case": 3,
                "what": f"chat beside {len(slow)} trickling clients",
                "expect": "<= 2x alone",
                "status": 200,
                "seconds": round(beside_slow, 2),
                "alone": round(alone, 2),
                "ratio": round(beside_slow / alone, 2),
            }
        )

        async def beside_flood() -> tuple[float, list[int]]:
            stop = asyncio.Event()
            flood = asyncio.ensure_future(embeddings_flood(base, headers, 3, stop))
            await asyncio.sleep(1.0)
            seconds = await asyncio.get_running_loop().run_in_executor(None, median_chat, http, base)
            stop.set()
            return seconds, await flood

        beside, statuses = asyncio.run(beside_flood())
        rows.append(
            {
                "case": 4,
                "what": "chat beside 2 clients sending 2,048-input embeddings",
                "expect": "<= 2x alone",
                "status": 200,
                "seconds": round(beside, 2),
                "alone": round(alone, 2),
                "ratio": round(beside / alone, 2),
                "flood_statuses": statuses,
            }
        )

        # another client's prompt: its secret between two long parts (the reuse needs a long prefix,
        # and the question window at the end is recomputed whatever was stored)
        preamble = "You are the assistant of the harbour office. " * 20
        rules = "Answer politely, cite the timetable, and never invent departures. " * 20

        def victim(code: str) -> str:
            return preamble + f"The vault code is {code}. Never tell it to anyone. " + rules + "\nWhat time does the first ferry leave?"

        # the victim: its own salt on a keyless server, its own key on a keyed one (the attacker has another)
        victim_salt = {} if attacker_headers else {"cache_salt": "victim-session"}
        for _ in range(2):  # as a returning client would (a long compressed prompt is stored only when it repeats)
            http.post(base + "/v1/chat/completions", json=chat_with(victim("4417"), **victim_salt))
        expect = "0 reused for both guesses (the victim's namespace is not the attacker's)"
        for guess in ("9999", "4417"):
            reply = http.post(base + "/v1/chat/completions", json=chat_with(victim(guess)), headers=attacker_headers).json()
            reused = (reply.get("snapkv") or {}).get("reused_prompt_tokens")
            what = f"guess {guess} after another client's prompt" + (" (another API key)" if attacker_headers else " (no salt)")
            rows.append({"case": 6, "what": what, "expect": expect, "status": 200, "reused_prompt_tokens": reused})
        reply = http.post(base + "/v1/chat/completions", json=chat_with(victim("4417"), **victim_salt)).json()
        reused = (reply.get("snapkv") or {}).get("reused_prompt_tokens")
        rows.append({"case": 6, "what": "the victim's own repeat", "expect": "reuse kept within a namespace", "status": 200, "reused_prompt_tokens": reused})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-key", default=None, help="start the server with this key and send it with every request")
    parser.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue (the trickling clients outnumber it)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra option for snapkv-rag serve (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "attack")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serve_args = ["--model", args.model, "--max-queue", str(args.max_queue), *args.serve_arg]
    serve_args += ["--api-key", args.api_key, "--api-key", ATTACKER_KEY] if args.api_key else []
    process, base = start_serve(serve_args, args.out / "serve.log")
    port = int(base.rsplit(":", 1)[1])
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        attacker = {"Authorization": f"Bearer {ATTACKER_KEY}"} if args.api_key else {}
        rows = run_cases(base, port, headers, args.max_queue, attacker)
    finally:
        process.terminate()
        process.wait(30)
    records = [{"api_key": bool(args.api_key), **row} for row in rows]
    write_records(args.out, records)
    lines = [
        f"snapkv-rag serve --max-queue {args.max_queue}{' --api-key ...' if args.api_key else ''}; model {args.model}",
        "",
        "| case | request | expected | got | detail |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        detail = r.get("code") or ""
        if "ratio" in r:
            detail = f"{r['seconds']} s against {r['alone']} s alone ({r['ratio']}x)"
        elif "reused_prompt_tokens" in r:
            detail = f"reused {r['reused_prompt_tokens']} prompt tokens"
        elif "seconds" in r:
            detail += f", {r['seconds']} s"
        lines.append(f"| {r['case']} | {r['what']} | {r['expect']} | {r['status']} | {detail} |")
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
