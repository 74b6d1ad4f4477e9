"""Citations from the run's own attention (issue 30) against the attributed route and top-2 retrieval.

Citations from the run's own attention (issue 30): the attention route against the attributed one
and the top-2 retrieval baseline, and the choice of its weight.

The 40 sample questions over examples/sample_corpus, 1,000 stuffed tokens (the embedded model's
stuffing), 32 new tokens, greedy, the engine's default dtype; each question answered with the
full cache and with SnapKV (question window) at budget 256 (4x). Every run records, per
generated token, its attention share of each stuffed chunk (``attend_to``). Each answer's
sentences are then cited offline under every setting of the grid: evidence scores (hybrid)
plus ``weight * share / best share``, with the key-fact gate, threshold 0.6 and each margin;
``weight 0`` is the attributed route, "attention only" ranks by the share alone. Gold F1 as in
the citation eval: cited chunks against the stuffed chunks from the gold file.

    .venv/bin/python -m eval attention_citations [--questions N] [--out DIR] [--from-records DIR/records.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from eval.common.results_io import write_records, write_table
from snapkv_rag.harness.metrics import citation_prf
from snapkv_rag.rag.attribution import DEFAULT_THRESHOLDS, answer_sentences, choose_gated, fact_gate, score_matrices, with_attention

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {"full": None, "snapkv 256 (4x)": "snapkv:budget=256,window=question"}
WEIGHTS = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, None]  # None: attention only
MARGINS = [0.1, 0.2, 0.3]


def run(questions: int | None) -> list[dict]:
    from snapkv_rag import Engine
    from snapkv_rag.compression.span_attention import sentence_attention
    from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file, load_questions
    from snapkv_rag.rag import DocumentQA, DocumentStore
    from snapkv_rag.rag.qa import ROUTES

    qs = load_questions(ROOT / "examples/sample_questions.jsonl", questions)
    engine = Engine.default()
    records = []
    with tempfile.TemporaryDirectory(prefix="snapkv-attention-cite-") as tmp:
        store = DocumentStore("attention-citations", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        qa = DocumentQA(
            engine, store, compression=None, context_tokens=1000, max_new_tokens=32, kv_reuse="prefix", routes=ROUTES
        )  # the attention route is opt-in
        for q in qs:
            context = qa.retrieve(q.question)
            texts = [c.text for c in context.chunks]
            gold = [i + 1 for i, c in enumerate(context.chunks) if is_gold_file(c.file, q.gold)]
            for method, policy in METHODS.items():
                answer = qa.answer_context(context, compression=policy)
                sentences = answer_sentences(answer.text)
                result = answer.result
                if not (result.stats.span_attention or "").startswith("recorded"):  # a silent zero would pass as a result
                    sys.exit(f"attention was not recorded ({result.stats.span_attention}); every attention row would be empty")
                shares = sentence_attention(engine.tokenizer, result.token_ids, result.span_attention or [], sentences) if sentences else []
                evidence = score_matrices(store.embedder, context.question, sentences, texts, ("hybrid",)).get("hybrid", []) if sentences else []
                gates = [fact_gate(s, context.question, texts) for s in sentences]
                records.append(
                    {
                        "method": method,
                        "question": q.question,
                        "answer": answer.text,
                        "correct": answer_correct(answer.text, q.answer),
                        "gold": gold,
                        "chunks": len(texts),
                        "sentences": sentences,
                        "evidence": evidence,
                        "gates": [[g[0], sorted(g[1])] for g in gates],
                        "attention": shares,
                        "span_attention_stat": result.stats.span_attention,
                        "attributed": answer.cited("attributed"),
                        "attention_route": answer.cited("attention"),
                    }
                )
                print(json.dumps({k: records[-1][k] for k in ("method", "question", "answer", "correct", "gold", "attributed", "attention_route")}), flush=True)
    return records


def cite(record: dict, weight: float | None, margin: float, gated: bool = True) -> list[int]:
    cited: set[int] = set()
    threshold = DEFAULT_THRESHOLDS["hybrid"]
    for evidence, shares, (eligible, missing) in zip(record["evidence"], record["attention"], record["gates"]):
        gate = (eligible, set(missing)) if gated else None
        if weight is None:
            best = max(shares, default=0.0)
            row = [s / best if best > 0 else 0.0 for s in shares]
            chosen = choose_gated(row, gate, 0.0, margin)
        else:
            chosen = choose_gated(with_attention(evidence, shares, weight), gate, threshold, margin)
        cited.update(i + 1 for i in chosen)
    return sorted(cited)


def macro(records: list[dict], cited_of) -> tuple[float, float, float]:
    prf = [citation_prf(cited_of(r), r["gold"]) for r in records]
    return tuple(statistics.mean(x[i] for x in prf) for i in range(3))  # type: ignore[return-value]


def line(label: str, method: str, rows: list[dict], cited_of) -> str:
    p, rc, f = macro(rows, cited_of)
    right = [r for r in rows if r["correct"]]
    fr = macro(right, cited_of)[2] if right else float("nan")
    return f"| {label} | {method} | {p:.3f} | {rc:.3f} | {f:.3f} | {fr:.3f} |"


def table(records: list[dict]) -> list[str]:
    lines = ["| citation | method | gold precision | gold recall | gold F1 (macro) | gold F1, right answers |", "|---|---|---|---|---|---|"]
    for method in METHODS:
        rows = [r for r in records if r["method"] == method]
        lines.append(line("top-2 retrieval", method, rows, lambda r: [1, 2][: r["chunks"]]))
        for weight in WEIGHTS:
            for margin in MARGINS:
                label = "attention only" if weight is None else ("attributed (weight 0)" if weight == 0 else f"evidence + {weight:g} x attention")
                lines.append(line(f"{label}, margin {margin:g}", method, rows, lambda r, w=weight, m=margin: cite(r, w, m)))
        for margin in MARGINS:
            lines.append(line(f"attention only, no key-fact gate, margin {margin:g}", method, rows, lambda r, m=margin: cite(r, None, m, gated=False)))
        lines.append(line("attention route as shipped", method, rows, lambda r: r["attention_route"]))
    accuracy = {m: sum(r["correct"] for r in records if r["method"] == m) for m in METHODS}
    n = len([r for r in records if r["method"] == "full"])
    lines += ["", f"{n} questions; answers right: " + ", ".join(f"{m} {a}/{n}" for m, a in accuracy.items())]
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval attention_citations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS / "attention_citations"))
    ap.add_argument("--from-records", default=None, help="re-score stored records instead of generating")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.from_records:
        records = [json.loads(line) for line in Path(args.from_records).read_text().splitlines() if line.strip()]
    else:
        records = run(args.questions)
        write_records(out, records)
    write_table(out, table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
