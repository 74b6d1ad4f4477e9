"""``snapkv-rag eval needle|citation|fidelity|speed``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..cli_common import add_model_args, load_engine
from ..less_training.corpus import TEXTS

DEFAULT_METHODS = ["snapkv", "streamingllm", "h2o", "random"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def add_eval_parser(sub) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluate compression methods against the uncompressed model",
        description="The evaluation harness (snapkv_rag.harness): needle, speed, fidelity and citation runs of compression "
        "methods against the uncompressed model, on any model. The repository's benchmark suite, which uses it, is "
        "`python -m eval --list` in a source checkout (eval/RESULTS.md).",
    )
    tasks = parser.add_subparsers(dest="task", required=True)
    for name, help_text, lengths in (
        ("needle", "passkey exact match over depth x length x budget", "1000,2000"),
        ("citation", "citation F1 of compressed vs uncompressed answers on the RAG pipeline (ingest, retrieval, stuffing, DocumentQA)", None),
        ("fidelity", "greedy agreement and teacher-forced KL over a fixed continuation", "2000"),
        ("speed", "prefill, decode ms/token, KV bytes, peak memory vs prompt length", "1000,2000,4000,8000"),
    ):
        p = tasks.add_parser(name, help=help_text)
        add_model_args(p)
        p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, help="policy specs, e.g. snapkv 'snapkv:window=16,kernel=5' h2o (full is always run)")
        p.add_argument("--budgets", type=_ints, default=[256, 512, 1024], help="comma-separated budgets, e.g. 256,512")
        p.add_argument("--out", type=Path, default=Path("eval-results"), help="output directory")
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
        if lengths:
            p.add_argument("--lengths", type=_ints, default=_ints(lengths), help="prompt lengths in tokens")
        if name == "needle":
            p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
            p.add_argument("--seeds", type=_ints, default=[0])
        if name == "citation":
            p.add_argument("--corpus", type=Path, default=None, help="folder of documents to ingest (default: examples/sample_corpus)")
            p.add_argument(
                "--questions-file",
                type=Path,
                default=None,
                help="JSON lines: question, answer, gold (file names in the corpus); default examples/sample_questions.jsonl",
            )
            p.add_argument("--questions", type=int, default=None, help="use the first N questions (default: all)")
            p.add_argument("--context-tokens", type=int, default=2000, help="LLM tokens of stuffed documents per prompt")
            p.add_argument("--max-new-tokens", type=int, default=48)
            p.add_argument("--store", type=Path, default=None, help="embedded Chroma directory to ingest into (default: a temporary one)")
            p.add_argument("--collection", default="snapkv-eval", help="Chroma collection name")
            p.add_argument("--embedder", default="default", help="sentence-transformers model path (default: embedded all-MiniLM-L6-v2)")
            p.add_argument("--chunk-tokens", type=int, default=200, help="chunk size in embedder tokens")
            p.add_argument("--attribution", choices=("hybrid", "embedding", "lexical"), default=None, help="attributed-route method (default: the library's)")
            p.add_argument("--attribution-threshold", type=float, default=None)
            p.add_argument("--noise-threads", type=int, default=None, help="threads of the noise-floor rerun (default: 1, or 2 when --threads 1)")
            p.add_argument("--no-noise-floor", action="store_true", help="skip the noise-floor rerun of the uncompressed model")
        if name == "fidelity":
            p.add_argument("--continuation-tokens", type=int, default=32)
            p.add_argument("--seeds", type=_ints, default=[0])
            p.add_argument(
                "--text",
                choices=("documents", "heldout"),
                default="documents",
                help="documents: synthetic document-QA prompts, greedy reference; heldout: the LESS held-out text, its own continuation, "
                "perplexity, and for each less:... method its base policy and baseline+ (same memory)",
            )
            p.add_argument(
                "--heldout-text",
                choices=TEXTS,
                default="pydoc",
                help="--text heldout: whose held-out split (LESS training texts: Python reference topics, package READMEs, both)",
            )
            p.add_argument("--prompts-per-length", type=int, default=1, help="--text heldout: windows per prompt length")
            p.add_argument("--decode-tokens", type=int, default=16, help="--text heldout: greedy steps timed per prompt for base and LESS")
        if name == "speed":
            p.add_argument("--new-tokens", type=int, default=32)
            p.add_argument("--repeats", type=int, default=1)
            p.add_argument("--batch-sizes", type=_ints, default=[], help="also time B prompts as one batch vs B single calls, e.g. 4")
        p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    import torch

    from .rag_citation import EvalInputError
    from .report import write_report
    from .runner import method_grid

    methods = method_grid(args.methods, args.budgets)  # validated before the model loads
    if args.threads is not None and args.threads < 1:
        raise EvalInputError(f"--threads must be positive, got {args.threads}")
    if args.task == "citation":
        _check_citation_args(args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        records = _run_task(args, methods)
    finally:
        torch.set_num_threads(threads)
    command = "snapkv-rag " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None
    paths = write_report(args.task, records, args.out, command)
    if args.json:
        import json

        print(json.dumps({k: str(v) for k, v in paths.items()}))
    else:
        print(paths["markdown"].read_text())
    return 0


def _check_citation_args(args) -> None:
    from .rag_citation import DEFAULT_CORPUS, DEFAULT_QUESTIONS, EvalInputError, load_questions

    args.corpus = args.corpus or DEFAULT_CORPUS
    args.questions_file = args.questions_file or DEFAULT_QUESTIONS
    if not args.corpus.exists():
        raise EvalInputError(f"corpus {args.corpus} does not exist")
    for name in ("context_tokens", "max_new_tokens", "chunk_tokens"):
        if getattr(args, name) < 1:
            raise EvalInputError(f"--{name.replace('_', '-')} must be positive")
    args.question_list = load_questions(args.questions_file, args.questions)


def _run_citation(args, engine, methods, progress):
    import torch

    from ..rag.attribution import EvidenceAttributor
    from ..rag.embeddings import Embedder
    from .rag_citation import run_rag_citation

    embedder = Embedder(args.embedder)
    attributor = None
    if args.attribution or args.attribution_threshold is not None:
        kwargs = {"method": args.attribution} if args.attribution else {}
        attributor = EvidenceAttributor(embedder, threshold=args.attribution_threshold, **kwargs)
    noise = None if args.no_noise_floor else args.noise_threads or (2 if torch.get_num_threads() == 1 else 1)
    return run_rag_citation(
        engine,
        methods,
        corpus=args.corpus,
        questions=args.question_list,
        context_tokens=args.context_tokens,
        max_new_tokens=args.max_new_tokens,
        store=args.store,
        collection=args.collection,
        embedder=embedder,
        chunk_tokens=args.chunk_tokens,
        attributor=attributor,
        noise_threads=noise,
        progress=progress,
    )


ANSWER_COMPARISONS = ("needle", "citation", "fidelity")


def task_invariant(task: str, asked: bool | None) -> bool | None:
    """The invariant mode a task's engine runs in: on for answer comparisons unless ``--no-invariant`` (a
    measured loss against the full cache must not move with reuse or batching); for speed and memory,
    what users run (the engine's default: off unless SNAPKV_RAG_INVARIANT), unless ``--invariant``. Every
    record says which (``invariant``)."""
    if asked is not None:
        return asked
    return True if task in ANSWER_COMPARISONS else None


def _run_task(args, methods):
    from .runner import run_fidelity, run_needle, run_speed

    engine = load_engine(args, invariant=task_invariant(args.task, args.invariant))
    progress = not args.no_progress
    if args.task == "needle":
        return run_needle(engine, methods, args.lengths, args.depths, seeds=args.seeds, progress=progress)
    if args.task == "citation":
        return _run_citation(args, engine, methods, progress)
    if args.task == "fidelity" and args.text == "heldout":
        from .heldout import run_heldout_fidelity

        return run_heldout_fidelity(
            engine,
            methods,
            args.lengths,
            continuation_tokens=args.continuation_tokens,
            per_length=args.prompts_per_length,
            decode_tokens=args.decode_tokens,
            text=args.heldout_text,
            progress=progress,
        )
    if args.task == "fidelity":
        return run_fidelity(engine, methods, args.lengths, continuation_tokens=args.continuation_tokens, seeds=args.seeds, progress=progress)
    return run_speed(engine, methods, args.lengths, new_tokens=args.new_tokens, repeats=args.repeats, batch_sizes=args.batch_sizes, progress=progress)
