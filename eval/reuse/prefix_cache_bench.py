"""Prefix-cache benchmark (issue 10): time to first token with and without prompt reuse.

Not a test. On the embedded model, in one process, interleaved so drift hits both sides:

1. Document QA: 10 questions over one ~6K-token document prompt (same prefix, question last),
   full cache and SnapKV budget 1024. Each question runs once without the prefix cache
   (``prefix_cache=False``: neither reads nor writes it) and once with it (q1 fills it).
2. Agent-like session: 20 turns; each turn appends the assistant's answer, a 300-800-token
   tool log and a user message, growing the history to about 7K tokens (SnapKV 1024).
   Per turn: time to first token with and without reuse, and peak RSS.

Time to first token is the engine's ``prefill_seconds`` (prefix lookup, the prefill forward
with compression, storing the prompt's K/V; the first token is chosen from its logits).

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval prefix_cache_bench --out eval/reuse/results/prefix_cache
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from eval.common.results_io import peak_rss_bytes
from snapkv_rag import Engine, __version__
from snapkv_rag.compression import SnapKV
from snapkv_rag.errors import PromptTooLongError
from snapkv_rag.model.peak_memory import current_rss_bytes

RESULTS = Path(__file__).resolve().parent / "results"


FIRST = ["Maria", "Jonas", "Aiko", "Pedro", "Lena", "Omar", "Greta", "Ravi", "Nora", "Tomas"]
CITIES = ["Lyon", "Porto", "Kyoto", "Quito", "Tartu", "Oslo", "Accra", "Pune", "Cork", "Brno"]
TOPICS = [
    "bridge repairs",
    "library hours",
    "bus timetables",
    "water quality",
    "school meals",
    "park lighting",
    "bike lanes",
    "market stalls",
    "street names",
    "tree planting",
]


def facts_and_questions() -> tuple[list[str], list[str]]:
    facts, questions = [], []
    for i in range(10):
        facts.append(f"Fact {i + 1}: the {TOPICS[i]} committee of {CITIES[i]} is chaired by {FIRST[i]}, and its budget is {110 + 37 * i} thousand euros.")
        questions.append(f"Who chairs the {TOPICS[i]} committee of {CITIES[i]}, and what is its budget?")
    return facts, questions


def filler_sentence(rng: random.Random) -> str:
    subject = rng.choice(["The council", "A resident", "The committee", "The mayor's office", "A local newspaper", "The auditor"])
    verb = rng.choice(["discussed", "reviewed", "postponed", "approved", "questioned", "summarised"])
    thing = rng.choice(TOPICS + ["the annual report", "a citizen petition", "the winter schedule", "new signage"])
    when = rng.choice(["in March", "last spring", "after the election", "at the second hearing", "without objection", "in a short session"])
    return f"{subject} {verb} {thing} {when}."


def build_document(tokenizer, target_tokens: int, seed: int = 0) -> str:
    """About ``target_tokens`` tokens of council minutes with the 10 facts spread through them."""
    rng = random.Random(seed)
    facts, _ = facts_and_questions()
    paragraphs: list[str] = []
    while True:
        paragraph = " ".join(filler_sentence(rng) for _ in range(6))
        paragraphs.append(paragraph)
        if len(tokenizer("\n\n".join(paragraphs), add_special_tokens=False)["input_ids"]) >= target_tokens - 400:
            break
    step = max(1, len(paragraphs) // len(facts))
    for k, fact in enumerate(facts):
        paragraphs.insert(min(len(paragraphs), k * step + k + 1), fact)
    return "Minutes of the city committees.\n\n" + "\n\n".join(paragraphs)


def tool_log(rng: random.Random, tokenizer, target: int, turn: int) -> str:
    lines = [f"$ run_check --step {turn}"]
    while len(tokenizer("\n".join(lines), add_special_tokens=False)["input_ids"]) < target:
        lines.append(
            f"[{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}] "
            f"{rng.choice(['INFO', 'DEBUG', 'WARN'])} worker-{rng.randint(1, 8)} "
            f"{rng.choice(['fetched', 'parsed', 'validated', 'retried', 'cached', 'skipped'])} "
            f"record {rng.randint(1000, 99999)} in {rng.randint(1, 900)} ms"
        )
    return "\n".join(lines)


class JsonlList(list):
    """A list that also appends each record to a JSON-lines file (a crash keeps what ran)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def append(self, record: dict) -> None:
        super().append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def measure(engine: Engine, messages: list, new_tokens: int, policy, reuse: bool):
    """One call with or without the prefix cache: the result and its timing record."""
    start = time.perf_counter()
    result = engine.generate(messages, max_new_tokens=new_tokens, compression=policy, prefix_cache=reuse)
    wall = time.perf_counter() - start
    s = result.stats
    return result, {
        "ttft_s": s.prefill_seconds,
        "wall_s": wall,
        "prompt_tokens": result.usage.prompt_tokens,
        "reused_prompt_tokens": s.reused_prompt_tokens,
        "prefilled_prompt_tokens": s.prefilled_prompt_tokens,
        "decode_ms_per_token": s.decode_ms_per_token,
        "peak_rss_bytes": peak_rss_bytes(s),
        "text": result.text,
    }


