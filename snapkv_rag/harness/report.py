"""Turn evaluation records into JSON lines, Markdown tables and PNG plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .metrics import citation_prf, micro_prf, relative_difference
from .runner import Record, median


def write_jsonl(records: Iterable[Record], path: Path) -> None:
    with path.open("w") as fh:
        for record in records:
            fh.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _key(record: Record) -> tuple[str, int]:
    return record["method"], record["budget"] if record["budget"] is not None else -1


def _label(method: str, budget: int) -> str:
    return method if budget < 0 else f"{method} @ {budget}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _grouped(records: Sequence[Record]) -> dict[tuple[str, int], list[Record]]:
    groups: dict[tuple[str, int], list[Record]] = defaultdict(list)
    for r in records:
        groups[_key(r)].append(r)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], kv[0][1])))


def settings_line(records: Sequence[Record]) -> str:
    r = records[0]
    return (
        f"model `{r['model']}`, dtype {r['dtype']}, device {r['device']}, threads {r['threads']}, "
        f"batch {r['batch_size']}, snapkv-rag {r['version']}; method settings are in each JSON record"
    )


# ------------------------------------------------------------------------------ summaries
def summarize_needle(records: Sequence[Record]) -> str:
    rows = []
    for (method, budget), group in _grouped(records).items():
        where_full = [r for r in group if r["full_found"]]
        rows.append(
            (
                _label(method, budget),
                len(group),
                _mean([float(r["found"]) for r in group]),
                _mean([float(r["found"]) for r in where_full]) if method != "full" else 1.0,
                round(median(r["prompt_tokens"] for r in group)),
            )
        )
    return _table(["method", "cases", "exact match", "kept where full finds it", "median prompt tokens"], rows)


def _routes(records: Sequence[Record]) -> list[str]:
    order = ["generated", "attributed"]
    return sorted({r.get("route", "generated") for r in records}, key=lambda x: (order.index(x) if x in order else 9, x))


def _rate(values: Iterable[Any]) -> float:
    values = [float(v) for v in values if v is not None]
    return _mean(values)


def summarize_citation(records: Sequence[Record]) -> str:
    """Per method x budget x route: agreement and gold F1, invalid citations, answer accuracy;
    retrieval recall and the attribution sweep (uncompressed answers) when the records have them."""
    parts = []
    full = [r for r in records if r["method"] == "full"]
    by_question = {r["question_index"]: r for r in full}
    if full and "gold_retrieved" in full[0]:
        hits = sum(bool(r["gold_retrieved"]) for r in by_question.values())
        first = full[0]
        parts.append(
            f"Corpus `{first['corpus']}` ({first['corpus_files']} files, {first['corpus_chunks']} chunks of "
            f"{first['chunk_tokens']} embedder tokens), {len(by_question)} questions, {first['context_tokens']} LLM tokens of "
            f"documents per prompt (median {round(median(r['stuffed_chunks'] for r in by_question.values()))} chunks, "
            f"median prompt {round(median(r['prompt_tokens'] for r in by_question.values()))} tokens), "
            f"{first['max_new_tokens']} new tokens at most, greedy. Attributed route: {first['attribution']}."
        )
        parts.append(f"Retrieval recall (a gold file among the stuffed chunks): {hits}/{len(by_question)} = {hits / len(by_question):.3f}.")
    rows = []
    for (method, budget), group in _grouped(records).items():
        for route in _routes(group):
            rg = [r for r in group if r.get("route", "generated") == route]
            full_rg = [r for r in full if r.get("route", "generated") == route]
            full_gold = _mean([r["gold_f1"] for r in full_rg])
            gold = _mean([r["gold_f1"] for r in rg])
            rows.append(
                (
                    _label(method, budget),
                    route,
                    len(rg),
                    _mean([r["agreement_f1"] for r in rg]),
                    micro_prf([(r["cited"], r["full_cited"]) for r in rg])[2],
                    _mean([float(r["identical_text"]) for r in rg]),
                    gold,
                    micro_prf([(r["cited"], r["gold"]) for r in rg])[2],
                    relative_difference(gold, full_gold) if method != "full" else 0.0,
                    sum(len(r["invalid_citations"]) for r in rg),
                    _rate(r["answer_correct"] for r in rg),
                )
            )
    header = [
        "method",
        "route",
        "questions",
        "agreement F1 (macro)",
        "agreement F1 (micro)",
        "identical answers",
        "gold F1 (macro)",
        "gold F1 (micro)",
        "gold F1 rel. diff vs full",
        "invalid citations",
        "answer accuracy",
    ]
    parts.append(_table(header, rows))
    sweep = summarize_attribution_sweep(records)
    if sweep:
        parts.append("Attribution settings on the uncompressed answers (attributed route; best threshold/margin per method, and the default):\n\n" + sweep)
    return "\n\n".join(parts)


def attribution_sweep_rows(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    """(setting, gold F1 macro, gold F1 micro, macro where a gold file was stuffed, share citing anything)."""
    rows = [r for r in records if r["method"] == "full" and r.get("attribution_sweep")]
    if not rows:
        return []
    out = []
    for key in rows[0]["attribution_sweep"]:
        pairs = [(r["attribution_sweep"][key], r["gold"]) for r in rows]
        retrieved = [(c, g) for c, g in pairs if g]
        out.append(
            (
                key,
                _mean([citation_prf(c, g)[2] for c, g in pairs]),
                micro_prf(pairs)[2],
                _mean([citation_prf(c, g)[2] for c, g in retrieved]),
                _mean([float(bool(c)) for c, _ in pairs]),
            )
        )
    return out


def summarize_attribution_sweep(records: Sequence[Record]) -> str:
    rows = attribution_sweep_rows(records)
    if not rows:
        return ""
    current = next((r["attribution"] for r in records if r.get("attribution")), None)
    chosen = []
    for method in dict.fromkeys(k.split(":")[0] for k, *_ in rows):
        mine = [r for r in rows if r[0].startswith(method + ":")]
        best = max(mine, key=lambda r: (r[1], r[2]))
        chosen.append((*best, "best"))
        if current and current.get("method") == method:
            key = f"{method}:threshold={current['threshold']:g},margin={current['margin']:g}"
            default = next((r for r in mine if r[0] == key), None)
            if default is not None and default is not best:
                chosen.append((*default, "default"))
    header = ["setting", "gold F1 (macro)", "gold F1 (micro)", "gold F1 where gold was stuffed", "answers citing anything", ""]
    return _table(header, chosen)


def gap_closed(less: float, base: float, full: float) -> float:
    """Share of the base policy's gap to the full cache that LESS closes: ``(m_less - m_base) / (m_full - m_base)``."""
    return (less - base) / (full - base) if full != base else math.nan


