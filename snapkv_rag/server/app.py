"""An OpenAI-compatible HTTP server over one :class:`~snapkv_rag.Engine` (Starlette + uvicorn).

``POST /v1/chat/completions`` (streaming, tools, JSON output), ``POST /v1/completions``,
``POST /v1/embeddings`` (the RAG embedder), ``GET /v1/models`` and ``GET /health``. Every
request goes through the engine's own ``astream``: the same decode loop,
compression policies, prefix cache and grammar as the API and CLI. Concurrent requests are
batched continuously by the engine's scheduler (each joins the running decode batch after its
prefill, with its own compression); a client that disconnects stops its generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..compression import CompressionPolicy, as_policy, can_roll, fit_to_window
from ..engine.results import kept_tokens_text
from .affinity import replica_tag
from .defaults import DEFAULT_BODY_TIMEOUT, DEFAULT_COMPRESSION, DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS, DEFAULT_SHUTDOWN_GRACE
from .draining import Drain, shutting_down
from .metrics import PieceClock, ServerMetrics
from .protocol import (
    APIError,
    ChunkWriter,
    ParsedRequest,
    completion_response,
    embedding_response,
    from_engine_error,
    invalid,
    json_bytes,
    new_id,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    prompt_param,
)
from .responses import ResponseEventWriter, parse_responses_request, response_body

log = logging.getLogger("snapkv_rag.server")

#: Threads for embedding jobs, apart from the event loop's default pool, which opens every completion
#: (renders and tokenizes its prompt): a burst of long embedding calls there left no thread to open a chat
#: with. The jobs take the engine's thread in turn, so more threads would only wait.
EMBEDDING_THREADS = 2


class ServerConfig:
    """What the server serves and how. ``api_key``: one key or several, one of which is required
    as ``Authorization: Bearer ...`` when set; each key is a tenant whose prompts reuse only
    K/V its own requests stored. ``default_max_tokens``: the cap when a request gives no ``max_tokens`` (the
    room left in the context caps it too). ``embedder``: an :class:`~snapkv_rag.rag.Embedder`
    for ``/v1/embeddings`` (loaded on first use), or None to serve no embeddings.
    ``shutdown_grace``: seconds that generating requests get to finish at Ctrl+C or SIGTERM
    (:mod:`.draining`). ``public_metrics``: serve ``/metrics`` without the API key.
    ``body_timeout``: seconds a request body may take to arrive (then 408). ``max_prompt_tokens``:
    the most prompt tokens a request read with a rolling prefill may have (None: the model's context)."""

    def __init__(
        self,
        engine,
        *,
        model_id: str | None = None,
        aliases: tuple[str, ...] = (),
        compression: CompressionPolicy | str | None = DEFAULT_COMPRESSION,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        api_key: str | Sequence[str] | None = None,
        embedder=None,
        embedder_id: str = "all-MiniLM-L6-v2",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        allow_origins: tuple[str, ...] = (),
        max_queue: int = DEFAULT_MAX_QUEUE,
        backend=None,
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
        public_metrics: bool = False,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_prompt_tokens: int | None = None,
        invariant: bool = False,
    ):
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be a positive integer, got {default_max_tokens!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue!r}")
        if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or not 0 <= shutdown_grace < float("inf"):
            raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")
        if engine is None and (backend is None or model_id is None):
            raise ValueError("ServerConfig needs an engine, or a backend and a model_id")
        self.engine = engine  # None when the engines run elsewhere (Ray Serve replicas)
        self.backend = backend or InProcess(engine)
        self.model_id = model_id or engine.name
        self.aliases = {self.model_id, *aliases}  # ids a request may name for the model
        self.compression = as_policy(compression)  # an invalid spec fails at start, not on the first request
        self.compression_spec = self.compression.spec() if self.compression is not None else "full"
        self.default_max_tokens = default_max_tokens
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        if not all(isinstance(k, str) and k.strip() == k and k for k in keys):
            raise ValueError("API keys must be non-empty strings without surrounding spaces")
        self.api_keys = tuple(dict.fromkeys(keys))  # each key a tenant: its prompts reuse only its own K/V
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.embedder = embedder
        self.embedder_id = embedder_id
        self.max_request_bytes = max_request_bytes
        self.allow_origins = tuple(allow_origins)
        self.max_queue = max_queue  # completion requests admitted at once (waiting or generating); more get 429
        self.shutdown_grace = shutdown_grace
        self.public_metrics = public_metrics  # /metrics without the API key (where one is set)
        if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)) or not 0 < body_timeout < float("inf"):
            raise ValueError(f"body_timeout must be a positive number of seconds, got {body_timeout!r}")
        self.body_timeout = body_timeout  # seconds a request's body may take to arrive
        if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1):
            raise ValueError(f"max_prompt_tokens must be a positive integer or None, got {max_prompt_tokens!r}")
        self.max_prompt_tokens = max_prompt_tokens  # the most prompt tokens a rolling prefill reads (None: the model's context)
        self.started = int(time.time())
        # the engines' invariant mode (engine.invariant; with Ray replicas, what their options asked for)
        self.invariant = bool(getattr(engine, "invariant", False)) if engine is not None else bool(invariant)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def is_json_media_type(content_type: str) -> bool:
    """``application/json`` (any parameters, e.g. ``; charset=utf-8``) or a ``+json`` type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {int(declared)} bytes; this server takes at most {limit}", code="request_too_large")
    # A web page can POST text/plain, a form or a typeless blob to localhost without a CORS
    # preflight; only a JSON content type (which needs one) is read.
    content_type = request.headers.get("content-type", "")
    if not is_json_media_type(content_type):
        raise APIError(
            415,
            f"the request body must be sent as Content-Type: application/json, not {content_type or 'without a Content-Type'}",
            code="unsupported_media_type",
        )

    async def read() -> bytearray:
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise APIError(413, f"the request body is over {limit} bytes, the most this server takes", code="request_too_large")
        return raw

    try:  # a client that trickles its body is cut off, and holds no place in the queue meanwhile
        raw = await asyncio.wait_for(read(), timeout)
    except (TimeoutError, asyncio.TimeoutError):  # noqa: UP041 -- two classes on Python 3.10, one from 3.11
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout") from None
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogate escapes ("\ud83d") fail here
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8 text; send a JSON object") from None
    except UnicodeEncodeError:
        raise invalid("the request body has invalid Unicode: an unpaired surrogate escape such as \\ud83d") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    return body


class APIKeyMiddleware:
    """Every ``/v1/`` request, and ``/metrics`` unless ``public_metrics``, must carry
    ``Authorization: Bearer <key>`` with one of ``api_keys`` (``/health`` and CORS preflights
    need none); one 401 in OpenAI's error shape otherwise. Each key is a tenant: the request's
    ``state.tenant`` names it (a digest, never the key), and its prompts reuse only its own K/V."""

    def __init__(self, app, api_keys: Sequence[str], public_metrics: bool = False):
        self.app = app
        self.keys = [(key.encode(), tenant_of(key)) for key in api_keys]
        if not self.keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.public_metrics = public_metrics

    def guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (path.rstrip("/") == "/metrics" and not self.public_metrics)

    def tenant(self, token: bytes) -> str | None:
        found = None
        for key, tenant in self.keys:  # every key compared, in constant time: no early exit to time
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.guarded(scope["path"]) and scope["method"] != "OPTIONS":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            tenant = self.tenant(token.strip().encode()) if scheme.lower() == "bearer" else None
            if tenant is None:
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", type="authentication_error", code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def tenant_of(api_key: str) -> str:
    """A tenant's name for its API key: a digest that neither logs nor keys give back."""
    return hashlib.sha256(b"snapkv-rag tenant\0" + api_key.encode()).hexdigest()[:16]


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The engine's ``cache_salt`` for a request: its tenant (API key) and its own ``cache_salt``
    together, or None (the shared namespace of a keyless server's unsalted requests)."""
    if tenant is None and salt is None:
        return None
    return hashlib.sha256(f"{tenant or ''}\0{salt or ''}".encode()).hexdigest()


def _check_model(model: str, served: str, accepted: set[str]) -> None:
    if model not in accepted:
        raise APIError(404, f"the model {model!r} does not exist on this server; it serves {served!r}", param="model", code="model_not_found")


def open_engine_stream(engine, request: ParsedRequest, compression, default_max_tokens: int, max_prompt_tokens: int | None = None):
    """The engine's stream for ``request``, with the request's compression or ``compression``
    (the server's policy) and ``max_new_tokens`` (the request's, else the room left in the
    context up to ``default_max_tokens``). A rolling prefill reads past the context, so a prompt
    under one is held to ``max_prompt_tokens`` (default: the model's context; the operator's
    ``--max-prompt-tokens`` raises it). Blocking: rendering and tokenizing a long prompt takes a
    while, so callers run it off the event loop."""
    if request.compression is not None:
        compression = as_policy(request.compression)
    max_new = request.max_tokens
    if max_new is None or can_roll(compression):
        tools = request.constraints.get("tools") if request.constraints.get("tool_choice") != "none" else None
        prompt_tokens = engine.count_tokens(request.prompt, chat=False if request.kind == "completion" else None, tools=tools)
        limit = max_prompt_tokens or engine.context_length
        if can_roll(compression) and limit and prompt_tokens > limit:
            raise invalid(
                f"the prompt has {prompt_tokens} tokens; this server reads at most {limit} prompt tokens, rolling prefill or not "
                "(its operator sets --max-prompt-tokens)",
                prompt_param(request.kind),
                "context_length_exceeded",
            )
    if max_new is None:
        context = engine.context_length
        if context and prompt_tokens >= context:  # past the window: the one rule rolls it, leaving room for default_max_tokens
            compression = fit_to_window(compression, prompt_tokens, default_max_tokens, context)
        positions = compression.prompt_positions(prompt_tokens) if compression is not None else prompt_tokens  # fewer under rolling=
        room = (context - positions) if context else default_max_tokens
        if room < 1:
            field = prompt_param(request.kind)
            raise invalid(
                f"the prompt has {prompt_tokens} tokens and fills the model's {context}-token context; shorten it, or read it with a sparse policy "
                "(compression 'default'), which reads a prompt past the window a chunk at a time",
                field,
                "context_length_exceeded",
            )
        max_new = min(room, default_max_tokens)
    return engine.astream(request.prompt, **request.engine_kwargs(max_new, compression))


class InProcess:
    """Where requests run when the engine is in this process (``snapkv-rag serve`` without
    replicas). :mod:`.ray_serve` has the other backend, engines on Ray Serve replicas; both
    give the app an async stream of pieces with a ``result`` at its end."""

    def __init__(self, engine):
        self.engine = engine

    async def open(self, config: ServerConfig, request: ParsedRequest):
        """The request's stream; prompt errors (too long, bad tools) raise here, before a streamed 200."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, open_engine_stream, self.engine, request, config.compression, config.default_max_tokens, config.max_prompt_tokens
        )

    async def health(self) -> dict[str, Any]:
        info = self.engine.info()
        # the compiled decode step: "on" with its graphs, compile seconds and steps, or why it is off
        health = {"context_length": info.context_length, "device": info.device, "replicas": 1, "compiled_decode": info.compiled_decode}
        if info.compiled_decode == "on":
            health["compiled_decode_stats"] = self.engine.compiled_decode.stats()
        return health


async def _finish(stream, clock: PieceClock, drain: Drain):
    """Read ``stream`` to its end; its result. Cancelling this stops the generation."""
    async with stream:
        async for _ in drain.pieces(stream):
            clock.tick()
    return stream.result


class Admission:
    """One completion request's place among the ``max_queue`` the server admits at once."""

    def __init__(self, app):
        self.state = app.state
        self.held = False

    def enter(self) -> bool:
        if self.state.in_flight >= self.state.config.max_queue:
            self.state.metrics.rejected.inc()
            return False
        self.state.in_flight += 1
        self.state.metrics.in_flight.inc()
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.in_flight -= 1
            self.state.metrics.in_flight.dec()


def _served_by(stream, namespace: str | None) -> dict[str, str]:
    """``X-SnapKV-Replica``: the Ray Serve replica that ran the request (none in process), as a
    tag of the request's namespace, so that one tenant learns nothing of where another's ran."""
    replica = getattr(stream, "replica", None)
    return {"X-SnapKV-Replica": replica_tag(replica, namespace)} if replica else {}


def _queue_full(config: ServerConfig) -> JSONResponse:
    error = APIError(
        429,
        f"the server is busy: {config.max_queue} requests are already queued or running; retry shortly",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": "1"},
    )
    return _error_response(error)


def _log(config: ServerConfig, request_id: str, request: ParsedRequest, result) -> None:
    stats = result.stats
    method = stats.compression["method"] if stats.compression else "full"
    log.info(
        "%s %s prompt=%d reused=%d completion=%d finish=%s compression=%s kept=%s ratio=%.1fx prefill=%.2fs decode=%sms/token",
        request_id,
        request.kind,
        result.usage.prompt_tokens,
        stats.reused_prompt_tokens,
        result.usage.completion_tokens,
        result.finish_reason,
        method,
        kept_tokens_text(stats.kept_tokens_per_layer),
        stats.compression_ratio,
        stats.prefill_seconds,
        f"{stats.decode_ms_per_token:.1f}" if stats.decode_ms_per_token is not None else "-",
    )


async def _until_disconnect(request: Request, work) -> Any:
    """Run ``work`` (a coroutine); cancel it (so the engine stops) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


def _completions(kind: str):
    parse = {"chat": parse_chat_request, "completion": parse_completion_request, "responses": parse_responses_request}[kind]
    answer = response_body if kind == "responses" else completion_response

    async def endpoint(request: Request):
        config: ServerConfig = request.app.state.config
        metrics: ServerMetrics = request.app.state.metrics
        clock = PieceClock(metrics, time.perf_counter())
        drain: Drain = request.app.state.drain
        if drain.begun:
            metrics.finished(kind, 503)
            return _error_response(shutting_down())
        try:  # the whole body first: only a request that has arrived takes a place in the queue
            body = await _json_body(request, config.max_request_bytes, config.body_timeout)
        except APIError as exc:
            metrics.finished(kind, exc.status)
            return _error_response(exc)
        admission: Admission | None = Admission(request.app)
        assert admission is not None
        if not admission.enter():
            metrics.finished(kind, 429)
            return _queue_full(config)
        try:
            parsed = parse(body)
            _check_model(parsed.model, config.model_id, config.aliases)
            namespace = cache_namespace(getattr(request.state, "tenant", None), parsed.sampling.pop("cache_salt", None))
            if namespace is not None:
                parsed.sampling["cache_salt"] = namespace
            request_id = new_id(kind)
            try:  # prompt errors (too long, bad tools) are found here, before a streamed 200 is sent
                stream = await config.backend.open(config, parsed)
            except APIError:
                raise
            except Exception as exc:
                raise from_engine_error(exc, kind) from None
            if parsed.stream:
                events = _stream(config, request_id, parsed, stream, clock, drain, admission.release)
                admission = None  # the stream releases it when it ends
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **_served_by(stream, namespace)})
            try:
                result = await _until_disconnect(request, _finish(stream, clock, drain))
            except asyncio.CancelledError:
                log.info("%s cancelled: the client disconnected", request_id)
                metrics.finished(kind, 499)
                return JSONResponse(APIError(499, "the client closed the request").body(), status_code=499)
            except Exception as exc:
                raise from_engine_error(exc, kind) from None
            _log(config, request_id, parsed, result)
            metrics.finished(kind, 200, result)
            return JSONResponse(answer(parsed, request_id, int(time.time()), config.model_id, result), headers=_served_by(stream, namespace))
        except APIError as exc:
            metrics.finished(kind, exc.status)
            return _error_response(exc)
        except Exception as exc:  # a bug, not bad input: one OpenAI-shaped answer with an id, the traceback in the log
            error = from_engine_error(exc, kind)
            metrics.finished(kind, error.status)
            return _error_response(error)
        finally:
            if admission is not None:
                admission.release()

    return endpoint


async def _stream(config: ServerConfig, request_id: str, parsed: ParsedRequest, stream, clock: PieceClock, drain: Drain, release):
    metrics = clock.metrics
    writer = (ResponseEventWriter if parsed.kind == "responses" else ChunkWriter)(parsed, request_id, config.model_id)
    try:
        opening = writer.opening()
        if opening:
            yield opening
        finished = False
        try:
            async with stream:
                async for piece in drain.pieces(stream):
                    clock.tick()
                    yield writer.piece(piece)
            finished = True
        except Exception as exc:  # after the 200: the error travels as an event, then the stream ends
            finished = True
            metrics.finished(parsed.kind, 200)
            yield writer.error(from_engine_error(exc, parsed.kind))
            return
        finally:
            if not finished:
                log.info("%s stream ended early (client gone)", request_id)
                metrics.finished(parsed.kind, 499)
        _log(config, request_id, parsed, stream.result)
        metrics.finished(parsed.kind, 200, stream.result)
        for chunk in writer.closing(stream.result):
            yield chunk
    finally:
        release()


async def embeddings(request: Request):
    config: ServerConfig = request.app.state.config
    admission = Admission(request.app)  # embeddings run on the engine's thread: they queue like completions
    try:
        if request.app.state.drain.begun:
            raise shutting_down()
        if config.embedder is None:
            raise APIError(404, "this server serves no embeddings (started with --embedder none)", code="model_not_found")
        body = await _json_body(request, config.max_request_bytes, config.body_timeout)
        if not admission.enter():
            request.app.state.metrics.finished("embeddings", 429)
            return _queue_full(config)
        model, texts, encoding = parse_embedding_request(body)
        _check_model(model, config.embedder_id, {config.embedder_id})
        embedder = config.embedder

        def work() -> bytes:
            limit = embedder.max_tokens
            counts = embedder.token_counts(texts)
            for i, n in enumerate(counts):
                if n > limit:
                    raise invalid(
                        f"input[{i}] has {n} tokens; the embedder reads at most {limit}, so it would be cut: split it first", "input", "input_too_long"
                    )
            # the body is written here too: off the event loop, which would otherwise stall every client meanwhile
            return json_bytes(embedding_response(model, embedder.embed_array(texts), encoding, sum(counts)))

        body_bytes = await asyncio.get_running_loop().run_in_executor(request.app.state.embedding_jobs, work)
        request.app.state.metrics.finished("embeddings", 200)
        return Response(body_bytes, media_type="application/json")
    except APIError as exc:
        request.app.state.metrics.finished("embeddings", exc.status)
        return _error_response(exc)
    except Exception as exc:  # a bug: logged with the id the answer carries
        error = from_engine_error(exc)
        request.app.state.metrics.finished("embeddings", error.status)
        return _error_response(error)
    finally:
        admission.release()


def _model_card(config: ServerConfig, model: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model, "object": "model", "created": config.started, "owned_by": "snapkv-rag"}
    if model == config.model_id:
        card["snapkv"] = {
            "invariant": config.invariant,
            "compression": config.compression_spec,
        }  # greedy output independent of reuse and batching (snapkv_rag.engine.invariant)
    return card


def _served(config: ServerConfig) -> list[str]:
    return [config.model_id] + ([config.embedder_id] if config.embedder is not None else [])


async def models(request: Request):
    config: ServerConfig = request.app.state.config
    return JSONResponse({"object": "list", "data": [_model_card(config, m) for m in _served(config)]})


async def model(request: Request):
    config: ServerConfig = request.app.state.config
    name = request.path_params["name"]
    try:
        if name not in _served(config) and name not in config.aliases:  # "default" names the model too
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves {_served(config)}", param="model", code="model_not_found")
    except APIError as exc:
        return _error_response(exc)
    return JSONResponse(_model_card(config, name))


async def prometheus_metrics(request: Request):
    body, content_type = request.app.state.metrics.exposition()
    return Response(body, media_type=content_type)


async def health(request: Request):
    config: ServerConfig = request.app.state.config
    serving = await config.backend.health()
    status = "shutting_down" if request.app.state.drain.begun else "ok" if serving["replicas"] else "unavailable"
    body = {"status": status, "model": config.model_id, "compression": config.compression_spec, **serving}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def not_found(request: Request, exc: Exception):
    return _error_response(
        APIError(
            404,
            f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings",
            code="not_found",
        )
    )


async def method_not_allowed(request: Request, exc: Exception):
    return _error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"))


def create_app(config: ServerConfig) -> Starlette:
    middleware = []  # outermost first: CORS answers preflights before the key is checked
    if config.allow_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allow_origins), allow_methods=["GET", "POST"], allow_headers=["*"]))
    if config.api_keys:
        middleware.append(Middleware(APIKeyMiddleware, api_keys=config.api_keys, public_metrics=config.public_metrics))
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _completions("chat"), methods=["POST"]),
            Route("/v1/completions", _completions("completion"), methods=["POST"]),
            Route("/v1/responses", _completions("responses"), methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus_metrics, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed},
        middleware=middleware,
    )
    app.state.config = config
    app.state.metrics = ServerMetrics(config.engine)  # without an engine here (Ray Serve), request metrics only
    app.state.drain = Drain(config.shutdown_grace)  # begun by DrainingServer at Ctrl+C or SIGTERM
    app.state.in_flight = 0  # completion requests admitted and not finished (the event loop's own count)
    app.state.embedding_jobs = ThreadPoolExecutor(EMBEDDING_THREADS, thread_name_prefix="snapkv-rag-embeddings")
    return app
