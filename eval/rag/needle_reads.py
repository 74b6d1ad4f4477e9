"""Needles past the window, read in one pass and skimmed (issue 66): does the skim find what a
rolled read loses?

Each case is a needle (:mod:`snapkv_rag.harness.needle`, wording ``passkey`` or ``code``, the
second never used by any prompt or training example) at one of 15 depths of a 16K or 32K haystack
whose filler repeats in varied order (a store keeps one copy of a repeated chunk, so the plain
haystack would shrink to a few chunks), read one of these ways, greedy, 16 new tokens:

- ``rolled``: the raw prompt (instructions, haystack, question) in one pass under
  ``snapkv:budget=1024,window=question,rolling=1024`` (issue 46's reading, the issue's target);
- ``docs-snapkv:whole``, ``docs-skim:whole>1K``, ``docs-full:1K``: the haystack ingested as a
  file (chunks of 256 tokens, no overlap) and read by :class:`~snapkv_rag.rag.DocumentQA` as
  :mod:`eval.rag.long_reads` reads a corpus: every chunk in one compressed pass (its default
  policy, rolled), skim then read 1K, or the retriever's top 1K with the full cache.

Records are appended as they are made and a rerun skips what is there (resumable).

    .venv/bin/python -m eval needle_reads --wordings passkey code --lengths 16384 32768
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eval.common.results_io import append_record, read_records, write_table
from eval.rag.long_reads import reader
from snapkv_rag import Engine
from snapkv_rag.harness.metrics import needle_exact_match
from snapkv_rag.harness.needle import NEEDLE_WORDINGS, build_needle_case
from snapkv_rag.rag import DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"
READINGS = ("rolled", "docs-snapkv:whole", "docs-skim:whole>1K", "docs-full:1K")
ROLLED = "snapkv:budget=1024,window=question,rolling=1024"
DEPTHS = tuple(round(0.02 + i * 0.96 / 14, 3) for i in range(15))
MAX_NEW_TOKENS = 16
CHUNK_TOKENS = 256  # without overlap: the documents hold the haystack once


def read_case(engine: Engine, case, reading: str, tmp: Path, index: int) -> dict:
    """One reading of one needle case: the record's answer, hit and costs."""
    start = time.perf_counter()
    if reading == "rolled":
        result = engine.generate(case.prompt, compression=ROLLED, max_new_tokens=MAX_NEW_TOKENS)
        found = None
        prefill, text = result.stats.prefill_seconds, result.text
        kept = max(result.stats.kept_tokens_per_layer or [result.usage.prompt_tokens])
        skimmed = None
    else:
        folder = tmp / f"case{index}"
        folder.mkdir()
        (folder / "notes.txt").write_text(case.haystack + "\n")
        store = DocumentStore(f"needle{index}", path=tmp / "stores")
        store.ingest([folder], chunk_tokens=CHUNK_TOKENS, overlap=0)
        qa = reader(engine, store, reading.removeprefix("docs-"))
        context = qa.retrieve(case.question)
        answer = qa.answer_context(context)
        result, text = answer.result, answer.text
        found = any(case.answer in c.text for c in context.chunks)
        skim = context.settings.get("skim", {})
        prefill = result.stats.prefill_seconds + skim.get("skim_seconds", 0.0)
        kept = max(result.stats.kept_tokens_per_layer or [result.usage.prompt_tokens])
        skimmed = skim.get("skimmed_prompt_tokens")
    return {
        "answer": text,
        "hit": needle_exact_match(text, case.answer),
        "needle_in_read": found,
        "prompt_tokens": result.usage.prompt_tokens,
        "skimmed_prompt_tokens": skimmed,
        "kept_tokens_per_layer": kept,
        "prefill_seconds": round(prefill, 3),
        "seconds": round(time.perf_counter() - start, 3),
    }


def table(records: list[dict]) -> list[str]:
    lines = [
        "| model | wording | haystack tokens | reading | depths | found | needle in the re-read | median prompt tokens read | median s per case |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = dict.fromkeys((r["model"], r["wording"], r["length"], r["reading"]) for r in records)
    for key in sorted(keys, key=lambda k: (k[0], k[1], k[2], READINGS.index(k[3]))):
        rows = [r for r in records if (r["model"], r["wording"], r["length"], r["reading"]) == key]
        inside = [r["needle_in_read"] for r in rows if r["needle_in_read"] is not None]
        tokens = sorted(r["prompt_tokens"] for r in rows)[len(rows) // 2]
        seconds = sorted(r["seconds"] for r in rows)[len(rows) // 2]
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]:,} | {key[3]} | {len(rows)} | {sum(r['hit'] for r in rows)}/{len(rows)} | "
            f"{f'{sum(inside)}/{len(inside)}' if inside else '-'} | {tokens:,} | {seconds:.1f} |"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval needle_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--wordings", nargs="*", choices=sorted(NEEDLE_WORDINGS), default=["passkey"])
    ap.add_argument("--lengths", nargs="*", type=int, default=[16384, 32768])
    ap.add_argument("--readings", nargs="*", choices=READINGS, default=list(READINGS))
    ap.add_argument("--depths", type=int, default=len(DEPTHS), help="the first N of the 15 depths (0.02-0.98)")
    ap.add_argument("--adapter", default=None, help="a LoRA adapter directory or auto:documents (default: the bare model)")
    ap.add_argument("--label", default=None, help="the model's name in the records (default: base, or the adapter's name)")
    ap.add_argument("--out", type=Path, default=RESULTS / "needle_reads")
    ap.add_argument("--table-only", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.label or ("base" if args.adapter is None else Path(args.adapter).name)
    records = read_records(args.out, missing_ok=True)
    if not args.table_only:
        done = {(r["model"], r["wording"], r["length"], r["depth"], r["reading"]) for r in records}
        engine = Engine.default(adapter=args.adapter or "none", invariant=True)
        with tempfile.TemporaryDirectory(prefix="snapkv-needle-reads-") as tmp, (args.out / "records.jsonl").open("a") as sink:
            index = 0
            for wording in args.wordings:
                for length in args.lengths:
                    for depth in DEPTHS[: args.depths]:
                        case = build_needle_case(engine.tokenizer, length, depth, seed=int(depth * 100) + length, wording=wording, varied=True)
                        for reading in args.readings:
                            if (model, wording, length, depth, reading) in done:
                                continue
                            index += 1
                            record = {"model": model, "wording": wording, "length": length, "depth": depth, "reading": reading}
                            record |= read_case(engine, case, reading, Path(tmp), index)
                            append_record(sink, records, record)
    write_table(args.out, table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
