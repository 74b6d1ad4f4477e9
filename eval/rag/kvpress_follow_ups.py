"""NVIDIA's kvpress itself on follow_ups' task (issue 76): its ExpectedAttentionPress at compression
ratio 0.75 (4x) and no press, answers right beside the toolkit's own question-agnostic readings.

The documents and prompts are follow_ups' (``eval/rag/follow_ups.py``, corpus ``sample``): the 40
questions in groups of 8, each group's documents (:func:`eval.rag.follow_ups.group_chunks`, about
4,000 tokens) stuffed into DocumentQA's chat prompt, the question last. This module runs in two
environments. In the project's ``.venv`` it renders every question's prompt with the embedded
SmolLM2's chat template and cuts it where ``Question:`` starts: the context before, the question and
the assistant header after (``prompts.jsonl``, a line per group: its context, the same text for each
of its questions, and each question's part). kvpress 0.5.5 needs transformers<5.3, so it runs in
``.kvpress-venv`` (``bash eval/rag/kvpress_env.sh``): the same file with ``--run-kvpress`` loads the
toolkit's converted SmolLM2 folder (the GGUF de-quantized to float32, the weights ``Engine.default()``
reads; no adapter), float32 on the CPU with sdpa, and asks kvpress's pipeline
``pipe(context, questions=[the group's 8], press=..., max_new_tokens=32)``: the context is prefilled and
compressed once, without any question, then each question is read over that cache and answered
greedily (kvpress cuts each answer off the cache before the next question). Back in ``.venv`` each
answer is right when the corpus's answer is in it (``answer_correct``, as follow_ups scores).

What the model reads, against the toolkit's prompt: kvpress's pipeline would wrap ``context +
question`` in the chat template as one user turn (SmolLM2's template then adds its default system
prompt instead of DocumentQA's), so the tokenizer's chat template is switched off and the rendered
text is passed instead. Without a template kvpress prepends the BOS token (``<|im_start|>``) to the
context and appends ``"\\n"`` to each question, so both are taken off the rendered text first; the
text read is then the toolkit's to the character. The tokens differ in one place: kvpress tokenizes
context and question apart, so the blank line before ``Question:`` is one token (``\\n\\n``) where the
toolkit, tokenizing the whole prompt, has two (``\\n``, ``\\n``); the question and everything after it
sit one position earlier. The budget: kvpress keeps 25% of every head's context tokens (the whole
context with the system prompt and template, about 4,100: ``kept_tokens`` in the records), the
toolkit's ``agnostic-expected`` keeps 1,000 (its documents' 4,000 over 4). kvpress's Expected
Attention keeps its defaults (512 future positions, 4 sinks, covariance and value norms on). The
precision: kvpress reads in float32; follow_ups' ``Engine.default()`` reads in bfloat16 on a CPU
that computes it natively (AMX-BF16 or AVX512-BF16; the committed kvpress records came from an
AMX-BF16 machine), so there ``none`` and the toolkit's ``full`` need not give the very same answers.

    bash eval/rag/kvpress_env.sh                                        # once
    PYTHONPATH=. .venv/bin/python -m eval kvpress_follow_ups            # all 40 questions
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from eval.common.processes import child_env
from eval.common.results_io import read_records, write_records, write_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
KVPRESS_PYTHON = ROOT / ".kvpress-venv" / "bin" / "python"
PRESSES = {"expected": 0.75, "none": 0.0}  # kvpress's press name -> compression_ratio
TOOLKIT = RESULTS / "follow_ups_sample"  # follow_ups' records, shown beside kvpress's where present
TOOLKIT_READINGS = ("agnostic-expected", "agnostic-expected-spans", "full")


def write_prompts(path: Path, questions: int | None, context_tokens: int, group_size: int) -> str:
    """Each group's rendered prompts, cut into the context (one per group: every question's is checked
    to be the same text) and each question's part; follow_ups' documents, so the context text is
    identical. Returns the converted model folder kvpress loads."""
    # imported here: the --run-kvpress side runs in .kvpress-venv, whose transformers the toolkit does not support
    from eval.common.corpora import load_corpus
    from eval.rag.follow_ups import MAX_NEW_TOKENS, SLACK, group_chunks
    from snapkv_rag import Engine
    from snapkv_rag.model.loading import DEFAULT_MODEL, resolve_model_source
    from snapkv_rag.rag import DocumentQA, DocumentStore

    engine = Engine.default()
    rows = []
    with tempfile.TemporaryDirectory(prefix="snapkv-kvpress-") as tmp:
        folder, asked = load_corpus("sample", Path(tmp), questions)
        store = DocumentStore("follow-ups", path=tmp)
        store.ingest([folder])
        picker = DocumentQA(engine, store, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
        reader = DocumentQA(engine, store, compression=None, context_tokens=context_tokens + SLACK, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
        for g in range(0, len(asked), group_size):
            group = asked[g : g + group_size]
            chunks = group_chunks(picker, store, group, context_tokens, seed=g)
            contexts, parts = set(), []
            for q in group:
                context = reader.retriever.retrieve(q.question, ranked=chunks)
                if len(context.chunks) != len(chunks):
                    raise RuntimeError(f"the group's {len(chunks)} documents did not all fit ({len(context.chunks)})")
                text = engine.tokenizer.apply_chat_template(context.messages, tokenize=False, add_generation_prompt=True)
                cut = text.rindex(context.question_text)
                contexts.add(text[:cut])
                parts.append({"question": q.question, "expected": q.answer, "question_text": text[cut:], "prompt_tokens": context.prompt_tokens})
            if len(contexts) != 1:
                raise RuntimeError(f"group {g // group_size}: the questions' contexts differ")
            rows.append({"group": g // group_size, "context": contexts.pop(), "questions": parts})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return resolve_model_source(DEFAULT_MODEL)[0]


def run_kvpress(prompts: Path, answers: Path, model_dir: str) -> None:
    """In .kvpress-venv: each group's context compressed once by each press and asked its questions."""
    import torch
    from kvpress import ExpectedAttentionPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer.chat_template = None  # the prompts come rendered (see the docstring)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    bos = tokenizer.bos_token
    out = []
    for name, ratio in PRESSES.items():
        for group in map(json.loads, prompts.read_text().splitlines()):
            if not group["context"].startswith(bos):
                raise RuntimeError(f"group {group['group']}: the context does not open with {bos}")
            context = group["context"].removeprefix(bos)  # kvpress prepends the BOS token itself
            questions = [q["question_text"].removesuffix("\n") for q in group["questions"]]  # ... and appends "\n" to each question
            press = ExpectedAttentionPress(compression_ratio=ratio) if ratio else None
            cache = DynamicCache()
            start = time.perf_counter()
            replies = pipe(context, questions=questions, press=press, max_new_tokens=32, cache=cache)["answers"]
            seconds = time.perf_counter() - start
            context_tokens = len(tokenizer.encode(bos + context, add_special_tokens=False))
            for index, (q, reply) in enumerate(zip(group["questions"], replies, strict=True)):
                out.append(
                    {
                        "press": name,
                        "ratio": ratio,
                        "group": group["group"],
                        "index": index,
                        "question": q["question"],
                        "answer": reply,
                        "context_tokens": context_tokens,
                        "kept_tokens": cache.get_seq_length(),
                        "group_seconds": round(seconds, 2),
                    }
                )
            print(f"kvpress {name}: group {group['group']}, {context_tokens} context tokens, {cache.get_seq_length()} kept, {seconds:.1f} s", flush=True)
    answers.write_text("".join(json.dumps(r) + "\n" for r in out))


