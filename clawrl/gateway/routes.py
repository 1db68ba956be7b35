"""HTTP only: headers and JSON in, service call, JSON or SSE out. ``create_app(settings)`` builds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from clawrl.config import ConfigError, Settings, read_api_keys
from clawrl.engine.server import document_request_models
from clawrl.engine.types import Engine
from clawrl.gateway.admin import build_admin_router, paused_error
from clawrl.gateway.deps import AdminGuard, NamespaceDep, ServiceDep, parse_chat_request, turn_context_from_headers
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    SessionLog,
    SessionTurn,
)
from clawrl.gateway.service import ChatService, GatewayError, GatewayOptions
from clawrl.gateway.sessions import SESSION_ID_RE, SessionTracker, validate_session_id
from clawrl.hooks import load_hook

log = logging.getLogger("clawrl.gateway")


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status, headers=headers)


class BodyLimitMiddleware:
    """413 for bodies over the limit, checked on Content-Length and on the bytes actually received."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._reject(send)
        received = 0

        async def guarded_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, guarded_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        resp = error_response(413, f"request body exceeds {self.max_bytes} bytes", "invalid_request_error")
        await send({"type": "http.response.start", "status": 413, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


class _TooLarge(Exception):
    pass


class ChatFastPath:
    """``POST /v1/chat/completions`` straight to its handler, as an ASGI app of its own that
    :class:`GatewayApp` calls before FastAPI's middleware stack, router and dependency solver
    (Starlette's error middleware, FastAPI's telemetry middleware - which reads environment
    variables on every request - and the route lookup). Errors become the same OpenAI-style
    bodies the app's exception handlers give; :class:`BodyLimitMiddleware` wraps it."""

    PATH = "/v1/chat/completions"

    def __init__(self, handler):
        self.handler = handler  # async (scope, receive) -> response

    async def __call__(self, scope, receive, send):
        try:
            response = await self.handler(scope, receive)
        except _TooLarge:
            raise
        except ClientDisconnect:  # the client left before its request was read: nobody to answer
            return
        except GatewayError as e:
            response = error_response(e.status, e.message, e.type, e.param, headers=e.headers)
        except Exception as e:
            log.exception("unhandled error")
            response = error_response(500, f"internal error: {type(e).__name__}", "server_error")
        await response(scope, receive, send)


async def read_body(receive) -> bytes:
    """The whole request body from ASGI ``receive`` (Starlette's ``Request.body`` without its
    stream wrapper; ``ClientDisconnect`` if the client leaves first)."""
    msg = await receive()
    if msg["type"] == "http.request" and not msg.get("more_body"):
        return msg.get("body", b"")
    chunks = []
    while True:
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)
        msg = await receive()


class GatewayApp(FastAPI):
    """The gateway's FastAPI app; chat completions (the hot path) skip FastAPI's stack through
    ``chat`` (a :class:`ChatFastPath` inside a body limit), everything else takes the usual way."""

    chat: Any = None

    async def __call__(self, scope, receive, send):
        if (self.chat is not None and scope["type"] == "http" and scope["path"] == ChatFastPath.PATH
                and scope["method"] == "POST"):
            scope["app"] = self  # what Starlette would set: the handler reads app.state through it
            await self.chat(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def server_timing(total_s: float, engine_s: float) -> bytes:
    """The ``Server-Timing`` header of a chat completion (W3C Server Timing, milliseconds): ``engine``
    = the engine call (its round trip over HTTP with an http engine), ``gateway`` = the rest of the
    request's time in the handler - body parse, template, session bookkeeping, waiting for the
    session's previous main turn, the turn record and its write-ahead-log write, the response body.
    Not in it: the time before the handler runs (the HTTP parse, the event loop's queue) and the
    response's way back, which a client measures as the rest of its latency."""
    return b"gateway;dur=%.3f, engine;dur=%.3f" % (1000.0 * (total_s - engine_s), 1000.0 * engine_s)


class RawResponse:
    """A finished body and its raw ASGI headers, sent as they are (Starlette's Response rebuilds
    the header list on every request)."""

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: list[tuple[bytes, bytes]]):
        self.body, self.headers = body, headers

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


# The chat route reads its body by hand (the fast path below), so FastAPI cannot derive its OpenAPI
# entry: it is declared here - the body, the session headers and every error status - and the
# document is what schemathesis fuzzes the gateway from (tests/reliability/test_schema_fuzz.py).
CHAT_OPENAPI: dict[str, Any] = {
    "parameters": [
        {"name": "X-Session-Id", "in": "header", "required": False, "description": "Session id (the body's "
         "session_id wins); 1-128 characters from A-Z a-z 0-9 . _ : @ -.",
         "schema": {"type": "string", "pattern": SESSION_ID_RE.pattern}},
        {"name": "X-Turn-Type", "in": "header", "required": False,
         "schema": {"type": "string", "enum": ["main", "side"]}},
        {"name": "X-Session-Done", "in": "header", "required": False,
         "schema": {"type": "string", "enum": ["true", "false", "1", "0", "yes", "no", "on", "off"]}},
    ],
    "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}},
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "Invalid request: the message names the field or header."),
        (401, "Missing or invalid API key."),
        (413, "Request body larger than server.max_body_bytes."),
        (502, "The engine is unreachable or answered something unusable."),
        (504, "The engine did not answer within engine.request_timeout_s."),
        (507, "The turn could not be recorded (disk full or data root unwritable); nothing was recorded."),
    )
}


