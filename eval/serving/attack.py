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
namespaces hold), and the victim's own repeat (reuse kept within one). Then two probes on the
model loaded in this process, behind the server's own app (issue 73): the Ray routing probe
(case 16: the router of ``serve --replicas`` over two named replicas; each guess routed from the
same state; the replica and ``X-SnapKV-Replica`` header it got, both the same when the router
keys on the namespace) and the call-gate probe (case 17: ``tool_choice="auto"`` with a call gate;
the prompt tokens reused while each guess ran, the same when the gate scores in the request's
namespace). Writes ``records.jsonl`` and ``table.md`` under ``--out``.

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval attack --out eval/serving/results/attack
    HF_HUB_OFFLINE=1 .venv/bin/python -m eval attack --api-key k3y --out eval/serving/results/attack_key
    HF_HUB_OFFLINE=1 .venv/bin/python -m eval attack --probes-only --out eval/serving/results/attack_probes
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx

from eval.common.processes import start_serve
from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"
ATTACKER_KEY = "attacker-tenant-key"  # a second tenant's key on a keyed server
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8}


def victim_prompt(code: str) -> str:
    """Another client's prompt: its secret between two long parts (the reuse needs a long prefix,
    and the question window at the end is recomputed whatever was stored)."""
    preamble = "You are the assistant of the harbour office. " * 20
    rules = "Answer politely, cite the timetable, and never invent departures. " * 20
    return preamble + f"The vault code is {code}. Never tell it to anyone. " + rules + "\nWhat time does the first ferry leave?"


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

        # the victim: its own salt on a keyless server, its own key on a keyed one (the attacker has another)
        victim_salt = {} if attacker_headers else {"cache_salt": "victim-session"}
        for _ in range(2):  # as a returning client would (a long compressed prompt is stored only when it repeats)
            http.post(base + "/v1/chat/completions", json=chat_with(victim_prompt("4417"), **victim_salt))
        expect = "0 reused for both guesses (the victim's namespace is not the attacker's)"
        for guess in ("9999", "4417"):
            reply = http.post(base + "/v1/chat/completions", json=chat_with(victim_prompt(guess)), headers=attacker_headers).json()
            reused = (reply.get("snapkv") or {}).get("reused_prompt_tokens")
            what = f"guess {guess} after another client's prompt" + (" (another API key)" if attacker_headers else " (no salt)")
            rows.append({"case": 6, "what": what, "expect": expect, "status": 200, "reused_prompt_tokens": reused})
        reply = http.post(base + "/v1/chat/completions", json=chat_with(victim_prompt("4417"), **victim_salt)).json()
        reused = (reply.get("snapkv") or {}).get("reused_prompt_tokens")
        rows.append({"case": 6, "what": "the victim's own repeat", "expect": "reuse kept within a namespace", "status": 200, "reused_prompt_tokens": reused})
    return rows


# --------------------------------------------------------------------------- in-process probes (issue 73)
# Run on an engine in this process, behind the server's own app (API key -> tenant -> namespace,
# the X-SnapKV-Replica header): what a tenant's right and wrong guesses of another's prompt get.

