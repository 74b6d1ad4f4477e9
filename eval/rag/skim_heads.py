"""Choose the attention heads a skim reads for the embedded model (issue 66), on generated reads.

:func:`snapkv_rag.rag.skim_heads.choose_heads` reads ``--reads`` generated look-alike contexts of the
tuning world's training domains (about ``--tokens`` document tokens each, a question naming its
entity by a fact of the gold document) once under DocumentQA's default policy, and keeps the
``--top`` heads whose attention from the question ranks the gold document highest. The choice is
written as package data (``snapkv_rag/rag/skim_heads/smollm2-135m-instruct.json``), which
DocumentQA's skim reads by default for these weights; the table compares the chosen heads with
every head of the middle layers and with prompt position alone (mean reciprocal rank of the gold
document, on the calibration reads themselves: the held-out measure is ``long_reads``).

    .venv/bin/python -m eval skim_heads [--reads 16] [--tokens 3000] [--top 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval.common.results_io import write_table
from snapkv_rag import Engine
from snapkv_rag.harness.skim_head_reads import calibration_reads
from snapkv_rag.rag.qa import DEFAULT_COMPRESSION
from snapkv_rag.rag.skim_heads import SHIPPED, TOP_HEADS, choose_heads

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval skim_heads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--top", type=int, default=TOP_HEADS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ship", type=Path, default=SHIPPED / "smollm2-135m-instruct.json", help="where the choice is written")
    ap.add_argument("--out", type=Path, default=RESULTS / "skim_heads")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine.default(adapter=None)
    reads = calibration_reads(
        args.reads, seed=args.seed, tokens=args.tokens, count_tokens=lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    )
    heads = choose_heads(engine, reads, DEFAULT_COMPRESSION, top=args.top, progress=lambda line: print(line, flush=True))
    args.ship.parent.mkdir(parents=True, exist_ok=True)
    args.ship.write_text(heads.to_json() + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(
        args.out,
        [
            f"Calibration reads: {heads.reads}, about {heads.tokens} document tokens each; heads chosen: {heads.heads}",
            "",
            "| ranking of the documents | gold document's mean reciprocal rank |",
            "|---|---|",
            f"| the {len(heads.heads)} chosen heads | {heads.mrr:.3f} |",
            f"| every head of the middle layers | {heads.band_mrr:.3f} |",
            f"| prompt position (last first) | {heads.position_mrr:.3f} |",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
