"""``snapkv-rag eval needle|citation|fidelity|speed``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cli_common import add_model_args, load_engine

DEFAULT_METHODS = ["snapkv", "streamingllm", "h2o", "random"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def add_eval_parser(sub) -> None:
    parser = sub.add_parser("eval", help="evaluate compression methods against the uncompressed model")
    tasks = parser.add_subparsers(dest="task", required=True)
    for name, help_text, lengths in (
        ("needle", "passkey exact match over depth x length x budget", "1000,2000"),
        ("citation", "citation F1 of compressed vs uncompressed RAG answers", None),
        ("fidelity", "greedy agreement and teacher-forced KL over a fixed continuation", "2000"),
        ("speed", "prefill, decode ms/token, KV bytes, peak memory vs prompt length", "1000,2000,4000,8000"),
    ):
        p = tasks.add_parser(name, help=help_text)
        add_model_args(p)
        p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, help="policy specs, e.g. snapkv 'snapkv:window=16,kernel=5' h2o (full is always run)")
        p.add_argument("--budgets", type=_ints, default=[256, 512, 1024], help="comma-separated budgets, e.g. 256,512")
        p.add_argument("--out", type=Path, default=Path("eval-results"), help="output directory")
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
        if lengths:
            p.add_argument("--lengths", type=_ints, default=_ints(lengths), help="prompt lengths in tokens")
        if name == "needle":
            p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
            p.add_argument("--seeds", type=_ints, default=[0])
        if name == "citation":
            p.add_argument("--docs", type=int, default=40, help="documents per prompt")
            p.add_argument("--questions", type=int, default=10)
            p.add_argument("--seed", type=int, default=0)
        if name == "fidelity":
            p.add_argument("--continuation-tokens", type=int, default=32)
            p.add_argument("--seeds", type=_ints, default=[0])
        if name == "speed":
            p.add_argument("--new-tokens", type=int, default=32)
            p.add_argument("--repeats", type=int, default=1)
            p.add_argument("--batch-sizes", type=_ints, default=[], help="also time B prompts as one batch vs B single calls, e.g. 4")
        p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from .report import write_report
    from .runner import method_grid, run_citation, run_fidelity, run_needle, run_speed

    methods = method_grid(args.methods, args.budgets)  # validated before the model loads
    engine = load_engine(args)
    progress = not args.no_progress
    if args.task == "needle":
        records = run_needle(engine, methods, args.lengths, args.depths, seeds=args.seeds, progress=progress)
    elif args.task == "citation":
        records = run_citation(engine, methods, n_docs=args.docs, n_questions=args.questions, seed=args.seed, progress=progress)
    elif args.task == "fidelity":
        records = run_fidelity(engine, methods, args.lengths, continuation_tokens=args.continuation_tokens, seeds=args.seeds, progress=progress)
    else:
        records = run_speed(
            engine, methods, args.lengths, new_tokens=args.new_tokens, repeats=args.repeats, batch_sizes=args.batch_sizes, progress=progress
        )
    command = "snapkv-rag " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None
    paths = write_report(args.task, records, args.out, command)
    if args.json:
        import json

        print(json.dumps({k: str(v) for k, v in paths.items()}))
    else:
        print(paths["markdown"].read_text())
    return 0
