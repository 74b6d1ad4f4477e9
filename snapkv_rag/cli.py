"""``snapkv-rag``: local long-context LLM apps with a compressed KV cache.

Commands: ingest and ask (document QA over Chroma), generate, chat, info, serve (OpenAI-compatible
API), app (Streamlit document QA), eval (citations, needle, fidelity, speed), less (LESS kernels) and
tune (LoRA fine-tuning of the model on generated document-QA and tool-decision data).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .cli_common import add_model_args, load_engine
from .errors import SnapKVRagError


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="always produce --max-new-tokens tokens (benchmarks)")
    p.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=None,
        metavar="K",
        help="check up to K draft tokens looked up in the prompt per decode forward (greedy output unchanged; 0 = off, "
        "the default except for ask, which follows DocumentQA's)",
    )
    p.add_argument(
        "--compression",
        default="default",
        help="policy spec: default (the one default compression, printed by 'snapkv-rag info') | snapkv:budget=1024,window=32,kernel=7,pooling=max | "
        "streamingllm:budget=1024 | h2o:budget=1024 | random:budget=1024 | full (none). A prompt past the model's window is read rolled.",
    )


def _gen_kwargs(args) -> dict[str, Any]:
    """Generation keyword arguments, validated before any model is loaded."""
    from .compression import as_policy
    from .engine.sampling import GenerationParams

    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens or 0,
    )
    GenerationParams.build(**sampling)
    return {**sampling, "compression": as_policy(args.compression)}


def cmd_generate(args) -> int:
    # A trailing newline from `echo ... |` or a file is not part of the prompt.
    prompt = args.prompt if args.prompt not in (None, "-") else sys.stdin.read().rstrip("\r\n")
    kwargs = _gen_kwargs(args)
    engine = load_engine(args)
    chat = False if args.raw else None
    if args.json:
        result = engine.generate(prompt, chat=chat, **kwargs)
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    stream = engine.stream(prompt, chat=chat, **kwargs)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    kwargs = _gen_kwargs(args)
    engine = load_engine(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        stream = engine.stream(messages, **kwargs, **({"keep_context": True} if args.keep_context and len(messages) > 1 else {}))
        if not args.json:
            sys.stdout.write("assistant> " if interactive else "")
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            for _ in stream:
                pass
            print(json.dumps(stream.result.to_dict()))
        messages.append({"role": "assistant", "content": stream.result.text})
    return 0


def kv_bits_supported() -> str:
    from .compression.quantized import KEY_GROUP, KV_BITS

    return f"{', '.join(map(str, KV_BITS))} (keys per channel in groups of {KEY_GROUP} entries, values per entry; e.g. snapkv:budget=1024,kv_bits=4)"


def cmd_info(args) -> int:
    from .cli_common import chosen_adapter
    from .model.loading import DEFAULT_MODEL, cpu_bf16_support
    from .model.shipped_adapters import adapter_note

    engine = load_engine(args)
    info = engine.info()
    from .compression import DEFAULT_COMPRESSION
    from .engine.compiled_decode import inductor_cache_dir, unavailable_reason

    details = {
        **info.to_dict(),
        "compile_available": unavailable_reason(engine.model) or f"yes (--compile-decode; kernels cached in {inductor_cache_dir()})",
        "default_compression": DEFAULT_COMPRESSION.spec(),
        "cpu_native_bf16": cpu_bf16_support() or "no",
        "kv_bits": kv_bits_supported(),
    }
    if info.adapter is None and not args.json:
        details["adapter"] = adapter_note(chosen_adapter(args), embedded=args.model == DEFAULT_MODEL)
    if args.json:
        print(json.dumps(details, indent=2))
    else:
        for key, value in details.items():
            print(f"{key:>20}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapkv-rag", description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt (argument or stdin)")
    gen.add_argument("prompt", nargs="?", help="the prompt; '-' or absent reads stdin")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    add_model_args(gen)
    _add_generation_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat (one user turn per line on stdin)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument(
        "--keep-context",
        action="store_true",
        help="compress the conversation before each new turn once, without the turn, and keep it: each turn reads only what it adds "
        "(question-agnostic policies suit it, e.g. --compression expected:budget=1024)",
    )
    add_model_args(chat)
    _add_generation_args(chat)
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="model configuration and KV bytes per token")
    add_model_args(info)
    info.set_defaults(func=cmd_info)

    from .adapter_training.cli import add_tune_parser
    from .app.cli import add_app_parser
    from .harness.cli import add_eval_parser
    from .less_training.cli import add_less_parser
    from .rag.cli import add_rag_parsers
    from .server.cli import add_serve_parser

    add_rag_parsers(sub, add_model_args, _add_generation_args)

    add_eval_parser(sub)
    add_less_parser(sub)
    add_app_parser(sub)
    add_serve_parser(sub)
    add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SnapKVRagError as exc:
        print(f"snapkv-rag: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer


if __name__ == "__main__":
    sys.exit(main())