def table(records: list[dict]) -> list[str]:
    """kvpress's rows, then the toolkit's follow_ups rows at 4x where its records hold the same questions."""
    lines = [
        "| library | press / reading | compression | questions | right | context tokens kept (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name, ratio in PRESSES.items():
        rows = [r for r in records if r["press"] == name]
        if rows:
            kept = statistics.median(r["kept_tokens"] for r in rows)
            lines.append(
                f"| kvpress 0.5.5 | {name} | {f'ratio {ratio} (4x)' if ratio else 'none'} | {len(rows)} | {sum(r['correct'] for r in rows)} | {kept:.0f} |"
            )
    asked = {r["question"] for r in records}
    toolkit = [r for r in read_records(TOOLKIT, missing_ok=True) if r["question"] in asked and r["ratio"] == 4]
    for reading in TOOLKIT_READINGS:
        rows = [r for r in toolkit if r["reading"] == reading]
        if rows:
            compression, kept = ("none", "all") if reading == "full" else ("budget 1000 (4x)", "1000")
            lines.append(f"| snapkv-rag (follow_ups) | {reading} | {compression} | {len(rows)} | {sum(r['correct'] for r in rows)} | {kept} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval kvpress_follow_ups", description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=None, help="the first N questions of the corpus (default: all 40)")
    parser.add_argument("--context", type=int, default=4000, help="document tokens per group")
    parser.add_argument("--group", type=int, default=8, help="questions per group of documents")
    parser.add_argument("--python", type=Path, default=KVPRESS_PYTHON, help="the kvpress environment's python")
    parser.add_argument("--out", type=Path, default=RESULTS / "kvpress_follow_ups")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--run-kvpress", action="store_true", help="(internal) the kvpress side, run in the kvpress environment")
    parser.add_argument("--model-dir", default=None, help="(with --run-kvpress) the converted model folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out
    prompts, answers = out / "prompts.jsonl", out / "answers.jsonl"
    if args.run_kvpress:
        run_kvpress(prompts, answers, args.model_dir)
        return 0
    if not args.table_only:
        out.mkdir(parents=True, exist_ok=True)
        model_dir = write_prompts(prompts, args.questions, args.context, args.group)
        command = [str(args.python), "-m", "eval.rag.kvpress_follow_ups", "--run-kvpress", "--out", str(out.resolve()), "--model-dir", model_dir]
        subprocess.run(command, cwd=ROOT, check=True, env=child_env())
        from snapkv_rag.harness.rag_citation import answer_correct

        expected = {q["question"]: q["expected"] for group in map(json.loads, prompts.read_text().splitlines()) for q in group["questions"]}
        records = [
            {**r, "expected": expected[r["question"]], "correct": bool(answer_correct(r["answer"], expected[r["question"]]))}
            for r in map(json.loads, answers.read_text().splitlines())
        ]
        write_records(out, records)
        answers.unlink()
    write_table(out, table(read_records(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