def summarize_heldout(records: Sequence[Record]) -> str:
    """LESS against its base policy and baseline+ (same memory): per prompt length, base and
    budget, then over all lengths; means over prompts (decode times: medians). Several LESS
    kernels for one base and budget get a row each, against the same base rows, and a
    "LESS kernels" column."""
    by: dict[tuple[Any, str, int], dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    full: dict[Any, list[Record]] = defaultdict(list)
    kernel_labels: list[str] = []
    for r in records:
        if r["role"] == "less" and r["settings"]["kernels"] not in kernel_labels:
            kernel_labels.append(r["settings"]["kernels"])
        for length in (r["target_tokens"], "all"):
            if r["role"] == "full":
                full[length].append(r)
                continue
            base_name = r["settings"]["base"]["method"] if r["role"] == "less" else r["settings"]["method"]
            by[(length, base_name, r["budget"])][r["role"]].append(r)
    rows = []
    for (length, base_name, budget), roles in sorted(by.items(), key=lambda kv: (kv[0][0] == "all", str(kv[0][0]).zfill(8), kv[0][1], kv[0][2])):
        labels: list[str | None] = [label for label in kernel_labels if any(r["settings"]["kernels"] == label for r in roles.get("less", []))] or [None]
        for label in labels:
            group = dict(roles, less=[r for r in roles.get("less", []) if r["settings"]["kernels"] == label])

            def m(role: str, field: str, how=_mean, group=group) -> float:
                return how([r[field] for r in group.get(role, []) if r.get(field) is not None])

            kl = {role: m(role, "kl_mean") for role in ("base", "baseline+", "less")}
            ppl = {role: m(role, "perplexity") for role in ("base", "baseline+", "less")}
            full_ppl = _mean([r["perplexity"] for r in full[length]])
            base_kl = {r["prompt_index"]: r["kl_mean"] for r in group.get("base", [])}
            less_better = sum(r["kl_mean"] < base_kl.get(r["prompt_index"], math.nan) for r in group["less"])
            base_ms, less_ms, low_ms = (
                m("base", "decode_ms_per_token", median),
                m("less", "decode_ms_per_token", median),
                m("less", "low_rank_ms_per_step", median),
            )
            plus = group.get("baseline+", [])
            extra = plus[0]["settings"]["max_capacity_prompt"] - budget if plus else math.nan
            rows.append(
                (
                    length,
                    base_name,
                    budget,
                    len(group.get("base", [])),
                    extra,
                    kl["base"],
                    kl["baseline+"],
                    kl["less"],
                    gap_closed(kl["less"], kl["base"], 0.0),
                    f"{less_better}/{len(group['less'])}",
                    gap_closed(kl["baseline+"], kl["base"], 0.0),
                    full_ppl,
                    ppl["base"],
                    ppl["baseline+"],
                    ppl["less"],
                    gap_closed(ppl["less"], ppl["base"], full_ppl),
                    base_ms,
                    less_ms,
                    low_ms,
                )
                + ((label,) if len(kernel_labels) > 1 else ())
            )
    header = [
        "prompt tokens",
        "base",
        "budget",
        "prompts",
        "baseline+ extra tokens",
        "KL base",
        "KL baseline+",
        "KL LESS",
        "KL gap closed (LESS)",
        "prompts LESS below base",
        "KL gap closed (baseline+)",
        "ppl full",
        "ppl base",
        "ppl baseline+",
        "ppl LESS",
        "ppl gap closed (LESS)",
        "decode ms/token base",
        "decode ms/token LESS",
        "low-rank part ms/step",
    ] + (["LESS kernels"] if len(kernel_labels) > 1 else [])
    return _table(header, rows)


def summarize_fidelity(records: Sequence[Record]) -> str:
    if records and records[0].get("prompt_source") == "heldout":
        return summarize_heldout(records)
    rows = []
    for (method, budget), group in _grouped(records).items():
        rows.append(
            (
                _label(method, budget),
                len(group),
                _mean([r["agreement_prefix"] for r in group]),
                _mean([r["agreement_overall"] for r in group]),
                _mean([r["kl_mean"] for r in group]),
                _mean([r["top1_agreement"] for r in group]),
            )
        )
    return _table(["method", "prompts", "greedy agreement (prefix)", "greedy agreement (overall)", "mean KL(full ‖ method)", "top-1 agreement"], rows)


def summarize_batch_speed(records: Sequence[Record]) -> str:
    rows = [
        (
            r["batch_size"],
            r["prompt_tokens"],
            _label(r["method"], r["budget"] if r["budget"] is not None else -1),
            r["largest_bucket"],
            r["single_seconds"],
            r["batch_seconds"],
            r["batch_tokens_per_second"] / r["single_tokens_per_second"],
            r["single_decode_ms_per_step"],
            r["batch_decode_ms_per_step"],
            "yes" if r["same_tokens"] else "no",
        )
        for r in records
    ]
    header = [
        "prompts",
        "mean prompt tokens",
        "method",
        "largest bucket",
        "single calls s",
        "one batch call s",
        "throughput batch / single",
        "decode ms/step single",
        "decode ms/step batch",
        "same tokens",
    ]
    return _table(header, rows)


def summarize_speed(records: Sequence[Record]) -> str:
    batch = [r for r in records if r.get("kind") == "batch"]
    records = [r for r in records if r.get("kind") != "batch"]
    text = _summarize_single_speed(records) if records else ""
    if batch:
        text += "\n\nBatch vs single calls (generated tokens per second; same prompts, interleaved):\n\n" + summarize_batch_speed(batch)
    return text


def _summarize_single_speed(records: Sequence[Record]) -> str:
    by_length: dict[int, dict[tuple[str, int], list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_length[r["target_tokens"]][_key(r)].append(r)
    rows = []
    for length in sorted(by_length):
        groups = by_length[length]
        full = groups.get(("full", -1), [])
        full_prefill = median(r["prefill_seconds"] for r in full)
        full_decode = median(r["decode_ms_per_token"] for r in full)
        for (method, budget), group in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0])):
            prefill = median(r["prefill_seconds"] for r in group)
            decode = median(r["decode_ms_per_token"] for r in group)
            rows.append(
                (
                    round(median(r["prompt_tokens"] for r in group)),
                    _label(method, budget),
                    prefill,
                    prefill / full_prefill if full else math.nan,
                    decode,
                    full_decode / decode if full else math.nan,
                    median(r["decode_floor_ms"] for r in group),
                    median(r["prompt_kv_bytes_kept"] for r in group) / 2**20,
                    median(r["prompt_kv_bytes_full"] for r in group) / 2**20,
                    median(r["peak_memory_bytes"] for r in group) / 2**20,
                )
            )
    header = [
        "prompt tokens",
        "method",
        "prefill s",
        "prefill vs full",
        "decode ms/token",
        "decode speed-up vs full",
        "decode floor ms",
        "KV kept MiB",
        "KV full MiB",
        "peak RSS MiB",
    ]
    bw = records[0]["bandwidth_bytes_per_second"] / 1e9 if records else math.nan
    return _table(header, rows) + f"\n\nMeasured copy bandwidth: {bw:.1f} GB/s; weights {records[0]['weight_bytes'] / 2**20:.0f} MiB."


