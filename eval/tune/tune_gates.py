"""The gates of a tuned embedded model (issue 47): the adapter against the bare model on unseen text.

The gates of a tuned embedded model (issue 47): the adapter against the bare model, same settings,
on text the training never saw (the sample corpus and its 40 questions, the eval's two tool sets).

Parts, each run once per variant (``--variant base`` or ``tuned``) and stored as records:

- ``answers``: the 40 sample questions, retrieval-ranked chunks stuffed into 1K, 2K and 4K LLM
  tokens, answered with the full cache (greedy, 32 new tokens); at 2K also with chunk reuse
  (``kv_reuse="chunks"``, ``recompute=0.15``, every chunk's K/V precomputed) and with SnapKV at
  4x (question window, a quarter of the prompt kept). Each answer's own ``[n]`` markers are scored
  as gold F1 (gold: the stuffed chunks of the question's gold file), beside the baseline that cites
  the top two retrieved chunks.
- ``tools``: eval/agents/tool_decisions.py's two sets under ``tool_choice="auto"``, the model deciding as it
  writes (no call gate).

``--table-only`` compares the variants, writes table.md and, with ``--manifest DIR``, the gate
results into that adapter's manifest.json (the engine loads a shipped adapter by default only
when every gate passed).

    .venv/bin/python -m eval tune_gates --variant base
    .venv/bin/python -m eval tune_gates --variant tuned --adapter tune-runs/default/adapter
    .venv/bin/python -m eval tune_gates --table-only --manifest snapkv_rag/adapter_training/shipped/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eval.agents.tool_decisions import TOOLSETS, load, run
from eval.common.results_io import write_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import SnapKV
from snapkv_rag.harness.metrics import citation_prf
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file, load_questions
from snapkv_rag.model.adapter_rule import decide
from snapkv_rag.rag import DocumentQA, DocumentStore
from snapkv_rag.rag.kv_reuse import precompute_chunk_kv

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

SIZES = {"1K": 1000, "2K": 2000, "4K": 4000}
REUSE_SIZE = "2K"
RECOMPUTE = 0.15
MAX_NEW_TOKENS = 32
PARTS = ("answers", "tools")
OUT = RESULTS / "tune_gates"


def adapter_identity(adapter: str | None) -> dict:
    """Which weights a record measured: the adapter's directory and the sha256 of its weights file."""
    if adapter is None:
        return {"adapter": None, "adapter_sha256": None}
    path = Path(adapter) / "adapter_model.safetensors"
    return {"adapter": str(Path(adapter).resolve()), "adapter_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def parts_correct(output: str, answer: str) -> bool:
    """Every part of an "X and Y" gold answer in the output (two facts written as two sentences count)."""
    return all(part.strip().lower() in output.lower() for part in answer.split(" and "))


def answer_record(variant: str, size: str, setting: str, q, context, answer) -> dict:
    gold = [i + 1 for i, c in enumerate(context.chunks) if is_gold_file(c.file, q.gold)]
    cited = answer.cited("generated")
    return {
        "part": "answers",
        "variant": variant,
        "size": size,
        "setting": setting,
        "question": q.question,
        "prompt_tokens": answer.result.usage.prompt_tokens,
        "answer": answer.text,
        "correct": bool(answer_correct(answer.text, q.answer)),
        "parts_correct": parts_correct(answer.text, q.answer),
        "gold": gold,
        "cited": cited,
        "invalid_citations": answer.invalid_citations,
        "gold_f1": citation_prf(cited, gold)[2],
        "top2_gold_f1": citation_prf([n for n in (1, 2) if n <= len(context.chunks)], gold)[2],
    }


def run_answers(engine: Engine, variant: str, questions_limit: int | None, order: str = "forward") -> list[dict]:
    questions = ordered(load_questions(ROOT / "examples/sample_questions.jsonl", questions_limit), order)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="snapkv-tune-gates-") as tmp:
        store = DocumentStore("tune-gates", path=tmp)
        store.ingest([ROOT / "examples/sample_corpus"])
        chunked = DocumentQA(engine, store, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="chunks")
        precompute_chunk_kv(engine, store.all_chunks(), chunked.kv_store)
        for size, tokens in ordered(list(SIZES.items()), order):
            qa = DocumentQA(engine, store, compression=None, context_tokens=tokens, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
            for q in questions:
                context = qa.retrieve(q.question)
                runs = [("full", qa, None, {})]
                if size == REUSE_SIZE:
                    runs += [
                        # no prefix reuse: the blended prefill then depends only on its chunks, whatever ran before
                        (f"chunks r={RECOMPUTE}", chunked, None, {"recompute": RECOMPUTE, "prefix_cache": False}),
                        ("snapkv 4x", qa, SnapKV(window_size="question", max_capacity_prompt=max(64, context.prompt_tokens // 4)), {}),
                    ]
                for setting, reader, policy, extra in runs:
                    with approximations_allowed(engine, reader is chunked):
                        result = engine.generate(context.messages, **{**reader.generation_kwargs(context, compression=policy), **extra})
                    records.append(answer_record(variant, size, setting, q, context, reader.answer_from(context, result)))
                    print(json.dumps(records[-1]), flush=True)
    return records


@contextmanager
def approximations_allowed(engine: Engine, allow: bool) -> Iterator[None]:
    """The invariant mode off for one call: it refuses blended chunk reuse (an approximation by
    design), and the chunk-reuse gate measures exactly that approximation."""
    mode = engine.invariant
    engine.invariant = mode and not allow
    try:
        yield
    finally:
        engine.invariant = mode


def run_tools(engine: Engine, variant: str, order: str = "forward") -> list[dict]:
    return [{"part": "tools", "variant": variant, **r} for name in ordered(list(TOOLSETS), order) for r in run(engine, ordered(load(name), order))]


def ordered(items: list, order: str) -> list:
    """``items`` in the run's order: ``reversed`` computes the same prompts with another prefix-cache
    history, which moves bf16 answers unless the invariant mode is on (the gates' noise)."""
    return list(reversed(items)) if order == "reversed" else list(items)


def read(out: Path) -> list[dict]:
    records = []
    for path in sorted(out.glob("*/records.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def check_complete(records: list[dict]) -> list[str]:
    """What is missing for a fair comparison: both variants, each part, the same questions."""
    problems = []
    for part in PARTS:
        keys = {}
        for variant in ("base", "tuned"):
            rows = [r for r in records if r["part"] == part and r["variant"] == variant]
            if not rows:
                problems.append(f"no {part} records of the {variant} variant")
            keys[variant] = {(r.get("size"), r.get("setting"), r.get("question", r.get("prompt"))) for r in rows}
        if keys["base"] and keys["tuned"] and keys["base"] != keys["tuned"]:
            problems.append(f"the {part} records of the two variants cover different questions or settings")
    adapters = {r["adapter_sha256"] for r in records if r["variant"] == "tuned"}
    if len(adapters) > 1:
        problems.append("the tuned records come from more than one adapter")
    return problems


def gates(records: list[dict]) -> tuple[dict[str, dict], list[str]]:
    """Each gate's numbers and whether it passed, and the table's lines."""

    def answers(variant: str, size: str, setting: str = "full") -> list[dict]:
        return [r for r in records if r["part"] == "answers" and r["variant"] == variant and r["size"] == size and r["setting"] == setting]

    def right(rows: list[dict]) -> int:
        return sum(r["correct"] for r in rows)

    def lost(rows: list[dict], reference: list[dict]) -> int:
        ref = {r["question"]: r["correct"] for r in reference}
        return sum(ref[r["question"]] and not r["correct"] for r in rows)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    result: dict[str, dict] = {}
    lines = ["| measure | base | tuned | gate | passed |", "|---|---|---|---|---|"]
    for size in SIZES:
        base, tuned = right(answers("base", size)), right(answers("tuned", size))
        n = len(answers("tuned", size))
        need = base + 5 if size != "4K" else base
        result[f"answers_{size}"] = {"base": base, "tuned": tuned, "questions": n, "passed": bool(n) and tuned >= need}
        lines.append(f"| answers right, {size} stuffed, full cache | {base}/{n} | {tuned}/{n} | >= {need} | {result[f'answers_{size}']['passed']} |")
        parts = {v: sum(r["parts_correct"] for r in answers(v, size)) for v in ("base", "tuned")}
        result[f"answers_{size}"]["parts_right"] = parts
        lines.append(f"| (each part of an 'X and Y' answer found, {size}; not a gate) | {parts['base']}/{n} | {parts['tuned']}/{n} | | |")
    # questions with no gold chunk stuffed are left out: there an answer citing nothing would score 1 and the baseline 0
    f1 = {v: mean([r["gold_f1"] for r in answers(v, "1K") if r["gold"]]) for v in ("base", "tuned")}
    top2 = mean([r["top2_gold_f1"] for r in answers("tuned", "1K") if r["gold"]])
    result["citations_1K"] = {"base": round(f1["base"], 3), "tuned": round(f1["tuned"], 3), "top2_baseline": round(top2, 3), "passed": f1["tuned"] >= top2}
    lines.append(
        f"| own [n] citations, gold F1 (macro), 1K | {f1['base']:.3f} | {f1['tuned']:.3f} | >= top-2 baseline {top2:.3f} | {result['citations_1K']['passed']} |"
    )
    reuse = {v: lost(answers(v, REUSE_SIZE, f"chunks r={RECOMPUTE}"), answers(v, REUSE_SIZE)) for v in ("base", "tuned")}
    result["chunk_reuse_2K"] = {"base_lost": reuse["base"], "tuned_lost": reuse["tuned"], "passed": reuse["tuned"] <= 1}
    lines.append(
        f"| answers lost by chunk reuse r={RECOMPUTE} vs own full prefill, {REUSE_SIZE} | {reuse['base']} | {reuse['tuned']} | <= 1 | {result['chunk_reuse_2K']['passed']} |"
    )
    snap = {v: lost(answers(v, REUSE_SIZE, "snapkv 4x"), answers(v, REUSE_SIZE)) for v in ("base", "tuned")}
    result["snapkv_4x_2K"] = {"base_lost": snap["base"], "tuned_lost": snap["tuned"], "passed": snap["tuned"] <= snap["base"]}
    lines.append(
        f"| answers lost by SnapKV 4x vs own full cache, {REUSE_SIZE} | {snap['base']} | {snap['tuned']} | <= base | {result['snapkv_4x_2K']['passed']} |"
    )
    tools = {v: [r for r in records if r["part"] == "tools" and r["variant"] == v] for v in ("base", "tuned")}
    share = {v: mean([float(r["right"]) for r in rows]) for v, rows in tools.items()}
    false_calls = {v: sum(bool(r["called"]) for r in rows if not r["tool"]) for v, rows in tools.items()}
    passed = share["tuned"] >= 0.8 and false_calls["tuned"] <= false_calls["base"]
    result["tool_decisions"] = {
        "base": round(share["base"], 3),
        "tuned": round(share["tuned"], 3),
        "base_false_calls": false_calls["base"],
        "tuned_false_calls": false_calls["tuned"],
        "prompts": len(tools["tuned"]),
        "passed": passed,
    }
    lines.append(f"| tool decisions right (sets A+B, auto) | {share['base']:.0%} | {share['tuned']:.0%} | >= 80% | {share['tuned'] >= 0.8} |")
    lines.append(
        f"| false calls on prompts needing none | {false_calls['base']} | {false_calls['tuned']} | <= base | {false_calls['tuned'] <= false_calls['base']} |"
    )
    return result, lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval tune_gates", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("base", "tuned"))
    ap.add_argument("--adapter", default=None, help="the adapter directory of the tuned variant")
    ap.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--invariant",
        choices=("on", "off"),
        default="on",
        help="the engine's invariant mode (default on: an answer does not depend on what the prefix cache held)",
    )
    ap.add_argument("--order", choices=("forward", "reversed"), default="forward", help="the order the prompts are computed in")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--manifest", default=None, help="with --table-only: write the gates into this adapter directory's manifest.json")
    ap.add_argument(
        "--noise",
        default=str(RESULTS / "gate_noise" / "noise.json"),
        help="with --manifest: the gates' measured noise (python -m eval gate_noise), from which the adapter rule decides its uses",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.table_only:
        if args.variant is None or (args.variant == "tuned") != bool(args.adapter):
            ap.error("give --variant base, or --variant tuned with --adapter DIR")
        engine = Engine.default(adapter=args.adapter, invariant=args.invariant == "on")
        for part in args.parts:
            if part == "answers":
                records = run_answers(engine, args.variant, args.questions, args.order)
            else:
                records = run_tools(engine, args.variant, args.order)
            run_settings = {**adapter_identity(args.adapter), "invariant": engine.invariant, "order": args.order}
            write_records(out / f"{args.variant}_{part}", [{**r, **run_settings} for r in records])
    records = read(out)
    problems = check_complete(records)
    if problems:
        print("cannot compare yet: " + "; ".join(problems), file=sys.stderr)
        return 0 if not args.table_only else 2
    result, lines = gates(records)
    write_table(out, lines)
    if args.manifest:
        measured = next(r["adapter_sha256"] for r in records if r["variant"] == "tuned")
        if adapter_identity(args.manifest)["adapter_sha256"] != measured:
            print(f"the adapter in {args.manifest} is not the one the tuned records measured; its manifest is left as it is", file=sys.stderr)
            return 2
        path = Path(args.manifest) / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["gates"] = result
        noise_file = Path(args.noise)
        if noise_file.is_file():  # the rule the engine reads: which uses the adapter is on for
            measured = json.loads(noise_file.read_text())
            decisions = decide(result, measured)
            manifest["noise"] = measured
            manifest["applies_to"] = [use for use, d in decisions.items() if d.applies]
            manifest["rule"] = {use: d.reason() for use, d in decisions.items()}
            for use, d in decisions.items():
                print(f"{use}: {'on' if d.applies else 'off'} ({d.reason()})")
        else:
            print(f"no noise measured ({noise_file}: bash eval/tune/gate_noise.sh); the adapter is on only where every gate passed", file=sys.stderr)
        path.write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
