"""Kept entries in 8 or 4 bits (``kv_bits``) against the same policy at full width, on the embedded model.

- ``answers``: the 40 sample questions stuffed to 2K tokens (DocumentQA's prompt, greedy, 48 new
  tokens), under the full cache and SnapKV (window=question) at 2x, 4x and 8x, each at full width,
  8 and 4 bits: answers changed and right, prompt K/V bytes kept. Each question is prefilled once;
  the other settings reuse its K/V exactly from the prefix cache (float32 by default, where reuse is
  bit-exact, so a changed answer is the quantization's doing).
- ``needle``: the pass key at 4K and 8K tokens, five depths, the same settings: hits.
- ``kl``: next-token KL over 32 held-out tokens after 2,000 tokens of the sample corpus (8
  windows, SnapKV with a 32-token window), against the same cache at full width and the full cache.
- ``speed``: decode ms/token over a full cache of 512 and 7.8K prompt tokens, full width, 8 and 4
  bits, in the host's default dtype; 64 greedy tokens, three runs each, median step.

    .venv/bin/python -m eval kv_quant_bench [--parts speed,answers,needle,kl] [--dtype float32] [--limit N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from eval.common.results_io import read_records, write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.metrics import next_token_kl
from snapkv_rag.harness.needle import build_needle_case
from snapkv_rag.harness.rag_citation import answer_correct, load_questions
from snapkv_rag.rag import DocumentQA, DocumentStore

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

BITS = (None, 8, 4)
MAX_NEW_TOKENS = 48


def settings(prompt_tokens: int) -> dict[str, str]:
    """The full cache and SnapKV at 2x, 4x and 8x of ``prompt_tokens``."""
    out = {"full": "full"}
    for ratio in (2, 4, 8):
        out[f"snapkv {ratio}x"] = f"snapkv:budget={prompt_tokens // ratio},window=question"
    return out


def with_bits(spec: str, bits: int | None) -> str | None:
    """``spec`` storing its entries in ``bits`` (None: full width), as the spec the records name."""
    from snapkv_rag.compression import as_policy, parse_compression

    policy = as_policy(parse_compression(spec).with_bits(bits))
    return None if policy is None else policy.spec()


def fixed_window(spec: str) -> str:
    """``spec`` voting with the last 32 tokens instead of the question's (teacher-forced text has no question)."""
    from snapkv_rag.compression import parse_compression

    policy = parse_compression(spec)
    return spec if policy.query_window == 0 and not policy.needs_question_span else policy.with_settings(window=32).spec()


def answers(args, records: list[dict]) -> None:
    questions = load_questions(ROOT / "examples/sample_questions.jsonl")[: args.limit]
    engine = Engine.default(dtype=args.dtype)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="snapkv-kvbits-") as tmp:
        store = DocumentStore("kv-bits", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        qa = DocumentQA(engine, store, context_tokens=2000, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="prefix", prompt_lookup_num_tokens=0)
        for qi, q in enumerate(questions):
            context = qa.retrieve(q.question)
            for name, spec in settings(2000).items():
                for bits in BITS:
                    answer = qa.answer_context(context, compression=with_bits(spec, bits))
                    r = answer.result
                    records.append(
                        {
                            "part": "answers",
                            "dtype": args.dtype,
                            "setting": name,
                            "bits": bits or 16,
                            "question": qi,
                            "prompt_tokens": r.usage.prompt_tokens,
                            "kept_entries": r.stats.kept_tokens_per_layer[0],
                            "prompt_kv_bytes_kept": r.stats.prompt_kv_bytes_kept,
                            "prompt_kv_bytes_full": r.stats.prompt_kv_bytes_full,
                            "decode_ms_per_token": r.stats.decode_ms_per_token,
                            "text": answer.text,
                            "correct": answer_correct(answer.text, q.answer),
                        }
                    )
            print(f"answers q{qi} done ({time.perf_counter() - started:.0f} s)", flush=True)


def needle(args, records: list[dict]) -> None:
    engine = Engine.default(dtype=args.dtype, prefix_cache_bytes=2 * 2**30)
    for size in (4000, 8000):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            case = build_needle_case(engine.tokenizer, size, depth)
            for name, spec in settings(size).items():
                for bits in BITS:
                    r = engine.generate(case.prompt, max_new_tokens=16, compression=with_bits(spec, bits), question="what is the pass key?")
                    records.append(
                        {
                            "part": "needle",
                            "dtype": args.dtype,
                            "size": size,
                            "depth": depth,
                            "setting": name,
                            "bits": bits or 16,
                            "hit": case.answer in r.text,
                            "text": r.text,
                            "prompt_kv_bytes_kept": r.stats.prompt_kv_bytes_kept,
                        }
                    )
            print(f"needle {size} depth {depth} done", flush=True)


def kl(args, records: list[dict]) -> None:
    """Next-token KL over 32 held-out tokens after 2,000 tokens of the sample corpus, 8 windows."""
    engine = Engine.default(dtype=args.dtype)
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "examples/sample_corpus").iterdir()) if p.suffix in (".md", ".txt"))
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    stride = (len(ids) - 2032) // 8
    for w in range(8):
        start = w * stride
        prompt, continuation = engine.tokenizer.decode(ids[start : start + 2000]), ids[start + 2000 : start + 2032]
        logits = {}
        for name, spec in settings(2000).items():
            for bits in BITS:
                policy = with_bits(fixed_window(spec), bits)
                logits[name, bits] = engine.score(prompt, continuation, compression=policy, chat=False)
        for (name, bits), got in logits.items():
            against_width, _ = next_token_kl(logits[name, None], got)
            against_full, top1 = next_token_kl(logits["full", None], got)
            records.append(
                {
                    "part": "kl",
                    "dtype": args.dtype,
                    "window": w,
                    "setting": name,
                    "bits": bits or 16,
                    "kl_vs_same_width": float(against_width.mean()),
                    "kl_vs_full": float(against_full.mean()),
                    "top1_vs_full": float(top1.float().mean()),
                }
            )
        print(f"kl window {w} done", flush=True)


