"""``snapkv-rag less``: train LESS kernels for a model on the offline corpus, and analyse their remaining gap."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_common import add_model_args, add_store_args, load_engine, open_store
from .corpus import TEXTS

DEFAULT_OUT = Path(__file__).parents[1] / "compression" / "less" / "shipped"  # kernels.SHIPPED_DIR, named here so --help loads no torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_less_parser(sub) -> None:
    parser = sub.add_parser("less", help="LESS kernels (learned low-rank state over evicted K/V)")
    tasks = parser.add_subparsers(dest="less_command", required=True)
    p = tasks.add_parser("train", help="train kernels for a base policy and budget(s), one layer at a time (resumable)")
    add_model_args(p)
    p.add_argument("--base", default="snapkv", help="base policy spec, e.g. snapkv or 'h2o' (its budget is set by --budgets)")
    p.add_argument("--budgets", type=_ints, default=[256], help="comma-separated budgets, one kernel file each")
    p.add_argument("--prompt-tokens", type=_ints, default=[2048, 4096], help="comma-separated prompt lengths trained on")
    p.add_argument("--continuation-tokens", type=int, default=128)
    p.add_argument(
        "--sequences",
        type=_ints,
        default=None,
        help="windows per prompt length, --val-sequences of each validate (one number: every length; default: about 80K prompt tokens each, 40 at 2048)",
    )
    p.add_argument("--val-sequences", type=int, default=4)
    p.add_argument(
        "--text",
        choices=TEXTS,
        default="mixed",
        help="training text: the Python reference topics (pydoc), installed packages' READMEs (packages) or both (mixed, the default)",
    )
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--features", choices=("exp", "mlp"), default="exp", help="feature maps: exponential (default) or less.md's MLPs")
    p.add_argument(
        "--mass-rank",
        type=int,
        default=None,
        help="exp features: extra features that estimate only the evicted mass, 1 state number each per KV head (default: 32 for exp, 0 for mlp)",
    )
    p.add_argument("--hidden", type=int, default=32, help="hidden width of the mlp feature maps")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=None, help="stage-1 learning rate (default: 1e-2 for exp features, 3e-3 for mlp)")
    p.add_argument("--distill-epochs", type=int, default=2, help="stage 2: epochs of all layers together on the end-to-end KL (0: stage 1 only)")
    p.add_argument(
        "--distill-sequences",
        type=_ints,
        default=None,
        help="stage 2: overlapping training windows per prompt length (default: about 240K prompt tokens each, 120 at 2048)",
    )
    p.add_argument("--distill-lr", type=float, default=1e-2)
    p.add_argument(
        "--distill-params",
        choices=("calibration", "all"),
        default="calibration",
        help="stage 2 trains the output biases and key scales only, or every kernel tensor",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--work-dir", type=Path, default=Path("less-train"), help="capture shards and per-layer checkpoints (resume from here)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the kernel files (default: the package's shipped kernels)")
    p.add_argument("--model-tag", default=None, help="file-name tag of the model (default: smollm2-135m for the embedded model)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_less_train)

    d = tasks.add_parser("distill", help="stage 2 alone: fine-tune a stage-1 kernel file on the end-to-end KL")
    add_model_args(d)
    d.add_argument("kernels", type=Path, help="a kernel file made by `less train --distill-epochs 0`")
    d.add_argument("--out", type=Path, default=None, help="output file (default: overwrite the input)")
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument(
        "--sequences",
        type=_ints,
        default=None,
        help="overlapping training windows per prompt length of the file (default: about 240K prompt tokens each, 120 at 2048)",
    )
    d.add_argument("--lr", type=float, default=1e-2)
    d.add_argument(
        "--params", choices=("calibration", "all"), default="calibration", help="train the output biases and key scales only, or every kernel tensor"
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    d.add_argument("--work-dir", type=Path, default=Path("less-train"), help="collected sequences and the distilled checkpoint (resume from here)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_less_distill)

    c = tasks.add_parser(
        "calibrate", help="fit LESS's cheap stage on a collection's documents; DocumentQA and ask then use it (or the base, where it measured worse)"
    )
    add_model_args(c)
    add_store_args(c)
    c.add_argument("--base", default="snapkv", help="base policy (default snapkv)")
    c.add_argument("--budget", type=int, default=256, help="the base's budget; starts from the shipped kernels of that budget (default 256)")
    c.add_argument("--kernels", type=Path, default=None, help="start from this kernel file instead of the shipped one")
    c.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length of each window (default 2048)")
    c.add_argument("--continuation-tokens", type=int, default=64)
    c.add_argument("--windows", type=int, default=24, help="training windows, spread over the collection's text (default 24)")
    c.add_argument("--val-windows", type=int, default=4, help="held-out windows at the end of the text, which decide LESS or the base (default 4)")
    c.add_argument("--epochs", type=int, default=2)
    c.add_argument("--lr", type=float, default=1e-2)
    c.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    c.add_argument("--work-dir", type=Path, default=None, help="folder for the run's temporary window recordings (default: the system's)")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_less_calibrate)

    g = tasks.add_parser("gap", help="where LESS's remaining KL gap comes from: learned vs exact mass and value of the evicted entries, per layer")
    add_model_args(g)
    g.add_argument("--compression", default="less:base=snapkv,budget=512", help="a LESS spec (default: less:base=snapkv,budget=512)")
    g.add_argument("--lengths", type=_ints, default=[2048, 4096], help="comma-separated prompt lengths (held-out split)")
    g.add_argument("--prompts-per-length", type=int, default=3)
    g.add_argument("--continuation-tokens", type=int, default=64)
    g.add_argument("--no-per-layer", action="store_true", help="skip the exact-value-in-one-layer runs (one per layer and prompt)")
    g.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    g.add_argument("--out", type=Path, default=Path("eval/compression/results/less_gap"))
    g.add_argument("--no-progress", action="store_true")
    g.set_defaults(func=cmd_less_gap)


def cmd_less_train(args: argparse.Namespace) -> int:
    import json
    import time

    import torch

    from .train import TrainConfig, train

    config = TrainConfig(
        base=args.base,
        budgets=args.budgets,
        prompt_tokens=args.prompt_tokens,
        continuation_tokens=args.continuation_tokens,
        sequences=args.sequences,
        val_sequences=args.val_sequences,
        rank=args.rank,
        features=args.features,
        mass_rank=args.mass_rank,
        hidden=args.hidden,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        distill_epochs=args.distill_epochs,
        distill_sequences=args.distill_sequences,
        distill_lr=args.distill_lr,
        distill_params=args.distill_params,
        text=args.text,
    )
    config.check()
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    tag = args.model_tag or ("smollm2-135m" if args.model == "default" else Path(str(args.model)).name.replace("/", "-"))
    start = time.perf_counter()
    paths = train(engine, config, args.work_dir, args.out, model_tag=tag, progress=not args.no_progress)
    summary = {"kernels": [str(p) for p in paths], "seconds": round(time.perf_counter() - start, 1), "threads": args.threads}
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0


def cmd_less_distill(args: argparse.Namespace) -> int:
    import json
    import time

    import torch

    from ..errors import LessTrainingError
    from .train import distill_file

    if args.epochs < 1 or (args.sequences is not None and min(args.sequences, default=0) < 1):
        raise LessTrainingError("--epochs and --sequences must be positive")
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    start = time.perf_counter()
    out = distill_file(
        engine,
        args.kernels,
        args.out or args.kernels,
        args.work_dir,
        epochs=args.epochs,
        sequences=args.sequences,
        lr=args.lr,
        params=args.params,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(json.dumps({"kernels": str(out), "seconds": round(time.perf_counter() - start, 1), "threads": args.threads}))
    return 0


def cmd_less_calibrate(args: argparse.Namespace) -> int:
    import json

    import torch

    from ..errors import LessTrainingError
    from .collection_fit import CalibrationConfig, calibrate, describe_calibration

    if min(args.budget, args.prompt_tokens, args.windows, args.val_windows, args.epochs) < 1 or args.continuation_tokens < 2:
        raise LessTrainingError("--budget, --prompt-tokens, --windows, --val-windows and --epochs must be positive and --continuation-tokens at least 2")
    if args.budget >= args.prompt_tokens:
        raise LessTrainingError(f"--budget ({args.budget}) must be below --prompt-tokens ({args.prompt_tokens}): nothing would be evicted")
    torch.set_num_threads(args.threads)
    store = open_store(args, create=False)
    engine = load_engine(args)
    config = CalibrationConfig(
        budget=args.budget,
        base=args.base,
        prompt_tokens=args.prompt_tokens,
        continuation_tokens=args.continuation_tokens,
        windows=args.windows,
        val_windows=args.val_windows,
        epochs=args.epochs,
        lr=args.lr,
    )
    summary = calibrate(engine, store, config, kernels=args.kernels, work=args.work_dir, progress=not args.no_progress)
    if args.json:
        print(json.dumps(summary))
    else:
        print(describe_calibration(summary))
    return 0


def cmd_less_gap(args: argparse.Namespace) -> int:
    import json
    import shlex
    import sys

    import torch

    from ..compression import LESS, parse_compression
    from ..errors import EvalInputError, InvalidCompressionError
    from .gap import gap_analysis, write_gap_report

    policy = parse_compression(args.compression)
    if not isinstance(policy, LESS):
        raise InvalidCompressionError(f"less gap analyses a LESS policy (less:base=...,budget=N), not {args.compression!r}")
    if args.prompts_per_length < 1 or args.continuation_tokens < 2 or not args.lengths or min(args.lengths) < 1:
        raise EvalInputError("--prompts-per-length and --lengths must be positive and --continuation-tokens at least 2")
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    rows = gap_analysis(
        engine,
        policy,
        args.lengths,
        per_length=args.prompts_per_length,
        continuation_tokens=args.continuation_tokens,
        per_layer=not args.no_per_layer,
        progress=not args.no_progress,
    )
    command = "snapkv-rag " + shlex.join(sys.argv[1:]) if sys.argv[1:3] == ["less", "gap"] else None
    report = write_gap_report(rows, args.out, spec=policy.spec(), command=command)
    print(json.dumps({"out": str(args.out), **report}, indent=None if args.json else 1))
    return 0
