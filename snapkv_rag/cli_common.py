"""What ``snapkv-rag`` and ``snapkv-rag eval`` share: model arguments and engine loading.

Kept free of torch imports so building the parser (``--help``) stays fast.
"""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a model dir, a .gguf file or a hub id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU and on CPUs with native bf16, else fp32)")
    p.add_argument("--weights", default=None, help="native (default) or int8: weight-only int8 linear layers on the CPU, faster decode, slightly less exact")
    p.add_argument(
        "--adapter",
        default="auto",
        help="a LoRA adapter directory to merge (snapkv-rag tune); default 'auto': the embedded model's shipped adapter where it passed its gates",
    )
    p.add_argument("--base-model", action="store_true", help="load the bare model, without any adapter")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def chosen_adapter(args: argparse.Namespace) -> str | None:
    """None (``--base-model``), ``"auto"``, or the ``--adapter`` directory as an absolute path
    (it may travel to another process: Ray replicas)."""
    from .model.shipped_adapters import adapter_option

    return adapter_option(getattr(args, "adapter", "auto"), base_model=getattr(args, "base_model", False))


def load_engine(args: argparse.Namespace, **options):
    """The engine named by ``--model/--device/--dtype/--weights/--adapter``, quietly (no progress bars or warnings)."""
    from .engine.shared import load_engine_quietly

    return load_engine_quietly(
        args.model, device=args.device, dtype=args.dtype, weights=getattr(args, "weights", None), adapter=chosen_adapter(args), **options
    )
