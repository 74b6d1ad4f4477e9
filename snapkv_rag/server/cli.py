"""``snapkv-rag serve``: the OpenAI-compatible server (:mod:`.app`) under uvicorn; its options become
the server's settings in :mod:`.config`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..cli_common import add_model_args
from ..errors import SnapKVRagError


def add_serve_parser(sub) -> None:
    from .defaults import DEFAULT_BODY_TIMEOUT, DEFAULT_COMPRESSION, DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS, DEFAULT_SHUTDOWN_GRACE

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, embeddings)")
    add_model_args(p, json_output=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--compression",
        default=DEFAULT_COMPRESSION,
        help=f"default policy spec for requests that name none (default {DEFAULT_COMPRESSION!r}: the one default compression, "
        "printed by snapkv-rag info; 'full' for none)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model's name, e.g. SmolLM2-135M-Instruct; the --model value is accepted too)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY'; give it once per tenant (each key's prompts reuse only its own cached K/V) "
        "(default: $SNAPKV_RAG_API_KEY, comma-separated for several, else no key)",
    )
    p.add_argument("--api-keys-file", default=None, help="a file of API keys, one per line (blank lines and # comments skipped), added to --api-key")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key (default: behind it, where a key is set)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="the most prompt tokens a request may have when a rolling prefill (rolling=) reads it past the context (default: the model's context length)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds a request body may take to arrive; slower clients get 408 and never hold a queue place (default {DEFAULT_BODY_TIMEOUT:g})",
    )
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
        "--prefix-cache-admission",
        choices=("repeat", "always"),
        default="repeat",
        help="which compressed prompts the prefix cache stores: 'repeat' (default: those whose opening came before; "
        "a one-off long prompt keeps compression's low peak) or 'always' (every one; its prefill peaks like a full one)",
    )
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
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        help=f"seconds that generating requests get to finish at Ctrl+C or SIGTERM; then they end with a server_shutting_down error "
        f"(default {DEFAULT_SHUTDOWN_GRACE:g}; `docker stop` kills after 10)",
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
        "--gpus-per-replica",
        type=float,
        default=None,
        help="GPUs Ray gives each replica on CUDA (the default where there is a GPU): default 1; 0.5 puts two replicas on one GPU; Ray picks which",
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..model.allocator import bound_allocator
    from .app import create_app
    from .config import build_config, check_args
    from .draining import DrainingServer

    check_args(args)
    bound_allocator()  # before the model loads: a long-running server's memory plateaus (model.allocator)
    if args.replicas > 1 or args.ray_address is not None:
        if args.ray_address in (None, "local"):
            # Ray's single-machine mode: a local instance's own services (GCS, raylet, agents,
            # workers) listen on loopback only, not on every interface; set it to 1 to let other
            # machines reach them (docs/ray-serve.md). Read when ray is first imported.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            from .ray_serve import serve_on_ray
        except ImportError as exc:
            raise SnapKVRagError(f"--replicas and --ray-address need Ray Serve ({exc}): pip install 'snapkv-rag[ray]'") from None
        return serve_on_ray(args)
    config = build_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models = config.model_id + (f", {config.embedder_id}" if config.embedder is not None else "")
    keys = len(config.api_keys)
    access = "; API key required" if keys == 1 else f"; {keys} API keys (tenants)" if keys else ""
    print(
        f"snapkv-rag: OpenAI-compatible API at http://{args.host}:{args.port}/v1 (models: {models}; "
        f"compression: {config.compression_spec}{access}). Ctrl+C stops it.",
        file=sys.stderr,
    )
    # Requests stop within the grace and a step (DrainingServer); uvicorn's own bound cuts connections only past that.
    app = create_app(config)
    settings = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=int(args.shutdown_grace) + 5)
    DrainingServer(settings, app.state.drain).run()
    return 0
