"""The skim's cost (issue 75): the same needle haystacks skimmed with the whole forward, with the
early exit, and from stored keys (first skim: the chunks' K/V computed and stored; then reused),
and the question answered end to end from the stored-key skim against the same question answered
from the retriever's top 1K with the full cache.

Each case is a needle (:mod:`snapkv_rag.harness.needle`, ``passkey`` wording) hidden at one of
the 15 depths of a 16K or 32K haystack, ingested as one file (256-token chunks), retrieved whole
and skimmed as :class:`~snapkv_rag.rag.DocumentQA` skims (its default policy; rolled in 2,048-token
chunks, or in groups of that size from stored keys; the heads shipped for the model). All reads
run back to back on one engine; the record has each one's wall-clock seconds, the needle chunk's
rank in each ranking, whether the whole and early-exit rankings are identical (they must be), and
both answers with their hits.

    .venv/bin/python -m eval skim_reads --lengths 16384 32768 --depths 5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eval.common.results_io import append_record, read_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.metrics import needle_exact_match
from snapkv_rag.harness.needle import build_needle_case
from snapkv_rag.integrations import segment_store_at
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.skim import skim, skim_heads_for, skim_policy, skim_stored

RESULTS = Path(__file__).resolve().parent / "results"
DEPTHS = tuple(round(0.02 + i * 0.96 / 14, 3) for i in range(15))
CHUNK_TOKENS = 256
READ_TOKENS = 1000
MAX_NEW_TOKENS = 16


def read_case(engine: Engine, case, tmp: Path, index: int) -> dict:
    folder = tmp / f"case{index}"
    folder.mkdir()
    (folder / "notes.txt").write_text(case.haystack + "\n")
    store = DocumentStore(f"skim{index}", path=tmp / "stores")
    store.ingest([folder], chunk_tokens=CHUNK_TOKENS, overlap=0)
    options = dict(compression=None, context_tokens=READ_TOKENS, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
    qa = DocumentQA(engine, store, skim_tokens=case.target_tokens, **options)
    wide = qa.skim_retriever.retrieve(case.question)
    base = qa.policy(qa.skim_compression)
    heads = skim_heads_for(engine, qa.skim_layers, qa.skim_heads)
    rolled = skim_policy(base, wide.prompt_tokens, engine.context_length)
    whole = skim(engine, wide, rolled, heads=heads, early_exit=False)
    early = skim(engine, wide, rolled, heads=heads, early_exit=True)
    kv_dir = tmp / f"kv{index}"
    kv = segment_store_at(kv_dir, None)
    first = skim_stored(engine, wide, base.with_rolling(None), kv, heads=heads)
    second = skim_stored(engine, wide, base.with_rolling(None), kv, heads=heads)

    def needle_rank(result) -> int | None:
        return next((i + 1 for i, c in enumerate(result.ranking()) if case.answer in c.text), None)

    def answered(reader: DocumentQA) -> tuple[float, str]:
        start = time.perf_counter()
        text = reader.ask(case.question).text
        return time.perf_counter() - start, text

    full_seconds, full_text = answered(DocumentQA(engine, store, **options))
    stored_seconds, stored_text = answered(DocumentQA(engine, store, skim_tokens=case.target_tokens, skim_stored=True, kv_dir=str(kv_dir), **options))
    return {
        "skimmed_prompt_tokens": whole.prompt_tokens,
        "documents": len(wide.chunks),
        "exit_after_layer": max(layer for layer, _ in heads),
        "layers": engine.info().num_layers,
        "whole_seconds": round(whole.seconds, 3),
        "early_exit_seconds": round(early.seconds, 3),
        "stored_first_seconds": round(first.seconds, 3),
        "stored_seconds": round(second.seconds, 3),
        "stored_prompt_tokens": second.prompt_tokens,
        "stored_reused_tokens": second.reused_tokens,
        "needle_rank_whole": needle_rank(whole),
        "needle_rank_early_exit": needle_rank(early),
        "needle_rank_stored": needle_rank(second),
        "same_ranking": [c.id for c in whole.ranking()] == [c.id for c in early.ranking()],
        "full_1k_seconds": round(full_seconds, 3),
        "full_1k_answer": full_text,
        "full_1k_hit": needle_exact_match(full_text, case.answer),
        "stored_skim_answer_seconds": round(stored_seconds, 3),
        "stored_skim_answer": stored_text,
        "stored_skim_hit": needle_exact_match(stored_text, case.answer),
    }


def table(records: list[dict]) -> list[str]:
    lines = [
        "| haystack tokens | cases | layers run | skim s: whole | early exit | stored, first | stored, then | exit / whole | stored / whole "
        "| needle 1st: whole / exit / stored | rankings identical | answer s: 1K full / stored skim + 1K | ratio | hits: 1K full / stored skim |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in sorted({r["length"] for r in records}):
        rows = [r for r in records if r["length"] == length]

        def median(key: str, rows: list[dict] = rows) -> float:
            return sorted(r[key] for r in rows)[len(rows) // 2]

        def ratio(top: str, bottom: str, rows: list[dict] = rows) -> float:
            return sorted(r[top] / r[bottom] for r in rows)[len(rows) // 2]

        def count(key: str, value=True, rows: list[dict] = rows) -> int:
            return sum(r[key] == value for r in rows)

        lines.append(
            f"| {length:,} | {len(rows)} | {rows[0]['exit_after_layer'] + 1} of {rows[0]['layers']} | {median('whole_seconds'):.1f} | "
            f"{median('early_exit_seconds'):.1f} | {median('stored_first_seconds'):.1f} | {median('stored_seconds'):.1f} | "
            f"{ratio('early_exit_seconds', 'whole_seconds'):.2f} | {ratio('stored_seconds', 'whole_seconds'):.2f} | "
            f"{count('needle_rank_whole', 1)} / {count('needle_rank_early_exit', 1)} / {count('needle_rank_stored', 1)} | "
            f"{count('same_ranking')}/{len(rows)} | {median('full_1k_seconds'):.1f} / {median('stored_skim_answer_seconds'):.1f} | "
            f"{ratio('stored_skim_answer_seconds', 'full_1k_seconds'):.1f}x | {count('full_1k_hit')} / {count('stored_skim_hit')} |"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval skim_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="*", type=int, default=[16384, 32768])
    ap.add_argument("--depths", type=int, default=5, help="N depths spread over the 15 (0.02-0.98)")
    ap.add_argument("--out", type=Path, default=RESULTS / "skim_reads")
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
        with tempfile.TemporaryDirectory(prefix="snapkv-skim-reads-") as tmp, (args.out / "records.jsonl").open("a") as sink:
            for index, (length, depth) in enumerate((n, d) for n in args.lengths for d in depths):
                if (length, depth) in done:
                    continue
                case = build_needle_case(engine.tokenizer, length, depth, seed=int(depth * 100) + length, wording="passkey", varied=True)
                record = {"length": length, "depth": depth} | read_case(engine, case, Path(tmp), index)
                append_record(sink, records, record)
    write_table(args.out, table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