def doc_qa(engine: Engine, doc_tokens: int, new_tokens: int, budget: int, records: list, without_questions: int = 10) -> list[dict]:
    document = build_document(engine.tokenizer, doc_tokens)
    _, questions = facts_and_questions()
    for label, policy in (("full", None), (f"snapkv@{budget}", SnapKV(max_capacity_prompt=budget))):
        engine.prefix_cache.clear()
        for i, q in enumerate(questions):
            messages = [{"role": "user", "content": f"{document}\n\nAnswer from the minutes above. {q}"}]
            row = {"task": "doc_qa", "method": label, "question": i + 1}
            modes = ("without", "with") if i < without_questions else ("with",)
            for mode in modes:  # interleaved per question
                _, row[mode] = measure(engine, messages, new_tokens, policy, reuse=(mode == "with"))
            row["same_answer"] = row["with"]["text"] == row["without"]["text"] if "without" in row else None
            row["prefix_cache_bytes"] = engine.prefix_cache.nbytes
            records.append(row)
            print(
                json.dumps({k: v for k, v in row.items() if k not in ("with", "without")}) + f" ttft with {row['with']['ttft_s']:.2f}s",
                file=sys.stderr,
                flush=True,
            )
    return records


def agent_session(engine: Engine, turns: int, new_tokens: int, budget: int, records: list, seed: int = 0, without_every: int = 1) -> list[dict]:
    rng = random.Random(seed)
    policy = SnapKV(max_capacity_prompt=budget)
    engine.prefix_cache.clear()
    messages = [
        {"role": "system", "content": "You are an operations agent. Read the tool logs and report problems briefly."},
        {"role": "user", "content": "Check the nightly pipeline step by step."},
    ]
    for turn in range(1, turns + 1):
        row = {"task": "agent", "method": f"snapkv@{budget}", "turn": turn}
        measure_without = turn == 1 or turn == turns or (turn - 1) % without_every == 0
        for mode in ("without", "with") if measure_without else ("with",):
            try:
                result, row[mode] = measure(engine, messages, new_tokens, policy, reuse=(mode == "with"))
            except PromptTooLongError as exc:  # the history outgrew the model's context: the session ends here
                print(f"turn {turn}: stopped, {exc}", file=sys.stderr, flush=True)
                records.append({"task": "agent", "stopped_at_turn": turn, "reason": str(exc)})
                return records
        row["same_answer"] = row["with"]["text"] == row["without"]["text"] if "without" in row else None
        row["prefix_cache_bytes"] = engine.prefix_cache.nbytes
        row["rss_after_bytes"] = current_rss_bytes()
        records.append(row)
        print(
            f"turn {turn}: {row['with']['prompt_tokens']} tokens, ttft with {row['with']['ttft_s']:.2f}s (prefilled {row['with']['prefilled_prompt_tokens']})",
            file=sys.stderr,
            flush=True,
        )
        log = tool_log(rng, engine.tokenizer, rng.randint(300, 800), turn)
        messages += [
            {"role": "assistant", "content": result.text},
            {"role": "tool", "content": log},
            {"role": "user", "content": f"Step {turn + 1}: what does the latest log show?"},
        ]
    return records


