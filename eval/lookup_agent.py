"""Prompt-lookup drafts on the agent-memory example's turns (connectors/langchain-snapkv/examples/
long_log_agent.py): the same session run with ``prompt_lookup_num_tokens`` 0 and K, each from an
empty memory. Per model call (tool-call turns, whose arguments are decoded under the grammar, and
answer turns apart): decode ms per generated token after the first, tokens per forward, and
whether the call's output is the undrafted one.

    .venv/bin/python eval/lookup_agent.py [--turns 8] [--k 4] [--out eval/results/lookup_agent]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "connectors/langchain-snapkv/examples"))

from long_log_agent import run_session  # noqa: E402
from results_io import write_records, write_table  # noqa: E402

from langchain_snapkv import ChatSnapKV, SnapKVChatMessageHistory  # noqa: E402
from snapkv_rag.agents import AgentMemory  # noqa: E402


def session(k: int, turns: int, budget: int) -> list[dict]:
    llm = ChatSnapKV(model="default", max_tokens=40, compression=f"snapkv:budget={budget}", prompt_lookup_num_tokens=k)
    history = SnapKVChatMessageHistory(AgentMemory(str(Path(tempfile.mkdtemp()) / "agent.sqlite3")), f"lookup-{k}")
    rows = run_session(llm, history, turns, echo=lambda *_: None)
    for row in rows:
        tokens = (row["completion_tokens"] or 1) - 1
        row["k"] = k
        row["kind"] = "tool call" if row["tool_calls"] else "answer"
        row["decode_ms_per_token"] = row["decode_seconds"] / tokens * 1000 if tokens > 0 else None
        row["tool_calls"] = [(c["name"], c["args"]) for c in row["tool_calls"]]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "eval/results/lookup_agent"))
    args = ap.parse_args()
    session(0, 2, args.budget)  # warm-up: the engine loads, the first calls' one-off costs are paid
    plain, drafted = session(0, args.turns, args.budget), session(args.k, args.turns, args.budget)
    write_records(Path(args.out), plain + drafted)
    lines = [
        "| calls | median decode ms/token (K=0 → K) | median speedup | tokens per forward | identical outputs |",
        "|---|---|---|---|---|",
    ]
    for kind in ("tool call", "answer"):
        pairs = [(a, b) for a, b in zip(plain, drafted) if a["kind"] == kind and a["decode_ms_per_token"] and b["decode_ms_per_token"]]
        if not pairs:
            continue
        per_forward = statistics.mean(b["drafts"]["tokens_per_forward"] for _, b in pairs if b["drafts"] and b["drafts"].get("tokens_per_forward"))
        same = sum((a["text"], a["tool_calls"]) == (b["text"], b["tool_calls"]) for a, b in pairs)
        lines.append(
            f"| {kind} ({len(pairs)}) | {statistics.median(a['decode_ms_per_token'] for a, _ in pairs):.1f} → "
            f"{statistics.median(b['decode_ms_per_token'] for _, b in pairs):.1f} | "
            f"{statistics.median(a['decode_ms_per_token'] / b['decode_ms_per_token'] for a, b in pairs):.2f}x | {per_forward:.2f} | {same}/{len(pairs)} |"
        )
    lines += ["", f"Command: `.venv/bin/python eval/lookup_agent.py --turns {args.turns} --k {args.k}` (SnapKV budget {args.budget}, 40 new tokens at most)"]
    write_table(Path(args.out), lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
