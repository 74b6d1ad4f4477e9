"""The skim's early exit (issue 75, item 1): the same needle haystacks skimmed with the whole
forward and with the forward stopped after the deepest layer the skim's heads are in.

Each case is a needle (:mod:`snapkv_rag.harness.needle`, ``passkey`` wording) hidden at one of
the 15 depths of a 16K or 32K haystack, ingested as one file (256-token chunks), retrieved whole
and skimmed as :class:`~snapkv_rag.rag.DocumentQA` skims (its default policy, rolled in
2,048-token chunks, the heads shipped for the model). Both reads run back to back on one engine;
the record has each one's wall-clock seconds, the needle chunk's rank in each ranking, and whether
the two rankings are identical (they must be: the layers past the exit cannot change the votes).

    .venv/bin/python -m eval skim_exit --lengths 16384 32768 --depths 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from eval.common.results_io import read_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.needle import build_needle_case
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.skim import skim, skim_heads_for, skim_policy

RESULTS = Path(__file__).resolve().parent / "results"
DEPTHS = tuple(round(0.02 + i * 0.96 / 14, 3) for i in range(15))
CHUNK_TOKENS = 256


def skim_both_ways(engine: Engine, case, tmp: Path, index: int) -> dict:
    folder = tmp / f"case{index}"
    folder.mkdir()
    (folder / "notes.txt").write_text(case.haystack + "\n")
    store = DocumentStore(f"exit{index}", path=tmp / "stores")
    store.ingest([folder], chunk_tokens=CHUNK_TOKENS, overlap=0)
    qa = DocumentQA(engine, store, compression=None, context_tokens=1000, kv_reuse="off", skim_tokens=case.target_tokens)
    wide = qa.skim_retriever.retrieve(case.question)
    policy = skim_policy(qa.policy(qa.skim_compression), wide.prompt_tokens, engine.context_length)
    heads = skim_heads_for(engine, qa.skim_layers, qa.skim_heads)
    whole = skim(engine, wide, policy, heads=heads, early_exit=False)
    early = skim(engine, wide, policy, heads=heads, early_exit=True)

    def needle_rank(result) -> int | None:
        ranked = result.ranking()
        return next((i + 1 for i, c in enumerate(ranked) if case.answer in c.text), None)

    return {
        "skimmed_prompt_tokens": whole.prompt_tokens,
        "documents": len(wide.chunks),
        "exit_after_layer": max(layer for layer, _ in heads),
        "layers": engine.info().num_layers,
        "whole_seconds": round(whole.seconds, 3),
        "early_exit_seconds": round(early.seconds, 3),
        "ratio": round(early.seconds / whole.seconds, 3),
        "needle_rank_whole": needle_rank(whole),
        "needle_rank_early_exit": needle_rank(early),
        "same_ranking": [c.id for c in whole.ranking()] == [c.id for c in early.ranking()],
    }


def table(records: list[dict]) -> list[str]:
    lines = [
        "| haystack tokens | cases | layers run | median s, whole forward | median s, early exit | median ratio | needle ranked 1st (whole / exit) | rankings identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length in sorted({r["length"] for r in records}):
        rows = [r for r in records if r["length"] == length]

        def median(key: str, rows: list[dict] = rows) -> float:
            return sorted(r[key] for r in rows)[len(rows) // 2]

        def first(key: str, rows: list[dict] = rows) -> int:
            return sum(r[key] == 1 for r in rows)

        lines.append(
            f"| {length:,} | {len(rows)} | {rows[0]['exit_after_layer'] + 1} of {rows[0]['layers']} | {median('whole_seconds'):.1f} | "
            f"{median('early_exit_seconds'):.1f} | {median('ratio'):.2f} | {first('needle_rank_whole')} / {first('needle_rank_early_exit')} | "
            f"{sum(r['same_ranking'] for r in rows)}/{len(rows)} |"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval skim_exit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="*", type=int, default=[16384, 32768])
    ap.add_argument("--depths", type=int, default=3, help="N depths spread over the 15 (0.02-0.98)")
    ap.add_argument("--out", type=Path, default=RESULTS / "skim_exit")
    ap.add_argument("--table-only", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = read_records(args.out, missing_ok=True)
    if not args.table_only:
        done = {(r["length"], r["depth"]) for r in records}
        step = max(1, (len(DEPTHS) - 1) // max(1, args.depths - 1))
        depths = DEPTHS[::step][: args.depths]
        engine = Engine.default()
        with tempfile.TemporaryDirectory(prefix="snapkv-skim-exit-") as tmp, (args.out / "records.jsonl").open("a") as sink:
            for index, (length, depth) in enumerate((n, d) for n in args.lengths for d in depths):
                if (length, depth) in done:
                    continue
                case = build_needle_case(engine.tokenizer, length, depth, seed=int(depth * 100) + length, wording="passkey", varied=True)
                record = {"length": length, "depth": depth} | skim_both_ways(engine, case, Path(tmp), index)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                records.append(record)
                print(json.dumps(record), flush=True)
    write_table(args.out, table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
