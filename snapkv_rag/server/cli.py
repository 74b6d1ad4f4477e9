"""``snapkv-rag serve``: the OpenAI-compatible server (:mod:`.app`) under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import SnapKVRagError


def add_serve_parser(sub) -> None:
    from . import DEFAULT_COMPRESSION, DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, embeddings)")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a model dir, a .gguf file or a hub id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU and on CPUs with native bf16, else fp32)")
    p.add_argument("--weights", default=None, help="native (default) or int8: weight-only int8 linear layers on the CPU, faster decode, slightly less exact")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--compression", default=DEFAULT_COMPRESSION, help=f"default policy spec for requests that name none (default {DEFAULT_COMPRESSION}; 'full' for none)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model's name, e.g. SmolLM2-135M-Instruct; the --model value is accepted too)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $SNAPKV_RAG_API_KEY, else no key)")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"max_tokens when a request gives none (default {DEFAULT_MAX_TOKENS}, capped by the room in the context)",
    )
    p.add_argument("--embedder", default="default", help="sentence-transformers model for /v1/embeddings: 'default' (all-MiniLM-L6-v2), a path, or 'none'")
    p.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help=f"larger request bodies get a 413 (default {DEFAULT_MAX_REQUEST_BYTES})"
    )
    p.add_argument(
        "--allow-origin", action="append", default=None, help="an origin browsers may call from (CORS), e.g. http://localhost:3000; repeatable; '*' for any"
    )
    p.add_argument("--prefix-cache-bytes", type=int, default=None, help="bound of the prefix cache (default: 1 GiB on CPU; 0 disables)")
    p.add_argument(
        "--kv-dir", default=None, help="store the K/V of requests' reuse_segments here (shared with other processes, kept across restarts; default: in memory)"
    )
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="bound of --kv-dir (default 2 GiB; least recently used first)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"completion requests admitted at once, waiting or generating; more get 429 with Retry-After (default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="requests' rows decoded together by continuous batching; further prefills wait for room (default: 16 on a CPU, 64 on a GPU)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="a prompt that arrives while others decode is prefilled in chunks of this many tokens (default: 512 on a CPU, 2048 on a GPU; 0: whole)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas on Ray Serve, with cache-affinity routing (default 1: one engine in this process, no Ray; needs the 'ray' extra)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, or ray://head:10001) instead of starting a local Ray instance; 'local': a new local one even for 1 replica",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per engine (default: all cores for one engine in this process; cores / replicas on Ray)"
    )
    p.add_argument(
        "--routing",
        choices=("affinity", "round-robin"),
        default="affinity",
        help="how Ray Serve picks a replica: the one that holds the request's prompt prefix or chunks (default), or in turn",
    )
    p.add_argument(
        "--routing-imbalance",
        type=int,
        default=4,
        help="affinity gives way when the preferred replica has this many more requests in flight than the least loaded one (default 4)",
    )
    p.set_defaults(func=cmd_serve)


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


def load_served_engine(args: argparse.Namespace):
    """The engine the options name, with its serving settings (batch size, chunked prefill, chunk store)."""
    from ..cli_common import load_engine

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    engine = load_engine(args, prefix_cache_bytes=args.prefix_cache_bytes)
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
        embedder.runner = engine.run_on_model  # the engine's thread: a second torch thread slows its decode
    return ServerConfig(
        engine,
        model_id=args.served_model_name or served_model_name(args.model),
        aliases=(args.model,),
        compression=args.compression,
        default_max_tokens=args.default_max_tokens,
        api_key=args.api_key or os.environ.get("SNAPKV_RAG_API_KEY"),
        embedder=embedder,
        embedder_id=embedder_id,
        max_request_bytes=args.max_request_bytes,
        allow_origins=tuple(args.allow_origin or ()),
        max_queue=args.max_queue,
        backend=backend,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    check_args(args)
    if args.replicas > 1 or args.ray_address is not None:
        try:
            from .ray_serve import serve_on_ray
        except ImportError as exc:
            raise SnapKVRagError(f"--replicas and --ray-address need Ray Serve ({exc}): pip install 'snapkv-rag[ray]'") from None
        return serve_on_ray(args)
    config = build_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models = config.model_id + (f", {config.embedder_id}" if config.embedder is not None else "")
    print(
        f"snapkv-rag: OpenAI-compatible API at http://{args.host}:{args.port}/v1 (models: {models}; "
        f"compression: {config.compression_spec}{'; API key required' if config.api_key else ''}). Ctrl+C stops it.",
        file=sys.stderr,
    )
    # In-flight streams get 5 s to finish on Ctrl+C or `docker stop` (which kills after 10 s).
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