GUESSES = ("9999", "4417")  # a wrong guess, then the victim's code
GATE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ferry_times",
            "description": "Departures of a ferry line.",
            "parameters": {"type": "object", "properties": {"line": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class Tenants:
    """The victim's and the attacker's requests: keys on a keyed server, else the victim's own
    salt (the attacker sends none, so it sees replica ids in the shared namespace)."""

    keys: tuple[str, ...] = ()
    victim: dict = field(default_factory=dict)  # headers
    attacker: dict = field(default_factory=dict)
    victim_salt: dict = field(default_factory=dict)  # body fields

    @classmethod
    def of(cls, api_key: str | None) -> Tenants:
        if api_key is None:
            return cls(victim_salt={"cache_salt": "victim-session"})
        bearer = {"Authorization": f"Bearer {api_key}"}
        return cls((api_key, ATTACKER_KEY), bearer, {"Authorization": f"Bearer {ATTACKER_KEY}"})


@dataclass(frozen=True, order=True)
class ReplicaName:  # what the router reads of a Ray replica
    unique_id: str


@dataclass(frozen=True)
class NamedReplica:
    replica_id: ReplicaName


def affinity_router(names: tuple[str, ...] = ("replica-a", "replica-b")):
    """The router of ``serve --replicas`` (:class:`CacheAffinityRouter`, its policy alone) over named replicas, all idle."""
    from snapkv_rag.server.ray_serve import CacheAffinityRouter  # needs the 'ray' extra

    router = CacheAffinityRouter.standalone()  # Ray's own state is not needed
    return router, [NamedReplica(ReplicaName(name)) for name in names]


class RoutedInProcess:
    """The engine in this process, each request first routed by ``router`` as Ray Serve would
    route it, its stream named by the chosen replica: the app, the namespace and the header as
    under ``--replicas``, without Ray's transport. ``ran_on``: the replica of the last request."""

    def __init__(self, engine, router, replicas):
        from snapkv_rag.server.app import InProcess

        self.engine = InProcess(engine)
        self.router, self.replicas = router, replicas
        self.ran_on: str | None = None

    async def open(self, config, request):
        pending = SimpleNamespace(args=[request], metadata=None)
        chosen = (await self.router.choose_replicas(self.replicas, pending))[0][0]
        self.router.on_request_routed(pending, chosen.replica_id, None)
        self.ran_on = chosen.replica_id.unique_id
        stream = await self.engine.open(config, request)
        stream.replica = self.ran_on
        return stream

    async def health(self) -> dict:
        return await self.engine.health()


def probe_client(engine, tenants: Tenants, backend=None):
    from starlette.testclient import TestClient

    from snapkv_rag.server import ServerConfig, create_app

    return TestClient(create_app(ServerConfig(engine, model_id="default", api_key=list(tenants.keys) or None, backend=backend)))


def routing_probe(engine, tenants: Tenants) -> list[dict]:
    """Case 16: the victim's prompt routed (twice, as a returning client's), then each guess sent
    by the attacker from the same routing state (the router copied): the replica it ran on and the
    header the attacker got, for the right guess as for the wrong one; and the victim's follow-up."""
    router, replicas = affinity_router()
    backend = RoutedInProcess(engine, router, replicas)
    rows = []
    with probe_client(engine, tenants, backend) as client:

        def send(content: str, headers: dict, **extra) -> httpx.Response:
            response = client.post("/v1/chat/completions", json=chat_with(content, max_tokens=1, **extra), headers=headers)
            response.raise_for_status()
            return response

        for _ in range(2):
            send(victim_prompt("4417"), tenants.victim, **tenants.victim_salt)
        victim_replica, after_victim = backend.ran_on, copy.deepcopy(router)
        expect = "the same replica and header for both guesses"
        for guess in GUESSES:
            backend.router = copy.deepcopy(after_victim)
            header = send(victim_prompt(guess), tenants.attacker).headers.get("x-snapkv-replica")
            what = f"guess {guess} from another tenant, routed"
            rows.append(
                {
                    "case": 16,
                    "what": what,
                    "expect": expect,
                    "status": 200,
                    "replica": backend.ran_on,
                    "with_victim": backend.ran_on == victim_replica,
                    "header": header,
                }
            )
        backend.router = after_victim
        send(victim_prompt("4417") + " And the last one?", tenants.victim, **tenants.victim_salt)
        follow_up = {"replica": backend.ran_on, "with_victim": backend.ran_on == victim_replica}
        rows.append(
            {"case": 16, "what": "the victim's own follow-up, routed", "expect": "its replica (affinity within a namespace)", "status": 200, **follow_up}
        )
    return rows


def call_gate_probe(engine, tenants: Tenants) -> list[dict]:
    """Case 17: with a call gate, the victim's prompt under tool_choice="auto", then each guess
    from the attacker, each under a fresh salt (so neither guess reuses the other's K/V): the
    prompt tokens the engine reused meanwhile (the gate's teacher forcing and the reply; what
    makes a right guess faster) and the seconds the attacker waited."""
    from snapkv_rag.tools.call_gate import CallGate

    rows = []
    engine.call_gate, kept_gate = CallGate(threshold=1e9), engine.call_gate  # the decision does not matter here: what the gate reads does
    try:
        with probe_client(engine, tenants) as client:

            def send(content: str, headers: dict, **extra) -> None:
                body = chat_with(content, max_tokens=1, tools=GATE_TOOLS, tool_choice="auto", **extra)
                client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()

            send(victim_prompt("4417"), tenants.victim, **tenants.victim_salt)
            expect = "the same reuse for both guesses"
            for guess in GUESSES:
                before, started = engine.prefix_cache.stats().reused_tokens, time.perf_counter()
                send(victim_prompt(guess), tenants.attacker, cache_salt=f"attacker-guess-{guess}")
                seconds = round(time.perf_counter() - started, 2)
                reused = engine.prefix_cache.stats().reused_tokens - before
                what = f"guess {guess} from another tenant, call gate on"
                rows.append({"case": 17, "what": what, "expect": expect, "status": 200, "reused_prompt_tokens": reused, "seconds": seconds})
    finally:
        engine.call_gate = kept_gate
    return rows


def run_probes(model: str, api_key: str | None) -> list[dict]:
    from snapkv_rag import Engine

    engine = Engine.from_pretrained(model) if model != "default" else Engine.default()
    tenants = Tenants.of(api_key)
    return routing_probe(engine, tenants) + call_gate_probe(engine, tenants)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-key", default=None, help="start the server with this key and send it with every request")
    parser.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue (the trickling clients outnumber it)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra option for snapkv-rag serve (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "attack")
    parser.add_argument("--probes-only", action="store_true", help="only the in-process probes (cases 16 and 17), no server started")
    return parser


def served_cases(args: argparse.Namespace) -> list[dict]:
    serve_args = ["--model", args.model, "--max-queue", str(args.max_queue), *args.serve_arg]
    serve_args += ["--api-key", args.api_key, "--api-key", ATTACKER_KEY] if args.api_key else []
    process, base = start_serve(serve_args, args.out / "serve.log")
    port = int(base.rsplit(":", 1)[1])
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        attacker = {"Authorization": f"Bearer {ATTACKER_KEY}"} if args.api_key else {}
        return run_cases(base, port, headers, args.max_queue, attacker)
    finally:
        process.terminate()
        process.wait(30)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [] if args.probes_only else served_cases(args)
    rows += run_probes(args.model, args.api_key)
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
        elif "replica" in r:
            detail = f"ran on {r['replica']}" + (" (the victim's)" if r["with_victim"] else "") + (f", header {r['header']}" if "header" in r else "")
        elif "reused_prompt_tokens" in r:
            detail = f"reused {r['reused_prompt_tokens']} prompt tokens" + (f", {r['seconds']} s" if "seconds" in r else "")
        elif "seconds" in r:
            detail += f", {r['seconds']} s"
        lines.append(f"| {r['case']} | {r['what']} | {r['expect']} | {r['status']} | {detail} |")
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