SUMMARIES: dict[str, Callable[[Sequence[Record]], str]] = {
    "needle": summarize_needle,
    "citation": summarize_citation,
    "fidelity": summarize_fidelity,
    "speed": summarize_speed,
}


# ---------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_needle(records: Sequence[Record], out: Path) -> list[Path]:
    plt = _pyplot()
    groups = _grouped(records)
    depths = sorted({r["depth"] for r in records})
    lengths = sorted({r["target_tokens"] for r in records})
    cols = min(4, len(groups))
    rows_n = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.8 * rows_n), squeeze=False)
    for ax, ((method, budget), group) in zip(axes.flat, groups.items()):
        grid = [[math.nan] * len(lengths) for _ in depths]
        for di, d in enumerate(depths):
            for li, length in enumerate(lengths):
                hits = [float(r["found"]) for r in group if r["depth"] == d and r["target_tokens"] == length]
                grid[di][li] = _mean(hits)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(_label(method, budget), fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_xlabel("prompt tokens", fontsize=8)
        ax.set_ylabel("depth", fontsize=8)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    fig.suptitle("Needle exact match (green = found)", fontsize=10)
    fig.tight_layout()
    path = out / "needle_heatmap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _by_budget_plot(records, out: Path, metrics: Sequence[tuple[str, str]], filename: str, title: str) -> Path:
    plt = _pyplot()
    groups = _grouped(records)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, (field, ylabel) in zip(axes.flat, metrics):
        methods = sorted({m for m, b in groups if b >= 0})
        for method in methods:
            budgets = sorted(b for m, b in groups if m == method)
            ax.plot(budgets, [_mean([r[field] for r in groups[(method, b)]]) for b in budgets], marker="o", label=method)
        for (m, b), group in groups.items():
            if b < 0:
                ax.axhline(_mean([r[field] for r in group]), linestyle="--", linewidth=1, color="gray" if m == "full" else "black", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (kept prompt tokens per head)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_citation(records: Sequence[Record], out: Path) -> list[Path]:
    """One row of panels per citation route: agreement F1, gold F1 and answer accuracy vs budget."""
    plt = _pyplot()
    routes = _routes(records)
    metrics = [("agreement_f1", "agreement F1 vs full"), ("gold_f1", "gold F1"), ("answer_correct", "answer accuracy")]
    fig, axes = plt.subplots(len(routes), len(metrics), figsize=(5 * len(metrics), 3.4 * len(routes)), squeeze=False)
    for row, route in zip(axes, routes):
        groups = _grouped([r for r in records if r.get("route", "generated") == route])
        for ax, (field, ylabel) in zip(row, metrics):
            for method in sorted({m for m, b in groups if b >= 0}):
                budgets = sorted(b for m, b in groups if m == method)
                ax.plot(budgets, [_rate(r[field] for r in groups[(method, b)]) for b in budgets], marker="o", label=method)
            for (m, b), group in groups.items():
                if b < 0:
                    ax.axhline(_rate(r[field] for r in group), linestyle="--", linewidth=1, color="gray" if m == "full" else "black", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (kept prompt tokens per head)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{route} route", fontsize=9)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.suptitle("Citations on the RAG pipeline vs budget", fontsize=10)
    fig.tight_layout()
    path = out / "citation_f1_vs_budget.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_fidelity(records: Sequence[Record], out: Path) -> list[Path]:
    if records and records[0].get("prompt_source") == "heldout":
        metrics = [("kl_mean", "mean KL(full || method)"), ("perplexity", "perplexity of the held-out continuation")]
        return [_by_budget_plot(records, out, metrics, "heldout_fidelity_vs_budget.png", "LESS vs base and baseline+ (held-out text)")]
    metrics = [("kl_mean", "mean KL(full || method)"), ("top1_agreement", "top-1 agreement"), ("agreement_prefix", "greedy agreement (prefix)")]
    return [_by_budget_plot(records, out, metrics, "fidelity_vs_budget.png", "Fidelity vs budget")]


def plot_speed(records: Sequence[Record], out: Path) -> list[Path]:
    records = [r for r in records if r.get("kind") != "batch"]
    plt = _pyplot()
    groups = _grouped(records)
    panels = [
        ("decode_ms_per_token", "decode ms / token"),
        ("prefill_seconds", "prefill s"),
        ("prompt_kv_bytes_kept", "KV bytes kept (MiB)"),
        ("peak_memory_bytes", "peak memory (MiB)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    for ax, (field, ylabel) in zip(axes, panels):
        scale = 2**20 if "bytes" in field else 1
        for (method, budget), group in groups.items():
            lengths = sorted({r["prompt_tokens"] for r in group})
            ys = [median(r[field] for r in group if r["prompt_tokens"] == n) / scale for n in lengths]
            ax.plot(lengths, ys, marker="o", label=_label(method, budget))
        if field == "decode_ms_per_token":
            floor = groups.get(("full", -1), [])
            lengths = sorted({r["prompt_tokens"] for r in floor})
            ax.plot(lengths, [median(r["decode_floor_ms"] for r in floor if r["prompt_tokens"] == n) for n in lengths], "k:", label="floor (full)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "speed_memory_vs_length.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


PLOTS: dict[str, Callable[[Sequence[Record], Path], list[Path]]] = {
    "needle": plot_needle,
    "citation": plot_citation,
    "fidelity": plot_fidelity,
    "speed": plot_speed,
}


def write_report(task: str, records: Sequence[Record], out: Path, command: str | None = None) -> dict[str, Path]:
    """Write ``<task>.jsonl``, ``<task>.md`` and the task's PNG plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"{task}.jsonl"
    write_jsonl(records, jsonl)
    plots = PLOTS[task](records, out) if records else []
    lines = [f"## {task}", ""]
    if command:
        lines += [f"Produced by `{command}`", ""]
    if records:
        lines += [settings_line(records), "", SUMMARIES[task](records), ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    markdown = out / f"{task}.md"
    markdown.write_text("\n".join(lines) + "\n")
    return {"jsonl": jsonl, "markdown": markdown, **{p.stem: p for p in plots}}