def build_engine(settings: Settings) -> tuple[Engine, Any, bool]:
    """(engine, tokenizer, owned) for the engine named in [engine]. An embedded engine starts from
    the newest checkpoint under the data root when training already ran (a restart resumes serving
    the version it served), else from the base model at version 0."""
    from clawrl.models import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)
    if settings.engine.kind == "http":
        from clawrl.engine.sglang_client import SGLangClient

        return SGLangClient(settings.engine.url, timeout_s=settings.engine.request_timeout_s), \
            load_tokenizer(model_dir), True
    from clawrl.config import resolve_device
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.checkpoint import newest_intact_checkpoint

    version = "0"
    intact = newest_intact_checkpoint(settings.storage.data_root / "checkpoints")
    if intact is not None:
        model_dir, version = intact[1], str(intact[0])
    device, _ = resolve_device(settings.model.device)
    engine = EmbeddedEngine(model_dir, dtype=settings.model.dtype, device=device,
                            max_batch_size=settings.engine.max_batch_size,
                            max_context_len=settings.engine.max_context_len, weight_version=version,
                            served_model_name=settings.server.served_model_name,
                            worker_cpus=settings.engine.worker_cpus)
    return engine, engine.tokenizer, True


# OpenAPI 3.1: the `schema` of an event stream describes one event (3.2 would call it itemSchema).
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chat.completion.chunk, or [DONE]"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
}


