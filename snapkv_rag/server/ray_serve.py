"""``snapkv-rag serve --replicas N``: engine replicas on Ray Serve, routed by cache affinity.

Two deployments. ``OpenAIIngress`` (one replica, no CPU reserved) runs the very app of the
single-process server (:func:`.app.create_app`: the same routes, parsing, errors, streaming,
API key and metrics), with :class:`RayBackend` in place of the in-process engine.
``EngineReplica`` (N replicas, ``--threads`` torch threads each) holds an engine and runs
:func:`.app.open_engine_stream`, as the single-process server does, streaming the pieces
back over Ray. Between them, :class:`CacheAffinityRouter` (Ray Serve's documented custom
request router API) sends a request to the replica that ran its prompt's prefix or chunks
in the request's cache namespace (API key and ``cache_salt``), never another tenant's.

Ray's own ``PrefixCacheAffinityRouter`` lives in ``ray.serve.llm``, which cannot be imported
without vLLM or SGLang installed, and matches message contents only (not roles, tool calls or
chunks); the router here is small and keeps the same policy: prefix affinity while the load is
balanced, the least loaded replica otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..compression import as_policy
from ..errors import SnapKVRagError
from .affinity import AffinityTable, affinity_keys
from .protocol import APIError, ParsedRequest, from_engine_error

log = logging.getLogger("snapkv_rag.server")


def _replicas_on_loopback() -> None:
    """A local Ray instance (``snapkv-rag serve`` sets Ray's single-machine mode) listens on
    loopback, except that Ray Serve starts each replica's inter-deployment gRPC server on every
    interface ("[::]:0", no option): bind it to loopback as well, in that mode only."""
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        return
    from ray.serve._private import replica

    every_interface = replica.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> int:
        return every_interface(server, "127.0.0.1:0" if address == "[::]:0" else address)

    replica.add_port_to_grpc_server = on_loopback


_replicas_on_loopback()  # this module is imported in every replica before it starts serving

APP_NAME = "snapkv-rag"
ENGINE_DEPLOYMENT = "EngineReplica"


def _error_fields(error: APIError) -> dict[str, Any]:
    return {"status": error.status, "message": error.message, "type": error.type, "param": error.param, "code": error.code}


def _api_error(fields: dict[str, Any]) -> APIError:
    return APIError(fields["status"], fields["message"], type=fields["type"], param=fields["param"], code=fields["code"])


def _replica_lost(exc: BaseException) -> APIError:
    return APIError(
        503, f"the replica serving this request failed ({type(exc).__name__}); Ray Serve replaces it: retry", type="server_error", code="replica_unavailable"
    )


# --------------------------------------------------------------------------- routing


class CacheAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a request to the live replica holding the longest prefix of its prompt (or the
    most of its ``reuse_segments`` chunks) in its cache namespace, unless that replica has ``imbalance`` more requests
    in flight than the least loaded one; requests that match nothing go to the least loaded.
    ``mode="round_robin"`` ignores the caches (the baseline of the measurement)."""

    @classmethod
    def standalone(cls, **options: Any) -> CacheAffinityRouter:
        """This router's policy without Ray Serve's state (every replica idle): for probes and tests."""
        router = cls.__new__(cls)
        router.initialize_state(**options)
        router._replica_queue_len_cache = {}  # type: ignore[assignment]  # Ray fills its own with live queue lengths
        return router

    def initialize_state(self, mode: str = "affinity", imbalance: int = 4, max_keys: int = 200_000, **_: Any) -> None:
        if mode not in ("affinity", "round_robin"):
            raise ValueError(f"unknown routing mode {mode!r}")
        self.mode = mode
        self.imbalance = imbalance
        self.table = AffinityTable(max_keys)
        self.turn = 0

    def _load(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return known if known is not None else 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # least loaded first; among equals, the one that started the fewest conversations (so new ones spread)
        ranked = sorted(candidate_replicas, key=lambda r: (self._load(r), self.table.started(r.replica_id), r.replica_id.unique_id))
        if not ranked:
            return []
        first = ranked[0]
        request = _engine_request(pending_request)
        if self.mode == "round_robin":
            self.turn += 1
            first = sorted(ranked, key=lambda r: r.replica_id.unique_id)[self.turn % len(ranked)]
        elif request is not None:
            owner, _share = self.table.best(*_keys(request), {r.replica_id for r in ranked})
            if owner is not None:
                preferred = next(r for r in ranked if r.replica_id == owner)
                if self._load(preferred) - self._load(ranked[0]) <= self.imbalance:
                    first = preferred
        return [[first], [r for r in ranked if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _engine_request(pending_request)
        if self.mode == "affinity" and request is not None:
            prefix_keys, segment_keys = _keys(request)
            self.table.record([*prefix_keys, *segment_keys], replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)


def _keys(request: ParsedRequest) -> tuple[list[bytes], list[bytes]]:
    """The request's keys in its cache namespace (the ingress put it in ``cache_salt``)."""
    return affinity_keys(request.prompt, request.sampling.get("reuse_segments") or (), request.sampling.get("cache_salt"))


def _engine_request(pending_request: PendingRequest | None) -> ParsedRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ParsedRequest):
            return arg
    return None


# --------------------------------------------------------------------------- the replicas


class EngineReplica:
    """One engine, loaded from the ``serve`` options, with ``threads`` torch threads."""

    def __init__(self, options: dict[str, Any]):
        from ..model.allocator import bound_allocator
        from .config import load_served_engine

        bound_allocator()  # each replica is a long-running process of its own
        args = argparse.Namespace(**options)
        self.engine = load_served_engine(args)
        self.compression = as_policy(args.compression)
        self.default_max_tokens = args.default_max_tokens
        self.max_prompt_tokens = getattr(args, "max_prompt_tokens", None)
        self.id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, request: ParsedRequest):
        """Messages: ``("opened", replica id)`` or ``("error", fields)`` first; then
        ``("piece", text or tool-call delta)`` ... and ``("result", GenerationResult)`` or
        ``("error", fields)``. Cancelling the call (the client left) stops the generation."""
        from .app import open_engine_stream

        loop = asyncio.get_running_loop()
        try:
            stream = await loop.run_in_executor(
                None, open_engine_stream, self.engine, request, self.compression, self.default_max_tokens, self.max_prompt_tokens
            )
        except Exception as exc:
            yield ("error", _error_fields(from_engine_error(exc, request.kind)))
            return
        yield ("opened", self.id)
        try:
            async with stream:
                async for piece in stream:
                    yield ("piece", piece)
        except Exception as exc:
            yield ("error", _error_fields(from_engine_error(exc, request.kind)))
            return
        yield ("result", stream.result)

    def describe(self) -> dict[str, Any]:
        info = self.engine.info()
        return {"context_length": info.context_length, "device": info.device, "replica": self.id, "invariant": bool(self.engine.invariant)}

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.scheduler_stats()
        return {"running_requests": stats.running_requests, "waiting_tasks": stats.waiting_tasks}


# --------------------------------------------------------------------------- the ingress


class RemoteStream:
    """A replica's answer, read like the engine's own async stream: ``async with``, ``async
    for`` pieces, then ``result``. A replica that dies mid-way ends it with a 503, never a hang."""

    def __init__(self, messages, replica: str):
        self.messages = messages
        self.replica = replica
        self.result = None
        self.done = False

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if not self.done:
            self.done = True
            self.messages.cancel()  # the client went away: the replica's engine stops

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        try:
            kind, value = await self.messages.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise _replica_lost(RuntimeError("the replica ended the stream without a result")) from None
        except RayError as exc:
            self.done = True
            raise _replica_lost(exc) from None
        if kind == "piece":
            return value
        self.done = True
        if kind == "result":
            self.result = value
            raise StopAsyncIteration
        raise _api_error(value)


class RayBackend:
    """Requests run on the ``EngineReplica`` deployment's replicas, through ``handle``."""

    def __init__(self, handle, description: dict[str, Any]):
        self.handle = handle
        self.description = description

    async def open(self, config, request: ParsedRequest) -> RemoteStream:
        messages = self.handle.options(stream=True).generate.remote(request)
        try:
            kind, value = await messages.__anext__()
        except (RayError, StopAsyncIteration) as exc:
            raise _replica_lost(exc) from None
        except asyncio.CancelledError:  # the client left during the prefill: the replica stops too
            messages.cancel()
            raise
        if kind == "error":
            raise _api_error(value)
        return RemoteStream(messages, value)

    async def health(self) -> dict[str, Any]:
        replicas = await asyncio.get_running_loop().run_in_executor(None, live_replicas)
        return {"context_length": self.description["context_length"], "device": self.description["device"], "replicas": replicas}


def live_replicas(app_name: str = APP_NAME) -> int:
    """Engine replicas in the RUNNING state, as Serve's controller sees them."""
    application = serve.status().applications.get(app_name)
    if application is None or ENGINE_DEPLOYMENT not in application.deployments:
        return 0
    states = application.deployments[ENGINE_DEPLOYMENT].replica_states
    return sum(count for state, count in states.items() if state == "RUNNING")  # ReplicaState is a str enum


@serve.ingress()
class OpenAIIngress:
    def __init__(self, engines, options: dict[str, Any]):
        self.engines = engines
        self.options = options
        server_log = logging.getLogger("snapkv_rag.server")  # one line per request, as in one process
        if not server_log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
            server_log.addHandler(handler)
        server_log.setLevel(logging.INFO)

    async def __serve_build_asgi_app__(self):
        from .app import create_app
        from .config import build_config

        description = await self.engines.describe.remote()
        backend = RayBackend(self.engines, description)
        args = argparse.Namespace(**self.options)
        config = await asyncio.get_running_loop().run_in_executor(None, lambda: build_config(args, backend=backend))
        return create_app(config)


# --------------------------------------------------------------------------- the command


def replica_threads(args: argparse.Namespace) -> int:
    """Torch threads per replica: ``--threads``, else the machine's cores shared among the replicas."""
    return args.threads or max(1, (os.cpu_count() or 1) // args.replicas)


def _uses_gpu(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def replica_actor_options(args: argparse.Namespace) -> dict[str, Any]:
    """What Ray gives each engine replica: ``threads`` CPUs and ``--gpus-per-replica`` GPUs, else
    one GPU with ``--device cuda`` or, without ``--device``, where this machine has one (Ray hides
    the GPUs from an actor that asks for none)."""
    threads = replica_threads(args)
    asked = getattr(args, "gpus_per_replica", None)  # check_args refused it with a device other than cuda
    gpus = asked if asked is not None else 1.0 if _uses_gpu(args.device) else 0
    return {"num_cpus": threads, "num_gpus": gpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}


def build_application(args: argparse.Namespace):
    """The Serve application for ``args`` (the ``serve`` options): ingress -> N engine replicas."""
    threads = replica_threads(args)
    options = {**vars(args), "threads": threads}
    options.pop("func", None)
    engines = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=args.replicas,
        max_ongoing_requests=args.max_queue,  # the engine queues and batches them itself
        ray_actor_options=replica_actor_options(args),
        request_router_config={
            "request_router_class": f"{__name__}.CacheAffinityRouter",
            "request_router_kwargs": {"mode": args.routing.replace("-", "_"), "imbalance": args.routing_imbalance},
        },
        health_check_period_s=2,
        graceful_shutdown_wait_loop_s=1,
        graceful_shutdown_timeout_s=args.shutdown_grace,
    )(EngineReplica)
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=args.max_queue + 16,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=1,
        graceful_shutdown_timeout_s=args.shutdown_grace,
    )(OpenAIIngress)
    return ingress.bind(engines.bind(options), options)


def connect(args: argparse.Namespace) -> None:
    """Start a local Ray instance, or join ``--ray-address`` (one clear error when it cannot be reached)."""
    threads = replica_threads(args)
    if not joins_cluster(args):  # None or "local": a new Ray instance on this machine
        ray.init(num_cpus=max(os.cpu_count() or 1, threads * args.replicas), include_dashboard=False, logging_level=logging.WARNING)
        return
    _check_reachable(args.ray_address)
    try:
        ray.init(address=args.ray_address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SnapKVRagError(f"cannot join the Ray cluster at {args.ray_address}: {exc}") from None


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """ray.init retries an unreachable GCS address for minutes: fail fast on a host:port that does not answer."""
    host_port = address.split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: ray.init finds the cluster or says it found none
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise SnapKVRagError(f"cannot join the Ray cluster at {address}: nothing answers there ({exc})") from None


def deploy(args: argparse.Namespace) -> None:
    """Serve's HTTP proxy on ``--host``/``--port``, then the application; returns once it runs."""
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")


def joins_cluster(args: argparse.Namespace) -> bool:
    return args.ray_address not in (None, "local")


def stop(joined: bool, deployed: bool) -> None:
    """Take the application down; Serve and Ray too, unless they belong to a cluster we joined."""
    if not ray.is_initialized():
        return
    try:
        if deployed:
            serve.delete(APP_NAME)
            if not joined:
                serve.shutdown()
    finally:
        ray.shutdown()


def serve_on_ray(args: argparse.Namespace) -> int:
    """``snapkv-rag serve --replicas N``: runs until Ctrl+C or SIGTERM (``docker stop``), then
    takes the application down and exits 0 (also when the signal comes while it starts)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stopping = threading.Event()
    deployed = False

    def on_signal(*_: Any) -> None:
        stopping.set()

    def handle_signals(handler: Any) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, handler)

    handle_signals(on_signal)
    started = time.perf_counter()
    try:
        try:
            connect(args)
        except SystemExit:  # SIGTERM while ray.init ran: its own handler (sys.exit) was in force
            stopping.set()
        handle_signals(on_signal)  # ray.init installed its own SIGTERM handler
        if not stopping.is_set():
            deployed = True
            deploy(args)
        if not stopping.is_set():
            where = f"Ray cluster {args.ray_address}" if joins_cluster(args) else "a local Ray instance"
            threads = replica_threads(args)
            print(
                f"snapkv-rag: OpenAI-compatible API at http://{args.host}:{args.port}/v1 from {args.replicas} replica(s) on {where} "
                f"({threads} threads each, {args.routing} routing; up in {time.perf_counter() - started:.0f} s). Ctrl+C stops it.",
                file=sys.stderr,
            )
        while not stopping.wait(1.0):
            pass
    finally:
        handle_signals(signal.SIG_IGN)  # a second Ctrl+C does not cut the shutdown short
        stop(joined=joins_cluster(args), deployed=deployed)
    return 0
