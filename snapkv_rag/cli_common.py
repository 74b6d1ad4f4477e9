"""The options every command shares, declared once: the model options (``snapkv-rag`` and its
``ask``, ``ingest``, ``eval``, ``less``, ``tune`` and ``serve``), the store options, and engine loading.

Kept free of torch imports so building the parser (``--help``) stays fast.
"""

from __future__ import annotations

import argparse

ATTENTION_KERNELS = ("sdpa", "flash_attention_2")  # snapkv_rag.compression.runtime.WRAPPED_IMPLEMENTATIONS (a test keeps them equal)


def add_model_args(p: argparse.ArgumentParser, *, json_output: bool = True, adapters: bool = True, weights: bool = True, adapter_default: str = "auto") -> None:
    """``--model --device --dtype`` and, unless turned off, ``--weights``, ``--adapter/--base-model`` and ``--json``."""
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a model dir, a .gguf file or a hub id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPUs and CPUs that compute it, fp16 on older GPUs, else fp32)")
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=ATTENTION_KERNELS,
        help="the attention kernel: sdpa (default; PyTorch's, any device) or flash_attention_2 (CUDA, needs the flash-attn package)",
    )
    p.add_argument(
        "--invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="greedy output that does not depend on the prefix cache, batching or drafts, in bf16 too (default: $SNAPKV_RAG_INVARIANT, else off)",
    )
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode through a compiled step over static buffers (torch.compile; the first request compiles, tens of seconds cold, "
        "cached on disk after; default: $SNAPKV_RAG_COMPILE_DECODE, else off)",
    )
    if weights:
        p.add_argument(
            "--weights", default=None, help="native (default) or int8: weight-only int8 linear layers on the CPU, faster decode, slightly less exact"
        )
    if adapters:
        p.add_argument(
            "--adapter",
            default=adapter_default,
            help=(
                f"a LoRA adapter directory to merge (snapkv-rag tune), or none; default {adapter_default!r}: the embedded model's shipped adapter "
                f"where the adapter rule puts it on for {'every use' if adapter_default == 'auto' else adapter_default.split(':')[1]} (snapkv-rag info says)"
            ),
        )
        p.add_argument("--base-model", action="store_true", help="load the bare model, without any adapter")
    if json_output:
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def chosen_adapter(args: argparse.Namespace) -> str | None:
    """None (``--base-model``), ``"auto"``, or the ``--adapter`` directory as an absolute path
    (it may travel to another process: Ray replicas)."""
    from .model.shipped_adapters import adapter_option

    return adapter_option(getattr(args, "adapter", "auto"), base_model=getattr(args, "base_model", False))


def load_engine(args: argparse.Namespace, **options):
    """The engine named by ``--model/--device/--dtype/--attn-implementation/--weights/--adapter``, quietly (no progress bars or warnings)."""
    from .engine.shared import load_engine_quietly

    return load_engine_quietly(
        args.model,
        device=args.device,
        dtype=args.dtype,
        weights=getattr(args, "weights", None),
        adapter=chosen_adapter(args),
        attn_implementation=getattr(args, "attn_implementation", "sdpa"),
        **{"invariant": getattr(args, "invariant", None), "compile_decode": getattr(args, "compile_decode", None), **options},
    )


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collection", required=True, help="Chroma collection name (3-512 of letters, digits, . _ -)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, help="embedded Chroma directory (default ~/.cache/snapkv-rag/chroma)")
    where.add_argument("--chroma-url", default=None, help="a Chroma server, e.g. http://127.0.0.1:8000")
    p.add_argument("--embedder", default="default", help="sentence-transformers model path (default: embedded all-MiniLM-L6-v2)")


def open_store(args, *, create: bool = True):
    from pathlib import Path

    from .rag.store import DocumentStore, StoreError

    if not create and args.store is not None and not Path(args.store).expanduser().is_dir():
        # Reading a store never creates one: a typo in --store must not leave an empty directory behind.
        raise StoreError(
            f"no store at {args.store} (no such directory); ingest into it first: snapkv-rag ingest PATH --collection {args.collection} --store {args.store}"
        )
    return DocumentStore(args.collection, path=args.store, url=args.chroma_url, embedder=args.embedder, create=create)
