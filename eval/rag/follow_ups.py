"""Follow-up questions (issue 76): the same stuffed documents asked several questions, read per
question, from the first question's cache, from one question-agnostic cache, or in full.

The questions of a corpus are taken in groups (``--group``, 8): each group's documents are the
chunks of its questions' gold files plus the retriever's best chunks for each question in turn,
about ``--context`` tokens (4,000) in a shuffled but fixed order, so every question of the group
reads the very same documents (DocumentQA's prompt, the question last). Each question is read:

- ``own``: SnapKV at the budget with its own question window, a new prefill per question (what
  DocumentQA does today without prefix reuse);
- ``first``: the first question's cache reused: the group's first question answered as ``own``;
  every later one reads a context that ends with the first question, compressed by SnapKV with a
  window over that question (``keep_context``), and asks its own question after it;
- ``agnostic-snapkv``: the documents compressed once with no question, SnapKV voting with the
  context's last 32 tokens (the baseline of a question-agnostic cache), kept and asked every question;
- ``agnostic-expected``: the same with Expected Attention;
- ``agnostic-kvzip``: the same with KVzip's score (the model repeats the documents, 1,024 tokens at a
  time, once per group: the first question pays for it);
- ``agnostic-expected-spans`` / ``agnostic-kvzip-spans``: the two keeping whole 16-token spans (``chunk=16``,
  as document QA's SnapKV does);
- ``cut-expected`` / ``cut-kvzip``: the documents compressed once with no question at twice the budget
  (Expected Attention or KVzip) and kept; each question then read over them and the whole cut to the
  budget by SnapKV with the question's own window (``keep_context=<policy>``): half the full cache is
  held between questions, the budget is what each answer decodes from;
- ``full``: the full cache, a new prefill per question.

Budgets are given as ratios of the documents' tokens (``--ratios 2 4 8``: 2,000, 1,000 and 500 at
4,000). ``needles``: one haystack of about 3,500 tokens with eight pass keys, asked one vault at a
time (its chunks are the group's documents). Greedy, 32 new tokens; answers right are the corpus's answer found in the reply. Records
hold each question's answer, whether it is right, the end-to-end seconds (prefill, the kept
context's read where this question paid it, and decoding), the kept cache's bytes and whether
the kept context was stored or reused. Resumable: records are appended and a rerun skips them.

    .venv/bin/python -m eval follow_ups --corpus sample --ratios 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from eval.common.corpora import load_corpus
from eval.common.results_io import append_record, read_records, write_table
from snapkv_rag import Engine
from snapkv_rag.compression import DEFAULT_COMPRESSION, parse_compression
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file
from snapkv_rag.rag import DocumentQA, DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"
READINGS = (
    "own",
    "first",
    "agnostic-snapkv",
    "agnostic-expected",
    "agnostic-kvzip",
    "agnostic-expected-spans",
    "agnostic-kvzip-spans",
    "cut-expected",
    "cut-kvzip",
    "full",
)
MAX_NEW_TOKENS = 32
SLACK = 1000  # the stuffing budget's room beyond the group's documents (their labels and separators), so every question packs them all


def group_chunks(qa: DocumentQA, store: DocumentStore, questions, context_tokens: int, seed: int) -> list:
    """The group's documents: its gold files' chunks, then each question's retrieved chunks in turn, to ``context_tokens``."""
    everything = store.all_chunks()
    chosen: dict[str, object] = {}
    total = 0

    def add(chunk) -> bool:
        nonlocal total
        if chunk.id in chosen:
            return True
        cost = qa.engine.count_tokens(chunk.text, chat=False) + 8
        if total + cost > context_tokens:
            return False
        chosen[chunk.id] = chunk
        total += cost
        return True

    for q in questions:
        for chunk in everything:
            if is_gold_file(chunk.file, q.gold):
                add(chunk)
    ranked = [qa.retriever.retrieve(q.question).chunks for q in questions]
    for depth in range(max(len(r) for r in ranked)):
        for r in ranked:
            if depth < len(r):
                add(r[depth])
    chunks = list(chosen.values())
    random.Random(seed).shuffle(chunks)
    return chunks


