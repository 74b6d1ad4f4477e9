"""Rolling prefill (issue 46): needles past the 8K window, and a rolled prefill's memory and time.

Rolling prefill (issue 46): needles past the embedded model's 8K window, and what a rolled
prefill costs in memory and time against a whole one.

Parts (``--part``):

- ``needle``: the embedded SmolLM2-135M, a passkey at each depth of haystacks of each length,
  answered under ``snapkv:budget=B,window=question,rolling=N`` (and, for lengths that fit the
  window, the same policy without rolling: a whole prefill). Per row: hits, prefill seconds,
  peak RSS of the process during the call, chunks, peak K/V entries per layer.
- ``memory``: each (length, policy) in a fresh process (a process keeps the memory an earlier
  call took), the process's peak RSS over one answer and its RSS once the model is loaded.
- ``tiny``: a tiny random Llama with a 64K context, prompts that fit whole: the next-token KL of
  whole-prompt SnapKV and of rolled SnapKV against the full cache, and between the two.

    .venv/bin/python -m eval rolling_prefill --part needle --lengths 4096,8192,16384,32768 --out eval/compression/results/rolling_prefill/needle
    .venv/bin/python -m eval rolling_prefill --part needle --lengths 8192,16384,32768 --settings 512x1024,2048x1024,1024x512,1024x2048 --no-whole --resume --out eval/compression/results/rolling_prefill/needle_grid
    .venv/bin/python -m eval rolling_prefill --part memory --lengths 4096,8192,16384,32768 --out eval/compression/results/rolling_prefill/memory
    .venv/bin/python -m eval rolling_prefill --part tiny --out eval/compression/results/rolling_prefill/tiny
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from eval.common.processes import child_env, module_command
from eval.common.results_io import peak_rss_bytes, read_records, write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import SnapKV, parse_compression
from snapkv_rag.compression.parsing import settings_from_text
from snapkv_rag.harness.metrics import needle_exact_match, next_token_kl
from snapkv_rag.harness.needle import build_needle_case

RESULTS = Path(__file__).resolve().parent / "results"


def needle_settings(args) -> list[tuple[int, int]]:
    """(budget, chunk) pairs: ``--settings 512x1024,...`` as given, else every budget with every chunk."""
    if args.settings:
        return [(int(b), int(c)) for b, c in (s.split("x") for s in args.settings.split(","))]
    return [(int(b), int(c)) for b in args.budgets.split(",") for c in args.chunks.split(",")]


def needle_part(args) -> None:
    engine = Engine.default()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    settings = needle_settings(args)
    records = read_records(args.out, missing_ok=True) if args.resume else []
    done = {(r["length"], r["spec"], r["depth"]) for r in records}
    for length in lengths:
        specs = []
        for budget, chunk in settings:
            base = SnapKV(max_capacity_prompt=budget, window_size="question").with_settings(**settings_from_text(args.options or "")).spec()
            if args.whole and length + 32 <= engine.context_length and base not in specs:
                specs.append(base)  # a whole prefill, where it fits
            specs.append(parse_compression(base).with_rolling(chunk).spec())
        for spec in specs:
            for depth in depths:
                if (length, spec, depth) in done:
                    continue
                case = build_needle_case(engine.tokenizer, length, depth, seed=int(depth * 100) + length)
                start = time.perf_counter()
                result = engine.generate(case.prompt, compression=spec, max_new_tokens=12)
                seconds = time.perf_counter() - start
                stats = result.stats
                record = {
                    "length": length,
                    "prompt_tokens": result.usage.prompt_tokens,
                    "spec": spec,
                    "depth": depth,
                    "hit": needle_exact_match(result.text, case.answer),
                    "answer": result.text,
                    "prefill_seconds": stats.prefill_seconds,
                    "seconds": seconds,
                    "peak_rss_bytes": peak_rss_bytes(stats),
                    "rolled_chunks": stats.policy_stats.get("rolled_chunks", 0),
                    "peak_entries": stats.policy_stats.get("rolling_peak_entries", result.usage.prompt_tokens),
                    "max_position": stats.policy_stats.get("rolling_max_position", result.usage.prompt_tokens - 1),
                    "dtype": stats.dtype,
                }
                records.append(record)
                print(
                    f"{length:>6} {spec:<48} depth {depth:.1f}: {'hit ' if record['hit'] else 'miss'} "
                    f"prefill {record['prefill_seconds']:.1f}s rss {record['peak_rss_bytes'] / 2**30:.2f} GiB chunks {record['rolled_chunks']}",
                    flush=True,
                )
                write_records(args.out, records)
    write_table(args.out, needle_table(records) + [""] + needle_grid(records))


def needle_table(records: list[dict]) -> list[str]:
    lines = [
        "| prompt tokens | compression | needle hits | prefill s (mean) | peak RSS GiB (max) | chunks | peak K/V entries per layer | highest position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in sorted(records, key=lambda r: r["length"]):
        groups.setdefault((r["length"], r["spec"]), []).append(r)
    for (_length, spec), rows in groups.items():
        hits = sum(r["hit"] for r in rows)
        lines.append(
            f"| {rows[0]['prompt_tokens']:,} | `{spec}` | {hits}/{len(rows)} | {sum(r['prefill_seconds'] for r in rows) / len(rows):.1f} | "
            f"{max(r['peak_rss_bytes'] for r in rows) / 2**30:.2f} | {rows[0]['rolled_chunks']} | {rows[0]['peak_entries']:,} | {rows[0]['max_position']:,} |"
        )
    return lines


def needle_grid(records: list[dict]) -> list[str]:
    """Hits per prompt length (rows) and rolled setting (columns: the spec's options but the question
    window, which every row has); a blank: not run."""
    rolled = [r for r in records if "rolling=" in r["spec"]]
    settings = sorted({spec_setting(r["spec"]) for r in rolled}, key=lambda s: (len(s), s))
    lengths = sorted({r["length"] for r in rolled})
    lines = [
        "| prompt tokens | " + " | ".join(f"`{setting}`" for setting in settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for length in lengths:
        cells = []
        for setting in settings:
            rows = [r for r in rolled if r["length"] == length and spec_setting(r["spec"]) == setting]
            cells.append(f"{sum(r['hit'] for r in rows)}/{len(rows)}" if rows else "")
        tokens = next(r["prompt_tokens"] for r in rolled if r["length"] == length)
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    return lines


def spec_setting(spec: str) -> str:
    """The table's column of a record's spec: its budget and chunk (``budget=512,rolling=1024``)."""
    policy = parse_compression(spec)
    return f"budget={policy.max_capacity_prompt}" + (f",rolling={policy.rolling}" if policy.rolling is not None else "")


def one_part(args) -> None:
    """One answer in this process: prints a JSON line (peak RSS, loaded RSS, prefill seconds)."""
    import json
    import resource

    engine = Engine.default()
    case = build_needle_case(engine.tokenizer, args.length, 0.5, seed=args.length)
    engine.generate("Hello", max_new_tokens=2)  # warm-up: what any call needs
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = engine.generate(case.prompt, compression=args.spec, max_new_tokens=12)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "length": args.length,
                "prompt_tokens": result.usage.prompt_tokens,
                "spec": args.spec,
                "hit": needle_exact_match(result.text, case.answer),
                "loaded_rss_bytes": loaded,
                "peak_rss_bytes": peak,
                "prefill_seconds": result.stats.prefill_seconds,
                "peak_entries": result.stats.policy_stats.get("rolling_peak_entries", result.usage.prompt_tokens),
                "dtype": result.stats.dtype,
            }
        )
    )


def memory_part(args) -> None:
    import json
    import subprocess

    records = []
    for length in (int(x) for x in args.lengths.split(",")):
        whole = SnapKV(max_capacity_prompt=1024, window_size="question")
        specs = [whole.with_rolling(int(args.chunks.split(",")[0])).spec()]
        if length + 32 <= 8192:
            specs.insert(0, whole.spec())
        for spec in specs:
            run = subprocess.run(
                module_command(__spec__.name, "--part", "one", "--length", str(length), "--spec", spec, "--out", str(args.out)),
                env=child_env(),
                capture_output=True,
                text=True,
                check=True,
            )
            records.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(records[-1], flush=True)
    write_records(args.out, records)
    lines = [
        "| prompt tokens | compression | RSS once loaded GiB | peak RSS GiB | added by the call GiB | prefill s | peak K/V entries per layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['prompt_tokens']:,} | `{r['spec']}` | {r['loaded_rss_bytes'] / 2**30:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"{(r['peak_rss_bytes'] - r['loaded_rss_bytes']) / 2**30:.2f} | {r['prefill_seconds']:.1f} | {r['peak_entries']:,} |"
        )
    write_table(args.out, lines)


def tiny_part(args) -> None:
    from snapkv_rag.testing import build_tokenizer, tiny_model

    tokenizer = build_tokenizer()
    engine = Engine(tiny_model("llama", len(tokenizer), context=65536), tokenizer, name="tiny-llama-64k")
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()

    def logits(prompt: str, policy) -> torch.Tensor:
        return engine.score(prompt, [0], compression=policy, prefix_cache=False)[:1]  # row 0: the prefill's prediction

    records = []
    for words_n in (int(x) for x in args.tiny_words.split(",")):
        for seed in range(args.tiny_prompts):
            g = torch.Generator().manual_seed(seed)
            prompt = " ".join(words[i] for i in torch.randint(len(words), (words_n,), generator=g).tolist()) + "\nWhich word comes first?"
            full = logits(prompt, None)
            for budget in (256, 1024):
                whole_policy = SnapKV(max_capacity_prompt=budget, window_size="question")
                whole = logits(prompt, whole_policy)
                for chunk in (256, 1024):
                    rolled = logits(prompt, whole_policy.with_rolling(chunk))
                    records.append(
                        {
                            "prompt_tokens": engine.count_tokens(prompt),
                            "budget": budget,
                            "chunk": chunk,
                            "seed": seed,
                            "kl_whole": float(next_token_kl(full, whole)[0].mean()),
                            "kl_rolled": float(next_token_kl(full, rolled)[0].mean()),
                            "kl_rolled_vs_whole": float(next_token_kl(whole, rolled)[0].mean()),
                            "same_argmax": bool(rolled.argmax(-1).eq(whole.argmax(-1)).all()),
                        }
                    )
    write_records(args.out, records)
    lines = [
        "| prompt tokens | budget | chunk | KL(full, whole SnapKV) | KL(full, rolled) | KL(whole, rolled) | same next token as whole |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["prompt_tokens"] // 100 * 100, r["budget"], r["chunk"]), []).append(r)
    for (tokens, budget, chunk), rows in groups.items():
        lines.append(
            f"| ~{tokens:,} | {budget} | {chunk} | {mean(rows, 'kl_whole'):.4f} | {mean(rows, 'kl_rolled'):.4f} | {mean(rows, 'kl_rolled_vs_whole'):.4f} | "
            f"{sum(r['same_argmax'] for r in rows)}/{len(rows)} |"
        )
    write_table(args.out, lines)


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval rolling_prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("needle", "memory", "one", "tiny"), required=True)
    p.add_argument("--length", type=int, default=4096, help="--part one: the prompt's tokens")
    p.add_argument("--spec", default="snapkv:budget=1024,window=question,rolling=1024", help="--part one: the compression")
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--budgets", default="1024")
    p.add_argument("--chunks", default="1024")
    p.add_argument("--settings", default="", help="--part needle: budgetxchunk pairs (512x1024,1024x2048), instead of every budget with every chunk")
    p.add_argument("--options", default="", help="--part needle: more policy options for every spec (chunk=8)")
    p.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True, help="--part needle: also a whole prefill where the prompt fits")
    p.add_argument("--resume", action="store_true", help="--part needle: keep --out's records and run only what they lack")
    p.add_argument("--tiny-words", default="1000,3000")
    p.add_argument("--tiny-prompts", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="default: eval/compression/results/rolling_prefill/PART")
    return p


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    args.out = args.out or RESULTS / "rolling_prefill" / args.part
    {"needle": needle_part, "memory": memory_part, "one": one_part, "tiny": tiny_part}[args.part](args)


if __name__ == "__main__":
    raise SystemExit(main())
