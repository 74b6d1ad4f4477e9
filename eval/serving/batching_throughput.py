"""Continuous batching under load (issue 26): tokens/s and time to first token at 1-16 clients.

Continuous batching under load (issue 26): aggregate tokens/s and time to first token at 1-16
concurrent clients, full cache against SnapKV, on the embedded model through the HTTP server.

Not a test. One process: ``snapkv-rag serve``'s app under uvicorn on loopback, and ``--clients``
concurrent streaming clients (httpx), each sending ``--requests`` chat requests one after the
other (a ~``--context``-token stuffed prompt, ``--tokens`` new tokens with ``ignore_eos``). The
prompts are the same for every setting, numbered so the prefix cache never serves one to another.
Reports per setting: aggregate completion tokens/s over the wall time, TTFT p50/p95 (request
sent -> first content chunk), the mean decode batch (rows per decode forward, from the
engine's scheduler) and the ratio of tokens/s against one client of the same compression.
``--lookup K`` runs every setting again with ``prompt_lookup_num_tokens=K`` (prompt-lookup
drafts, which decode alone only: beside other rows a request decodes one token per step).

    .venv/bin/python -m eval batching_throughput --out eval/serving/results/batching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import torch

from eval.common.results_io import write_records, write_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

SETTINGS = [("full", "full"), ("snapkv", "snapkv:budget=256,window=32")]


def documents(tokenizer, context: int) -> str:
    text, used = [], 0
    for doc in sorted((ROOT / "examples" / "sample_corpus").glob("*")):
        body = doc.read_text()
        used += len(tokenizer(body)["input_ids"])
        if used > context and text:
            break
        text.append(f"## {doc.stem}\n{body}")
    return "\n\n".join(text)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def client(base: str, spec: str, prompts: list[str], tokens: int, records: list[dict], lookup: int = 0) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        for prompt in prompts:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "compression": spec,
                **({"prompt_lookup_num_tokens": lookup} if lookup else {}),
            }
            sent = time.perf_counter()
            first = None
            completion = 0
            async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        completion = chunk["usage"]["completion_tokens"]
            records.append({"ttft": (first or time.perf_counter()) - sent, "tokens": completion})


async def load(base: str, spec: str, clients: int, requests: int, prompts: list[str], tokens: int, lookup: int = 0) -> tuple[float, list[dict]]:
    records: list[dict] = []
    start = time.perf_counter()
    await asyncio.gather(*(client(base, spec, prompts[c * requests : (c + 1) * requests], tokens, records, lookup) for c in range(clients)))
    return time.perf_counter() - start, records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval batching_throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    parser.add_argument("--context", type=int, default=400, help="stuffed document tokens per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request (ignore_eos)")
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument(
        "--compile-decode", action=argparse.BooleanOptionalAction, default=None, help="the compiled decode step (default: $SNAPKV_RAG_COMPILE_DECODE)"
    )
    parser.add_argument("--lookup", type=int, default=0, help="also run every setting with prompt_lookup_num_tokens=K")
    parser.add_argument("--settings", default="full,snapkv", help="which of full, snapkv")
    parser.add_argument("--out", type=Path, default=RESULTS / "batching")
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    import uvicorn

    from snapkv_rag import Engine
    from snapkv_rag.server import ServerConfig, create_app

    engine = Engine.default(max_batch_size=args.max_batch_size, compile_decode=args.compile_decode)
    engine.warm_compiled_decode()  # with --compile-decode: compiled before the clients start, as serve does
    server = uvicorn.Server(uvicorn.Config(create_app(ServerConfig(engine, model_id="m", max_queue=256)), host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    docs = documents(engine.tokenizer, args.context)
    counts = [int(c) for c in args.clients.split(",")]
    needed = max(counts) * args.requests
    question = "\n\nWrite a detailed report on the documents above."
    engine.generate(f"Warm-up.\n\n{docs}{question}", max_new_tokens=4)
    rows, records = [], []
    serial = 0
    settings = [
        (label + (f" +lookup {k}" if k else ""), spec, k) for label, spec in SETTINGS if label in args.settings.split(",") for k in sorted({0, args.lookup})
    ]
    for clients in counts:
        for label, spec, lookup in settings:
            prompts = [f"Request {serial + i}.\n\n{docs}{question}" for i in range(needed)]
            serial += needed  # never the same prompt twice: no prefix-cache hits between requests
            before = engine.scheduler_stats()
            wall, done = asyncio.run(load(base, spec, clients, args.requests, prompts, args.tokens, lookup))
            after = engine.scheduler_stats()
            steps = after.decode_steps - before.decode_steps
            mean_batch = (after.decoded_rows - before.decoded_rows) / steps if steps else 0.0
            tokens = sum(r["tokens"] for r in done)
            ttfts = [r["ttft"] for r in done]
            row = {
                "clients": clients,
                "compression": label,
                "spec": spec,
                "requests": len(done),
                "completion_tokens": tokens,
                "wall_s": wall,
                "tokens_per_s": tokens / wall,
                "ttft_p50_s": statistics.median(ttfts),
                "ttft_p95_s": percentile(ttfts, 0.95),
                "mean_decode_batch": mean_batch,
            }
            rows.append(row)
            records.extend({**row, **r} for r in done)
            print(
                f"{clients:>2} clients {label:>16}: {row['tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.2f}s p95 {row['ttft_p95_s']:.2f}s, batch {mean_batch:.1f}",
                flush=True,
            )
            write_records(args.out, rows)
    server.should_exit = True

    single = {r["compression"]: r["tokens_per_s"] for r in rows if r["clients"] == counts[0]}
    prompt_tokens = engine.count_tokens(f"Request 0.\n\n{docs}{question}")
    lines = [
        f"Embedded SmolLM2-135M, {engine.info().dtype}, {torch.get_num_threads()} threads, max_batch_size {engine.max_batch_size}, "
        f"compiled decode {engine.info().compiled_decode}; "
        f"each client sends {args.requests} streaming chat requests one after the other ({prompt_tokens}-token prompts, {args.tokens} new tokens, ignore_eos).",
        "",
        "| clients | compression | tokens/s | vs 1 client | TTFT p50 | TTFT p95 | mean decode batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['compression']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / single[r['compression']]:.2f}x "
            f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s | {r['mean_decode_batch']:.1f} |"
        )
    options = f" --lookup {args.lookup} --settings {args.settings}" if args.lookup else ""
    lines += [
        "",
        f"Command: `.venv/bin/python -m eval batching_throughput --clients {args.clients} --requests {args.requests} --tokens {args.tokens}{options}`",
    ]
    write_table(args.out, lines)


if __name__ == "__main__":
    raise SystemExit(main())