def summarize(records: list[dict], settings: dict) -> str:
    lines = ["## Prefix cache", ""]
    lines.append(
        f"Model {settings['model']}, {settings['device']}, {settings['dtype']}, {settings['threads']} threads, "
        f"batch 1, greedy, {settings['new_tokens']} new tokens (agent: {settings['agent_new_tokens']}), "
        f"prefix cache bound {settings['prefix_cache_bytes'] / 2**30:.1f} GiB, version {settings['version']}. "
        "TTFT = the engine's prefill_seconds; with and without reuse interleaved per question/turn in one process."
    )
    lines.append("")
    qa = [r for r in records if r["task"] == "doc_qa"]
    if qa:
        lines += ["### Document QA: 10 questions over one document prompt", ""]
        lines.append(
            "| method | prompt tokens | q1 TTFT s without / with | mean TTFT s without reuse (questions run so) | "
            "q2-10 mean TTFT s with reuse | speed-up | q2-10 reused / prefilled tokens (median) | identical answers (of compared) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for method in dict.fromkeys(r["method"] for r in qa):
            rows = [r for r in qa if r["method"] == method]
            q1, rest = rows[0], rows[1:]
            without_rows = [r for r in rows if "without" in r]
            without = statistics.mean(r["without"]["ttft_s"] for r in without_rows)
            with_ = statistics.mean(r["with"]["ttft_s"] for r in rest)
            compared = [r for r in rows if r["same_answer"] is not None]
            lines.append(
                f"| {method} | {q1['with']['prompt_tokens']} | {q1['without']['ttft_s']:.2f} / {q1['with']['ttft_s']:.2f} | "
                f"{without:.2f} (q1-{len(without_rows)}) | {with_:.2f} | {without / with_:.1f}x | "
                f"{statistics.median(r['with']['reused_prompt_tokens'] for r in rest):.0f} / {statistics.median(r['with']['prefilled_prompt_tokens'] for r in rest):.0f} | "
                f"{sum(bool(r['same_answer']) for r in compared)}/{len(compared)} |"
            )
        lines.append("")
    agent = [r for r in records if r["task"] == "agent" and "turn" in r]
    stopped = [r for r in records if r["task"] == "agent" and "stopped_at_turn" in r]
    if agent:
        lines += [f"### Agent-like session: {len(agent)} turns, 300-800-token tool log per turn", ""]
        lines.append(
            "| turn | prompt tokens | prefilled with reuse | TTFT s without | TTFT s with | speed-up | peak RSS MiB without / with | prefix cache MiB | same answer |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in agent:
            w, o = r["with"], r.get("without")
            lines.append(
                f"| {r['turn']} | {w['prompt_tokens']} | {w['prefilled_prompt_tokens']} | {o['ttft_s'] if o else float('nan'):.2f} | {w['ttft_s']:.2f} | "
                + (f"{o['ttft_s'] / w['ttft_s']:.1f}x" if o else "-")
                + f" | {o['peak_rss_bytes'] / 2**20 if o else float('nan'):.0f} / {w['peak_rss_bytes'] / 2**20:.0f} | "
                f"{r['prefix_cache_bytes'] / 2**20:.0f} | {'-' if r['same_answer'] is None else ('yes' if r['same_answer'] else 'no')} |"
            )
        both = [r for r in agent[1:] if "without" in r]
        if both:
            total_o = sum(r["without"]["ttft_s"] for r in both)
            total_w = sum(r["with"]["ttft_s"] for r in both)
            lines += [
                "",
                f"Turns measured both ways after the first ({', '.join(str(r['turn']) for r in both)}): TTFT {total_o:.1f} s without reuse, "
                f"{total_w:.1f} s with ({total_o / total_w:.1f}x). Max peak RSS {max(r['without']['peak_rss_bytes'] for r in agent if 'without' in r) / 2**20:.0f} MiB "
                f"without (turns run so), {max(r['with']['peak_rss_bytes'] for r in agent) / 2**20:.0f} MiB with.",
            ]
        for r in stopped:
            lines += ["", f"The session stopped at turn {r['stopped_at_turn']}: {r['reason']}"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval prefix_cache_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--doc-tokens", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--agent-new-tokens", type=int, default=16)
    parser.add_argument("--skip", choices=["doc_qa", "agent"], action="append", default=[])
    parser.add_argument("--without-questions", type=int, default=10, help="questions also run without reuse (a full prefill costs the same for each)")
    parser.add_argument("--without-every", type=int, default=1, help="agent: also run without reuse on turn 1, the last, and every k-th")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_cache")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine.from_pretrained(args.model)
    engine.generate("Warm up.", max_new_tokens=2, prefix_cache=False)
    info = engine.info()
    settings = {
        "model": info.name,
        "device": info.device,
        "dtype": info.dtype,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "agent_new_tokens": args.agent_new_tokens,
        "budget": args.budget,
        "doc_tokens": args.doc_tokens,
        "turns": args.turns,
        "prefix_cache_bytes": engine.prefix_cache.max_bytes,
        "version": __version__,
        "command": "python -m eval prefix_cache_bench " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "prefix_cache.jsonl"
    jsonl.write_text(json.dumps({"settings": settings}) + "\n")
    records = JsonlList(jsonl)
    if "doc_qa" not in args.skip:
        doc_qa(engine, args.doc_tokens, args.new_tokens, args.budget, records, args.without_questions)
    if "agent" not in args.skip:
        agent_session(engine, args.turns, args.agent_new_tokens, args.budget, records, without_every=args.without_every)
    text = summarize(records, settings) + f"\nProduced by `{settings['command']}`.\n"
    (args.out / "prefix_cache.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
