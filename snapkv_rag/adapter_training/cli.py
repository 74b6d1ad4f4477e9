"""``snapkv-rag tune``: generate the tuning data, and train (or resume) a LoRA adapter."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_common import add_model_args

DEFAULT_OUT = "tune-runs/default"
STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped early with a checkpoint; the same command resumes


def add_tune_parser(sub) -> None:
    parser = sub.add_parser("tune", help="LoRA fine-tuning on generated document-QA and tool-decision data (resumable)")
    tasks = parser.add_subparsers(dest="tune_command", required=True)

    data = tasks.add_parser("data", help="write generated examples as JSON lines (what training sees, or the held-out split)")
    data.add_argument("--model", default="default", help="whose tokenizer measures the stuffed budgets, as in training (default: the embedded model's)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--examples", type=int, default=20)
    data.add_argument("--split", choices=("train", "heldout"), default="train")
    data.add_argument("--recipe", type=int, choices=(3, 4), default=3)
    data.add_argument("--qa-share", type=float, default=None, help="share of document-QA examples (default 0.6; the rest are tool decisions)")
    data.add_argument("--out", default="-", help="a .jsonl file, or - for standard output")
    data.set_defaults(func=cmd_data)

    train = tasks.add_parser("train", help="train a LoRA adapter; run the same command again to resume a stopped run (a stopped run exits with status 75)")
    add_model_args(train, json_output=False, adapters=False, weights=False)
    train.add_argument("--out", default=DEFAULT_OUT, help="the run's directory: checkpoint/, loss.jsonl, loss.png, adapter/")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--recipe",
        type=int,
        choices=(3, 4),
        default=None,
        help="the data recipe (default 3; 4 reads half the QA through the default compression, 2K-16K tokens)",
    )
    train.add_argument("--init-adapter", default=None, help="start from this adapter's weights (same rank), e.g. the shipped one, instead of zero")
    train.add_argument("--examples", type=int, default=None, help="training examples, each seen once (default 560: about 80 minutes on 2 CPU cores)")
    train.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16)")
    train.add_argument("--alpha", type=int, default=None, help="LoRA alpha (default 32)")
    train.add_argument("--learning-rate", type=float, default=None, help="peak learning rate (default 2e-4)")
    train.add_argument("--accumulate", type=int, default=None, help="examples per optimizer step (default 4)")
    train.add_argument("--qa-share", type=float, default=None, help="share of document-QA examples (default 0.6)")
    train.add_argument("--minutes", type=float, default=None, help="stop (with a checkpoint) after this long; run again to continue")
    train.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (default 20)")
    train.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in the backward pass to fit large models (default: on for CUDA, off on a CPU)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    ship = tasks.add_parser("ship", help="copy a trained adapter into the package as the embedded model's shipped adapter (float16)")
    ship.add_argument("adapter", help="the adapter directory (a run's adapter/)")
    ship.set_defaults(func=cmd_ship)


def cmd_ship(args: argparse.Namespace) -> int:
    from ..model.shipped_adapters import ship_adapter

    target = ship_adapter(args.adapter)
    print(f"shipped {args.adapter} as {target}; the engine loads it by default only once eval/tune/tune_gates.py records that every gate passed")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..model.loading import resolve_model_source
    from .dataset import QA_SHARE, build_examples, token_counter
    from .train import TuneError

    if args.examples < 0:
        raise TuneError(f"--examples must be >= 0, got {args.examples}")
    source, is_local = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=is_local)
    qa_share = QA_SHARE if args.qa_share is None else args.qa_share
    examples = build_examples(args.seed, args.examples, args.split, count_tokens=token_counter(tokenizer), qa_share=qa_share, recipe=args.recipe)
    lines = (json.dumps(e.to_dict()) + "\n" for e in examples)
    if args.out == "-":
        sys.stdout.writelines(lines)
    else:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines))
        print(f"wrote {len(examples)} {args.split} examples to {path}", file=sys.stderr)
    return 0


def config_from_args(args: argparse.Namespace):
    from .train import TuneConfig

    given = {
        "examples": args.examples,
        "rank": args.rank,
        "alpha": args.alpha,
        "learning_rate": args.learning_rate,
        "accumulate": args.accumulate,
        "qa_share": args.qa_share,
        "save_every": args.save_every,
        "recipe": args.recipe,
        "init_adapter": args.init_adapter,
    }
    return TuneConfig(
        model=args.model,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        minutes=args.minutes,
        attn_implementation=args.attn_implementation,
        gradient_checkpointing=args.gradient_checkpointing,
        **{k: v for k, v in given.items() if v is not None},
    )


def cmd_train(args: argparse.Namespace) -> int:
    from .train import tune

    config = config_from_args(args)
    config.check()
    state = tune(config, args.out, progress=not args.no_progress)
    summary: dict[str, object] = {k: state[k] for k in ("step", "examples_done", "tokens", "skipped", "stopped", "heldout_loss_base") if k in state}
    summary["minutes"] = round(state["seconds"] / 60, 1)
    summary["heldout_loss_tuned"] = state.get("heldout_loss_tuned")
    print(json.dumps(summary, indent=1))
    adapter = Path(args.out) / "adapter"
    if state.get("stopped"):
        print(f"stopped ({state['stopped']}) at example {state['examples_done']}/{config.examples}; run the same command to resume", file=sys.stderr)
        return STOPPED_EXIT
    if state.get("already_finished"):
        print(f"this run had finished already; its adapter is {adapter} (another --out trains a new one)", file=sys.stderr)
    else:
        print(f"adapter written to {adapter}; load it with --adapter {adapter}", file=sys.stderr)
    return 0