def create_app(settings: Settings, *, engine: Engine | None = None, tokenizer: Any = None, store: Any = None) -> FastAPI:
    """The gateway app. Pass ``engine``/``tokenizer``/``store`` to share ones you own (tests, `clawrl up`)."""
    api_keys = read_api_keys(settings.server.api_keys_env)
    if not api_keys and not settings.server.open_mode:
        raise ConfigError(f"no API keys in env {settings.server.api_keys_env} and server.open_mode is false: "
                          "set keys, or server.open_mode = true to serve without authentication")
    admin_keys = read_api_keys(settings.server.admin_keys_env)
    metrics = GatewayMetrics()
    generate_hook = load_hook("generate", settings.hooks.generate)  # loaded once, at app creation
    owned_engine = engine is None
    if store is None:  # refuse a data root we cannot write before loading a model (DataRootError)
        from clawrl.storage.writer import check_data_root

        check_data_root(settings.storage.data_root)
    if engine is None:
        engine, tokenizer, _ = build_engine(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal engine, tokenizer, store
        owned_store = False
        if tokenizer is None:
            tokenizer = engine.tokenizer  # type: ignore[attr-defined]
        if store is None:
            from clawrl.storage.writer import DataStore

            store, owned_store = DataStore(settings.storage.data_root), True
        if hasattr(engine, "start"):
            await engine.start()  # type: ignore[attr-defined]
        tracker = SessionTracker(idle_timeout_s=settings.server.session_idle_timeout_s,
                                 max_sessions=settings.server.max_sessions)
        restored = _restore_sessions(tracker, settings, store)
        options = GatewayOptions(
            served_model_name=settings.server.served_model_name,
            default_turn_type=settings.server.default_turn_type,
            default_temperature=settings.ppo.temperature,
            default_max_tokens=settings.ppo.max_new_tokens,
            engine_timeout_s=settings.engine.request_timeout_s,
            generate_hook=generate_hook,
        )
        service = ChatService(engine, tokenizer, store, tracker, options, metrics)
        with contextlib.suppress(Exception):
            service.weight_version = str((await engine.model_info()).get("weight_version", "unknown"))
        app.state.service = service
        app.state.api_keys, app.state.admin_keys = api_keys, admin_keys
        if not api_keys:
            log.warning("OPEN MODE: serving without API keys (server.open_mode = true); every caller "
                        "shares the 'open' session namespace")
        if not api_keys and not admin_keys:
            log.warning("OPEN ADMIN: no admin keys in env %s either: anyone who reaches this port can pause, "
                        "replay and replace the served weights (/admin, /engine)", settings.server.admin_keys_env)
        elif not admin_keys:
            log.warning("no admin keys in env %s: /admin and /engine (weight sync) refuse every caller",
                        settings.server.admin_keys_env)
        if restored:
            log.info("restored %d open sessions from the session log", restored)
        sweeper = asyncio.create_task(_sweep_forever(service, settings.server.session_idle_timeout_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            if owned_store:
                store.close()
            if owned_engine:
                await engine.close()

    app = GatewayApp(title="clawrl gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.api_keys, app.state.admin_keys = api_keys, admin_keys
    if hasattr(engine, "update_weights_from_disk") and not hasattr(engine, "sync_weights_from_disk"):
        # An in-process engine's SGLang control API (pause, update_weights_from_disk, model_info...)
        # under /engine, so a trainer in another process can sync it exactly as it would sync SGLang.
        # Admin only (deps.check_admin_key): its /generate bypasses the session log and its control
        # routes replace the served weights. /engine/health stays open (liveness, no data).
        from clawrl.engine.server import create_engine_app

        app.mount("/engine", AdminGuard(create_engine_app(
            engine, model_path=settings.model.name,
            served_model_name=settings.server.served_model_name, max_context_len=settings.engine.max_context_len),
            admin_keys=admin_keys, api_keys=api_keys))
    app.include_router(build_admin_router(settings.storage.data_root))
    app.chat = BodyLimitMiddleware(ChatFastPath(lambda scope, receive: handle_chat(scope, receive)),
                                  settings.server.max_body_bytes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.server.max_body_bytes)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        return error_response(exc.status, exc.message, exc.type, exc.param, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        metrics.requests.labels("400", "unknown", "unknown").inc()
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}",
                                  "invalid_request_error")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return error_response(400, f"{loc}: {msg}{more}" if loc else f"{msg}{more}", "invalid_request_error",
                              loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    async def handle_chat(scope, receive) -> Response | RawResponse:
        t0 = time.perf_counter()
        state = scope["app"].state
        service: ChatService = state.service
        ctx = turn_context_from_headers(scope["headers"], state.api_keys)
        if service.paused:
            metrics.requests.labels("503", "unknown", "unknown").inc()
            raise paused_error()
        body = parse_chat_request(await read_body(receive))
        metrics.in_flight.inc()
        try:
            if body.stream:
                headers, events = await service.stream(body, ctx)
                return StreamingResponse(_counted(events, metrics), media_type="text/event-stream",
                                         headers={**headers, "Cache-Control": "no-cache"})
            timing: dict[str, float] = {}
            try:
                resp = await service.complete(body, ctx, timing)
            except GatewayError as e:
                turn_type = body.turn_type or ctx.turn_type or settings.server.default_turn_type
                metrics.requests.labels(str(e.status), "false", turn_type).inc()
                raise
            metrics.requests.labels("200", "false", resp["turn_type"]).inc()
            payload = orjson.dumps(resp)
            total = time.perf_counter() - t0
            metrics.latency.labels("false").observe(total)
            return RawResponse(payload, [
                (b"content-length", b"%d" % len(payload)), (b"content-type", b"application/json"),
                (b"x-session-id", resp["session_id"].encode()), (b"x-turn-type", resp["turn_type"].encode()),
                (b"x-turn-index", b"%d" % resp["turn_index"]),
                (b"x-weight-version", resp["weight_version"].encode("latin-1")),
                (b"server-timing", server_timing(total, timing["engine_s"]))])
        finally:
            if not body.stream:
                metrics.in_flight.dec()

    # Declared for the OpenAPI document (and reachable if the fast path is ever taken out); the
    # requests themselves go through app.chat (GatewayApp, ChatFastPath), which skips FastAPI's router and dependency
    # solver: with the pydantic-core body parse and the orjson response that is most of the
    # gateway's own per-request CPU (docs/benchmarks.md, gateway overhead).
    @app.post("/v1/chat/completions", response_model=ChatCompletion, openapi_extra=CHAT_OPENAPI,
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                                                 "description": "The completion; an SSE stream when stream = true."}})
    async def chat_completions(request: Request):
        return await handle_chat(request.scope, request.receive)

    @app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def list_models(_: NamespaceDep, service: ServiceDep) -> ModelList:
        name = settings.server.served_model_name
        with contextlib.suppress(Exception):  # the live version (a sync may have happened since the last turn)
            service.weight_version = str((await service.engine.model_info()).get("weight_version"))
        return ModelList(data=[ModelCard(id=name, created=int(time.time()), root=name,
                                         max_model_len=settings.engine.max_context_len,
                                         weight_version=service.weight_version)])

    @app.get("/v1/sessions/{session_id}", responses={400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401], 404: {
        "model": ErrorResponse, "description": "No session of that id under the caller's key."}})
    async def read_session(session_id: str, namespace: NamespaceDep, service: ServiceDep) -> SessionLog:
        """The caller's own session as logged: its turns with index, type, text, weight version and
        whether the next state arrived. Another key's session answers exactly as a missing one."""
        try:
            validate_session_id(session_id)
        except ValueError as e:
            raise GatewayError(400, str(e), param="session_id") from None
        rows = await asyncio.to_thread(_session_log, service.store, settings.storage.data_root, namespace, session_id)
        if not rows:
            raise GatewayError(404, "no such session", "not_found_error", "session_id")
        return SessionLog(id=session_id, open=service.tracker.is_open(namespace, session_id), turns=[
            SessionTurn(**{**r, "created_at": r["created_at"].isoformat()}) for r in rows])

    @app.get("/healthz")
    async def healthz(service: ServiceDep):
        try:
            ok = await asyncio.wait_for(service.engine.health(), timeout=5.0)
        except Exception:
            ok = False
        if service.storage_error is not None:  # the last append failed: is the data root writable again?
            from clawrl.storage.writer import DataRootError, check_data_root

            try:
                check_data_root(settings.storage.data_root)
                service.storage_error = None
            except DataRootError as e:
                log.error("health: %s", e)
        status = "ok" if ok else "engine_unhealthy"
        if service.storage_error is not None:
            status = "storage_unwritable"
        body = {"status": status, "weight_version": service.weight_version,
                "open_sessions": len(service.tracker), "pending_turns": service.tracker.pending_turns,
                "paused": service.paused, "storage_error": service.storage_error}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text format
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    document_request_models(app, ChatCompletionRequest)
    return app


def _session_log(store: Any, data_root, namespace: str, session_id: str) -> list[dict[str, Any]]:
    from clawrl.storage.catalog import open_catalog, session_log

    if hasattr(store, "flush"):
        store.flush()  # read your own writes: turns still in the write-ahead log become Parquet
    con = open_catalog(data_root)
    try:
        return session_log(con, namespace, session_id)
    finally:
        con.close()


async def _counted(events, metrics: GatewayMetrics):
    try:
        async for e in events:
            yield e
    finally:
        metrics.in_flight.dec()


async def _sweep_forever(service: ChatService, idle_timeout_s: float) -> None:
    period = max(0.05, min(5.0, idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await service.sweep_sessions()
        except Exception:  # keep sweeping; a storage hiccup must not kill the loop
            log.exception("session sweep failed")


def _restore_sessions(tracker: SessionTracker, settings: Settings, store: Any) -> int:
    """After a restart, continue the sessions in the log: a session waiting for the user's reply
    comes back with its pending turn (so the reply becomes that turn's next state, and the idle
    sweep closes it if none comes), and every recent session goes on counting turn indices where
    it stopped, so a returning session never reuses one. Returns the sessions restored as open."""
    from clawrl.gateway.sessions import PendingTurn
    from clawrl.storage.catalog import open_catalog, session_states

    if hasattr(store, "flush"):
        store.flush()  # the WAL of a killed predecessor was recovered when the store opened
    con = open_catalog(settings.storage.data_root)
    try:
        rows = session_states(con, 10 * settings.server.max_sessions)  # as many as the tracker remembers
    finally:
        con.close()
    n = 0
    for row in reversed(rows):  # oldest first: the tracker's order is its recency order
        if row["pending_turn_id"] is None:
            tracker.restore_index(row["namespace"], row["session_id"], row["next_index"])
            continue
        pending = PendingTurn(row["pending_turn_id"], row["pending_turn_index"], row["pending_message_count"])
        tracker.restore(row["namespace"], row["session_id"], row["next_index"], pending, row["age_s"])
        n += 1
    return n
