"""How the benchmarks leave their results: records.jsonl and table.md under --out."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def write_records(out: Path, records: Iterable[dict]) -> None:
    """One JSON line per record in ``out/records.jsonl`` (written before the table, so a long run's
    records survive a failure while the table is built)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def read_records(out: Path, *, missing_ok: bool = False) -> list[dict]:
    """The records a run left in ``out/records.jsonl`` (``missing_ok``: none yet is an empty list, not an error)."""
    path = out / "records.jsonl"
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_record(sink, records: list[dict], record: dict) -> None:
    """Keep one new record of a resumable run: a line of ``sink`` (its records.jsonl, opened to
    append; flushed, so a stopped run keeps it), ``records`` and the console."""
    line = json.dumps(record)
    sink.write(line + "\n")
    sink.flush()
    records.append(record)
    print(line, flush=True)


def write_table(out: Path, lines: list[str]) -> str:
    """``lines`` as ``out/table.md``, printed; returns the table."""
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return table


def peak_rss_bytes(stats) -> int:
    """A result's peak memory as the process RSS this benchmark's tables show; on CUDA the engine
    reports the allocator's peak instead (another quantity), so that is refused, not mislabelled."""
    if stats.peak_memory_kind != "cpu_rss_sampled":
        raise SystemExit(f"this benchmark reports process RSS, and the engine measured {stats.peak_memory_kind}: run it on the CPU")
    return stats.peak_memory_bytes
