"""The server's settings from ``snapkv-rag serve``'s options: checked, the engine loaded, the
:class:`~.app.ServerConfig` built. Shared by the process's own server (:mod:`.cli`) and the Ray
Serve replicas (:mod:`.ray_serve`)."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from ..errors import SnapKVRagError
from .defaults import DEFAULT_BODY_TIMEOUT


def served_model_name(model: str) -> str:
    """The id clients send: the embedded model's name, a directory's or file's base name, or the hub id."""
    from ..model.loading import DEFAULT_MODEL, EMBEDDED_GGUF

    if model == DEFAULT_MODEL:
        return EMBEDDED_GGUF.split(".")[0]
    if os.path.exists(model):
        name = os.path.basename(os.path.normpath(model))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name
    return model


# The least each numeric option takes (an option left unset, None, means its default).
_MINIMUMS = {
    "default_max_tokens": 1,
    "max_queue": 1,
    "max_batch_size": 1,
    "max_request_bytes": 1024,
    "replicas": 1,
    "routing_imbalance": 0,
    "threads": 1,
}


def check_args(args: argparse.Namespace) -> None:
    """Bad options fail here, before a model loads or Ray starts."""
    from ..compression import as_policy

    as_policy(args.compression)
    if args.port < 0 or args.port > 65535:
        raise SnapKVRagError(f"--port must be 0-65535, got {args.port}")
    for name, least in _MINIMUMS.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise SnapKVRagError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.prefill_chunk_tokens is not None and not (args.prefill_chunk_tokens == 0 or args.prefill_chunk_tokens >= 16):
        raise SnapKVRagError(f"--prefill-chunk-tokens must be 0 (whole prompts) or at least 16, got {args.prefill_chunk_tokens}")
    if getattr(args, "max_prompt_tokens", None) is not None and args.max_prompt_tokens < 1:
        raise SnapKVRagError(f"--max-prompt-tokens must be a positive number of tokens, got {args.max_prompt_tokens}")
    if not 0 < getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT) <= 3600:  # NaN fails too
        raise SnapKVRagError(f"--body-timeout must be more than 0 and at most 3600 seconds, got {args.body_timeout}")
    replicated = getattr(args, "replicas", 1) > 1 or getattr(args, "ray_address", None) is not None
    device = args.device or ""
    if replicated and device.startswith("cuda:"):
        raise SnapKVRagError(
            f"--device {device} with replicas: Ray gives each replica its own GPU (it sees it as cuda); use --device cuda, with --gpus-per-replica for a share"
        )
    gpus = getattr(args, "gpus_per_replica", None)
    if gpus is not None:
        if not replicated or (args.device is not None and not device.startswith("cuda")):  # no --device: replicas take their GPU
            raise SnapKVRagError("--gpus-per-replica applies to --replicas (or --ray-address) on GPUs: without --device, or with --device cuda")
        if not 0 < gpus <= 8:  # NaN fails too
            raise SnapKVRagError(f"--gpus-per-replica must be more than 0 and at most 8, got {gpus}")
    if not 0 <= args.shutdown_grace <= 3600:  # NaN fails too
        raise SnapKVRagError(f"--shutdown-grace must be 0-3600 seconds, got {args.shutdown_grace}")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The API keys the options give: each ``--api-key``, the lines of ``--api-keys-file``, else
    ``$SNAPKV_RAG_API_KEY`` (comma-separated); empty: no key is needed."""
    keys = [k.strip() for k in (getattr(args, "api_key", None) or [])]
    path = getattr(args, "api_keys_file", None)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SnapKVRagError(f"--api-keys-file {path}: cannot read it ({exc.__class__.__name__})") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SnapKVRagError(f"--api-keys-file {path} holds no key")
    if not keys:
        keys = [k.strip() for k in os.environ.get("SNAPKV_RAG_API_KEY", "").split(",") if k.strip()]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        raise SnapKVRagError("an API key must be non-empty and hold no spaces")
    return keys


def load_served_engine(args: argparse.Namespace):
    """The engine the options name, with its serving settings (batch size, chunked prefill, chunk store)."""
    from ..engine.shared import load_engine_quietly

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from ..model.shipped_adapters import AUTO, adapter_option

    adapter = adapter_option(getattr(args, "adapter", AUTO), base_model=getattr(args, "base_model", False))
    engine = load_engine_quietly(
        args.model,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        adapter=adapter,
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_admission=getattr(args, "prefix_cache_admission", "repeat"),
        attn_implementation=getattr(args, "attn_implementation", "sdpa"),
        invariant=getattr(args, "invariant", None),
        compile_decode=getattr(args, "compile_decode", None),
    )
    if engine.compiled_decode.usable:
        seconds = engine.warm_compiled_decode()
        print(f"compiled decode step ready in {seconds:.1f} s", file=sys.stderr, flush=True)
    if args.max_batch_size is not None:
        engine.max_batch_size = args.max_batch_size
    if args.prefill_chunk_tokens is not None:
        engine.prefill_chunk_tokens = args.prefill_chunk_tokens
    if args.kv_dir is not None:
        from ..reuse.offered import segment_store_at

        engine.segment_store = segment_store_at(args.kv_dir, args.kv_cache_bytes)
    return engine


def build_config(args: argparse.Namespace, engine=None, backend=None):
    """The server's configuration from the command line. Without ``backend`` the engine is
    loaded here (unless given); with one (Ray Serve) the engines live in its replicas."""
    from .app import ServerConfig

    check_args(args)
    embedder, embedder_id = None, "all-MiniLM-L6-v2"
    if args.embedder != "none":
        from ..rag.embeddings import Embedder

        embedder = Embedder(args.embedder)
        if args.embedder != "default":
            embedder_id = os.path.basename(os.path.normpath(args.embedder))
    if engine is None and backend is None:
        engine = load_served_engine(args)
    if embedder is not None and engine is not None:
        # the engine's thread (a second torch thread slows its decode), behind the completions
        embedder.runner = functools.partial(engine.run_on_model, background=True)
        embedder.busy = lambda: engine.decoding  # smaller batches while requests decode
    return ServerConfig(
        engine,
        model_id=args.served_model_name or served_model_name(args.model),
        aliases=(args.model,),
        compression=args.compression,
        default_max_tokens=args.default_max_tokens,
        api_key=api_keys(args),
        embedder=embedder,
        embedder_id=embedder_id,
        max_request_bytes=args.max_request_bytes,
        allow_origins=tuple(args.allow_origin or ()),
        max_queue=args.max_queue,
        backend=backend,
        shutdown_grace=args.shutdown_grace,
        public_metrics=getattr(args, "public_metrics", False),
        body_timeout=getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT),
        max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
        invariant=served_invariant(args, backend),
    )


def served_invariant(args: argparse.Namespace, backend=None) -> bool:
    """The engines' invariant mode, as ``/v1/models`` reports it: with Ray replicas what they
    describe (their options and environment decide it, not the ingress's); else ``--invariant``
    or ``$SNAPKV_RAG_INVARIANT``."""
    from ..engine.invariant import invariant_from_environment

    described = getattr(backend, "description", {}).get("invariant")
    if described is not None:
        return bool(described)
    return invariant_from_environment() if getattr(args, "invariant", None) is None else bool(args.invariant)