def speed(args, records: list[dict]) -> None:
    engine = Engine.default()
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    for size in (512, 7800):
        ids = engine.tokenizer(filler * (size // 20 + 1), add_special_tokens=False)["input_ids"][:size]
        prompt = engine.tokenizer.decode(ids)
        for bits in BITS:
            spec = with_bits("full", bits)
            times = []
            for _ in range(3):
                r = engine.generate(prompt, max_new_tokens=64, min_new_tokens=64, compression=spec, chat=False, prefix_cache=True)
                times.append(r.stats.decode_ms_per_token)
            records.append(
                {
                    "part": "speed",
                    "dtype": str(engine.model.dtype).replace("torch.", ""),
                    "size": r.usage.prompt_tokens,
                    "bits": bits or 16,
                    "decode_ms_per_token": statistics.median(times),
                    "runs": times,
                    "prompt_kv_bytes_kept": r.stats.prompt_kv_bytes_kept,
                }
            )
            print(f"speed {size} bits {bits}: {statistics.median(times):.1f} ms/token", flush=True)


def width(bits: int) -> str:
    return "full width" if bits == 16 else str(bits)


def by_setting_and_width(rows: list[dict]):
    """``(setting, bits, rows)`` for every setting in record order, at full width, 8 and 4 bits."""
    for name in dict.fromkeys(r["setting"] for r in rows):
        for bits in (16, 8, 4):
            yield name, bits, [r for r in rows if r["setting"] == name and r["bits"] == bits]


def table(records: list[dict]) -> list[str]:
    lines: list[str] = []
    rows = [r for r in records if r["part"] == "answers"]
    if rows:
        lines += [
            "| cache | bits | texts changed vs same cache at full width | answers lost (right there, wrong here) | right | median prompt K/V kept (MiB) | bytes vs full width |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, bits, cell in by_setting_and_width(rows):
            base = {r["question"]: r for r in rows if r["setting"] == name and r["bits"] == 16}
            group = {r["question"]: r for r in cell}
            changed = sum(group[q]["text"] != base[q]["text"] for q in group)
            lost = sum(base[q]["correct"] and not group[q]["correct"] for q in group)
            kept = statistics.median(r["prompt_kv_bytes_kept"] for r in group.values())
            ratio = statistics.median(group[q]["prompt_kv_bytes_kept"] / base[q]["prompt_kv_bytes_kept"] for q in group)
            lines.append(
                f"| {name} | {width(bits)} | {changed}/{len(group)} | {lost} | "
                f"{sum(r['correct'] for r in group.values())}/{len(group)} | {kept / 2**20:.2f} | {ratio:.3f} |"
            )
        lines.append("")
    rows = [r for r in records if r["part"] == "needle"]
    if rows:
        lines += ["| needle | cache | full width | 8 bits | 4 bits |", "|---|---|---|---|---|"]
        for size in sorted({r["size"] for r in rows}):
            for name in dict.fromkeys(r["setting"] for r in rows):
                hits = [sum(r["hit"] for r in rows if (r["size"], r["setting"], r["bits"]) == (size, name, bits)) for bits in (16, 8, 4)]
                total = sum(1 for r in rows if (r["size"], r["setting"], r["bits"]) == (size, name, 16))
                lines.append(f"| {size} | {name} | " + " | ".join(f"{h}/{total}" for h in hits) + " |")
        lines.append("")
    rows = [r for r in records if r["part"] == "kl"]
    if rows:
        lines += [
            "| cache | bits | next-token KL vs same cache at full width | KL vs full cache | top-1 agreement with full cache |",
            "|---|---|---|---|---|",
        ]
        for name, bits, group in by_setting_and_width(rows):
            lines.append(
                f"| {name} | {width(bits)} | {statistics.mean(r['kl_vs_same_width'] for r in group):.1e} | "
                f"{statistics.mean(r['kl_vs_full'] for r in group):.4f} | {statistics.mean(r['top1_vs_full'] for r in group):.3f} |"
            )
        lines.append("")
    rows = [r for r in records if r["part"] == "speed"]
    if rows:
        lines += ["| dtype | prompt tokens | bits | decode ms/token (median of 3) | vs full width | prompt K/V (MiB) |", "|---|---|---|---|---|---|"]
        for r in rows:
            base = next(b for b in rows if b["size"] == r["size"] and b["bits"] == 16 and b["dtype"] == r["dtype"])
            lines.append(
                f"| {r['dtype']} | {r['size']} | {width(r['bits'])} | {r['decode_ms_per_token']:.1f} | "
                f"{r['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x | {r['prompt_kv_bytes_kept'] / 2**20:.1f} |"
            )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval kv_quant_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="speed,answers,needle,kl")
    ap.add_argument("--dtype", default="float32", help="answers and needle (reuse is bit-exact in float32)")
    ap.add_argument("--limit", type=int, default=None, help="the first N questions only (a smoke run)")
    ap.add_argument("--out", default=str(RESULTS / "kv_quant_bench"))
    ap.add_argument("--table-only", action="store_true", help="rewrite the table from the records in --out")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        records = read_records(out)
        write_table(out, table(records))
        return 0
    records: list[dict] = []
    for part in args.parts.split(","):
        {"answers": answers, "needle": needle, "kl": kl, "speed": speed}[part](args, records)
        write_records(out, records)
        write_table(out, table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