def reading_call(reading: str, budget: int, first_question_tokens: int) -> tuple[object, object]:
    """The compression and the engine's ``keep_context`` (False, True or the kept context's policy), for one reading at one budget."""
    if reading == "full":
        return None, False
    if reading == "own":
        return DEFAULT_COMPRESSION.with_budget(budget), False
    if reading == "first":
        window = min(max(first_question_tokens, 8), 64)
        return DEFAULT_COMPRESSION.with_budget(budget).with_query_window(window), True
    if reading == "agnostic-snapkv":
        return DEFAULT_COMPRESSION.with_budget(budget), True  # the question window falls back to the context's last 32 tokens
    if reading.startswith("cut-"):
        return DEFAULT_COMPRESSION.with_budget(budget), parse_compression(f"{reading[4:]}:budget={2 * budget}")
    spans = ",chunk=16" if reading.endswith("-spans") else ""
    if reading.startswith("agnostic-kvzip"):
        return parse_compression(f"kvzip:budget={budget}{spans}"), True
    return parse_compression(f"expected:budget={budget}{spans}"), True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval follow_ups", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", choices=("sample", "lookalike", "needles"), default="sample")
    parser.add_argument("--readings", nargs="+", choices=READINGS, default=list(READINGS))
    parser.add_argument("--ratios", nargs="+", type=int, default=[4])
    parser.add_argument("--context", type=int, default=4000, help="document tokens per group")
    parser.add_argument("--group", type=int, default=8, help="questions per group of documents")
    parser.add_argument("--questions", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table-only", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or RESULTS / f"follow_ups_{args.corpus}"
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(out, missing_ok=True)
    if not args.table_only:
        done = {(r["reading"], r["ratio"], r["question"]) for r in records}
        engine = Engine.default()
        with tempfile.TemporaryDirectory(prefix="snapkv-follow-ups-") as tmp:
            folder, questions = load_corpus(args.corpus, Path(tmp), args.questions)
            store = DocumentStore("follow-ups", path=tmp)
            store.ingest([folder])
            picker = DocumentQA(engine, store, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
            reader = DocumentQA(engine, store, compression=None, context_tokens=args.context + SLACK, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
            with (out / "records.jsonl").open("a") as sink:
                for g in range(0, len(questions), args.group):
                    group = questions[g : g + args.group]
                    chunks = group_chunks(picker, store, group, args.context, seed=g)
                    first = group[0].question
                    first_tokens = engine.count_tokens(f"Question: {first}", chat=False)
                    for ratio in args.ratios:
                        for reading in args.readings:
                            engine.kept_contexts.clear()
                            budget = max(72, args.context // ratio)
                            compression, keep = reading_call(reading, budget, first_tokens)
                            for index, q in enumerate(group):
                                if (reading, ratio, q.question) in done:
                                    continue
                                follow = reading == "first" and index > 0
                                asked = f"{first}\n\nQuestion: {q.question}" if follow else q.question
                                context = reader.retriever.retrieve(asked, ranked=chunks)
                                if len(context.chunks) != len(chunks):
                                    raise RuntimeError(f"the group's {len(chunks)} documents did not all fit ({len(context.chunks)})")
                                if reading == "first" and not follow:
                                    kwargs = reader.generation_kwargs(context, compression=reading_call("own", budget, 0)[0], prefix_cache=False)
                                else:
                                    kwargs = reader.generation_kwargs(
                                        context, compression=compression, **({"keep_context": keep} if keep else {"prefix_cache": False})
                                    )
                                kwargs["question"] = f"Question: {q.question}"
                                result = engine.generate(context.messages, **kwargs)
                                stats = result.stats
                                record = {
                                    "corpus": args.corpus,
                                    "reading": reading,
                                    "ratio": ratio,
                                    "group": g // args.group,
                                    "index": index,
                                    "question": q.question,
                                    "answer": result.text,
                                    "correct": bool(answer_correct(result.text, q.answer)),
                                    "prompt_tokens": result.usage.prompt_tokens,
                                    "prefilled_tokens": stats.prefilled_prompt_tokens,
                                    "context_reuse": stats.context_reuse,
                                    "seconds": round(stats.total_seconds, 3),
                                    "prefill_seconds": round(stats.prefill_seconds, 3),
                                    "kv_bytes": stats.prompt_kv_bytes_kept,
                                }
                                append_record(sink, records, record)
    lines = [
        "| corpus | ratio | reading | questions | right | right after the first | median s per question | median s per follow-up | median KV MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(dict.fromkeys((r["corpus"], r["ratio"], r["reading"]) for r in records), key=lambda k: (k[0], k[1], READINGS.index(k[2]))):
        rows = [r for r in records if (r["corpus"], r["ratio"], r["reading"]) == key]
        later = [r for r in rows if r["index"] > 0]
        lines.append(
            f"| {key[0]} | {key[1]}x | {key[2]} | {len(rows)} | {sum(r['correct'] for r in rows)} | {sum(r['correct'] for r in later)}/{len(later)} | "
            f"{statistics.median(r['seconds'] for r in rows):.2f} | {statistics.median(r['seconds'] for r in later) if later else float('nan'):.2f} | "
            f"{statistics.median(r['kv_bytes'] for r in rows) / 2**20:.1f} |"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
