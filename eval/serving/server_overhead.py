"""What the OpenAI-compatible server adds to a request, on the embedded model.

Not a test. One process: the engine is called directly (``engine.generate``) and through
``snapkv-rag serve``'s app under uvicorn with the official ``openai`` client, interleaved, on
prompts of about 100 and 2,000 tokens (SnapKV budget 1024, greedy, 32 new tokens). Every
prompt starts with its own number, so the prefix cache never serves one to the other side.
Reports the median wall time of each side and the difference (HTTP, JSON, the server's
token count of the prompt), and checks on one untimed prompt that both give the same text.

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval server_overhead --out eval/serving/results/server_overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


COMPRESSION = "snapkv:budget=1024"
SENTENCE = "The harbour office logs each ferry's departure, its cargo and the weather at the pier. "


def prompt(run: int, sentences: int) -> list[dict[str, str]]:
    body = f"Report {run}. " + SENTENCE * sentences
    return [{"role": "user", "content": body + "\nQuestion: what does the harbour office log?"}]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval server_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "server_overhead"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)

    import uvicorn
    from openai import OpenAI

    from snapkv_rag import Engine
    from snapkv_rag.server import ServerConfig, create_app

    engine = Engine.default()
    server = uvicorn.Server(
        uvicorn.Config(create_app(ServerConfig(engine, model_id="m", compression=COMPRESSION)), host="127.0.0.1", port=0, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    rows = []
    run = 0
    for sentences in (4, 110):
        check = prompt(0, sentences)  # one untimed pair on the same prompt: the answers must agree
        same = (
            engine.generate(check, max_new_tokens=32, compression=COMPRESSION).text
            == client.chat.completions.create(model="m", messages=check, max_tokens=32).choices[0].message.content
        )
        direct_s, served_s, tokens = [], [], None
        for _ in range(args.repeats + 1):  # the first pair warms up and is dropped
            for side in ("direct", "server"):
                run += 1
                messages = prompt(run, sentences)
                start = time.perf_counter()
                if side == "direct":
                    tokens = engine.generate(messages, max_new_tokens=32, compression=COMPRESSION).usage.prompt_tokens
                else:
                    client.chat.completions.create(model="m", messages=messages, max_tokens=32)
                (direct_s if side == "direct" else served_s).append(time.perf_counter() - start)
        direct_s, served_s = direct_s[1:], served_s[1:]
        d, s = statistics.median(direct_s), statistics.median(served_s)
        rows.append(
            {
                "prompt_tokens": tokens,
                "direct_s": d,
                "server_s": s,
                "added_ms": 1000 * (s - d),
                "added_pct": 100 * (s - d) / d,
                "same_text": same,
                "repeats": args.repeats,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    server.should_exit = True

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(rows, indent=2))
    lines = ["| prompt tokens | direct (s) | through the server (s) | added | same answer on one prompt |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['prompt_tokens']} | {row['direct_s']:.2f} | {row['server_s']:.2f} | {row['added_ms']:+.0f} ms ({row['added_pct']:+.1f}%) | {'yes' if row['same_text'] else 'NO'} |"
        )
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
