"""HTTP only: headers and JSON in, service call, JSON or SSE out. ``create_app(settings)`` builds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawrl.config import ConfigError, Settings, read_api_keys
from clawrl.engine.canary import CanaryRouter
from clawrl.engine.types import Engine
from clawrl.gateway import admin, completions, responses
from clawrl.gateway.deps import (SESSION_HEADERS, AdminGuard, ApiKeyGuard, NamespaceDep, ServiceDep, document_api_key,
                                 turn_context)
from clawrl.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    SessionLog,
    SessionTurn,
)
from clawrl.gateway.errors import GatewayError, field_error
from clawrl.gateway.http import ERROR_RESPONSES, SSE_EVENT_SCHEMA, JSONBodyRequest, JSONBodyRoute, serve_turn
from clawrl.gateway.lora import check_serves_adapters, serve_adapters
from clawrl.gateway.service import ChatService
from clawrl.gateway.sessions import validate_session_id
from clawrl.hooks import load_hook

log = logging.getLogger("clawrl.gateway")


# Larger request bodies get 413 before they are read: an agent's request with its whole context and tools
# is tens of KB (Codex CLI ~40 KB, OpenClaw ~50 KB); 4 MiB leaves room for long conversations.
MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimitMiddleware:
    """413 for bodies over the limit: on Content-Length before a byte is read, and on the bytes
    actually received (an HTTPException from ``receive``, which FastAPI's body reading passes on to
    the app's handler)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds {self.max_bytes} bytes"
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await GatewayError(413, too_large).response()(scope, receive, send)
        received = 0

        async def guarded_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, too_large)
            return msg

        await self.app(scope, guarded_receive, send)


v1 = APIRouter(prefix="/v1", route_class=JSONBodyRoute, strict_content_type=False)  # no Content-Type: JSON
ops = APIRouter()


@v1.post("/chat/completions", response_model=ChatCompletion, openapi_extra={"parameters": SESSION_HEADERS}, responses={
    **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                             "description": "The completion; an SSE stream when stream = true."}})
async def chat_completions(body: ChatCompletionRequest, request: JSONBodyRequest) -> Response:
    """A completion, recorded in the session log before the client gets the end of it (the JSON
    body, or a stream's last chunk)."""
    return await serve_turn(request, body, turn_context(request))


@v1.get("/models", responses={401: ERROR_RESPONSES[401]})
async def list_models(_: NamespaceDep, service: ServiceDep) -> ModelList:
    name = service.settings.server.served_model_name
    return ModelList(data=[ModelCard(id=name, created=int(time.time()), root=name,
                                     max_model_len=getattr(service.engine, "max_context_len", None),
                                     weight_version=await service.live_weight_version())])


@v1.get("/sessions/{session_id}", responses={400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401], 404: {
    "model": ErrorResponse, "description": "No session of that id under the caller's key."}})
async def read_session(session_id: str, namespace: NamespaceDep, service: ServiceDep) -> SessionLog:
    """The caller's own session as logged: its turns with index, type, text, weight version and
    whether the next state arrived. Another key's session answers exactly as a missing one."""
    from clawrl.storage.queries import session_log

    try:
        validate_session_id(session_id)
    except ValueError as e:
        raise GatewayError(400, str(e), param="session_id") from None
    rows = await asyncio.to_thread(service.read, session_log, namespace, session_id)
    if not rows:
        raise GatewayError(404, "no such session", "not_found_error", "session_id")
    return SessionLog(id=session_id, open=service.tracker.is_open(namespace, session_id), turns=[
        SessionTurn(**{**r, "created_at": r["created_at"].isoformat()}) for r in rows])


@ops.get("/healthz")
async def healthz(service: ServiceDep) -> JSONResponse:
    try:
        ok = await asyncio.wait_for(service.engine.health(), timeout=5.0)
    except Exception:
        ok = False
    if service.storage_error is not None:  # the last append failed: is the data root writable again?
        from clawrl.storage.writer import DataRootError, check_data_root

        try:
            check_data_root(service.settings.storage.data_root)
            service.storage_error = None
        except DataRootError as e:
            log.error("health: %s", e)
    if ok:  # the version served now: a sync through /engine may have happened since the last turn
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.live_weight_version(), timeout=5.0)
    status = "ok" if ok else "engine_unhealthy"
    if service.storage_error is not None:
        status = "storage_unwritable"
    body = {"status": status, "weight_version": service.weight_version,
            "open_sessions": len(service.tracker), "pending_turns": service.tracker.pending_turns,
            "paused": service.paused, "storage_error": service.storage_error}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@ops.get("/metrics", response_class=PlainTextResponse)  # Prometheus text format
async def prometheus_metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# FastAPI validates a parsed body in Python mode, whose messages name Python's types: a JSON client
# is told JSON's names instead (what pydantic says when it validates JSON text).
_JSON_TYPE_MESSAGES = {"list_type": "Input should be a valid array", "dict_type": "Input should be an object",
                       "model_attributes_type": "Input should be an object"}


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first field at fault (``param``) and how many more there are."""
    request.app.state.service.metrics.requests.labels("400", "unknown", "unknown").inc()
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(p) for p in first.get("loc", ())[1:])  # after "body" (or "header", "path"...)
    if first.get("type") == "json_invalid":
        return GatewayError(400, f"request body is not valid JSON: {first['ctx']['error']}").response()
    if first.get("type") == "missing" and not loc:  # FastAPI reads an empty body as none
        return GatewayError(400, "request body is not valid JSON: it is empty").response()
    msg = _JSON_TYPE_MESSAGES.get(first.get("type"), first.get("msg", "invalid request"))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    if not loc:  # the body itself (not an object)
        return GatewayError(400, f"request body: {msg}{more}", code="invalid_type").response()
    err = field_error(loc, first.get("type", ""), msg)
    err.message += more
    return err.response()


async def _error(request: Request, exc: Exception) -> JSONResponse:
    """Every other error in the OpenAI shape: a GatewayError as raised, Starlette's HTTP errors
    (404, 405, the body limit's 413) with their status, anything else a 500 (logged)."""
    if isinstance(exc, StarletteHTTPException):
        exc = GatewayError(exc.status_code, str(exc.detail), headers=exc.headers)
    elif not isinstance(exc, GatewayError):
        log.exception("unhandled error")
        exc = GatewayError(500, f"internal error: {type(exc).__name__}", "server_error")
    return exc.response()


def build_engine(settings: Settings) -> tuple[Engine, Any]:
    """(engine, tokenizer) for the engine named in [engine]. An embedded engine starts from the
    checkpoint :func:`_checkpoint_to_serve` names when training already ran (a restart serves the
    gate's champion again), else from the base model at version 0."""
    from clawrl.models import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)
    if settings.engine.kind == "http":  # one engine, or several behind SGLang's router
        from clawrl.engine.router import RoutedEngines

        return RoutedEngines(settings.engine.url, timeout_s=settings.engine.stall_timeout_s), load_tokenizer(model_dir)
    from clawrl.models import resolve_device, resolve_dtype
    from clawrl.engine.embedded import ENGINE_KEYS, EmbeddedEngine

    version = "0"
    intact = _checkpoint_to_serve(settings)
    if intact is not None:
        model_dir, version = intact[1], str(intact[0])
    device, _ = resolve_device(settings.model.device)
    engine = EmbeddedEngine(model_dir, dtype=resolve_dtype(settings.model.dtype, device), device=device,
                            weight_version=version, served_model_name=settings.server.served_model_name,
                            **settings.engine.model_dump(include=ENGINE_KEYS))
    return engine, engine.tokenizer


def canary_engine(settings: Settings) -> Engine | None:
    """The engine at ``[gate] canary_url`` when ``[gate] canary_share`` sends sessions to one; ConfigError
    when it names none (`clawrl up` starts one; `clawrl demo` passes its own in-process engine)."""
    g = settings.gate
    if not g.canary:
        return None
    if not g.canary_url:
        raise ConfigError(f"[gate] canary_share = {g.canary_share} needs [gate] canary_url: the engine the train "
                          "flow loads each new version into (`clawrl engine`; `clawrl up` starts one on "
                          "canary_port)")
    from clawrl.engine.sglang_client import SGLangClient

    return SGLangClient(g.canary_url, timeout_s=settings.engine.stall_timeout_s)


def _checkpoint_to_serve(settings: Settings):
    """With the promotion gate on, the champion (the newest intact one on the gate's line); without
    it, the newest intact checkpoint. None: the initial weights."""
    from clawrl.checkpoint import intact_champion, newest_intact_checkpoint

    checkpoints = settings.storage.data_root / "checkpoints"
    if not settings.gate.enabled:
        return newest_intact_checkpoint(checkpoints)
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import champion_stack

    with open_catalog(settings.storage.data_root, private=True) as con:
        return intact_champion(checkpoints, champion_stack(con))


def create_app(settings: Settings, *, engine: Engine | None = None, tokenizer: Any = None, store: Any = None,
               api_keys: list[str] | None = None, own: bool = False) -> FastAPI:
    """The gateway app. Pass ``engine``/``tokenizer``/``store`` to share ones you own (tests, `clawrl up`),
    ``api_keys`` to require those instead of the environment's (``[]`` with ``[server] open_mode``: none,
    for a gateway on loopback whose clients carry no key of the user's: ``clawrl.serving.serve_own_gateway``).
    ``own``: such a gateway, whose keys and admin routes are its process's business: no warnings about them."""
    api_keys = read_api_keys(settings.server.api_keys_env) if api_keys is None else api_keys
    if not api_keys and not settings.server.open_mode:
        raise ConfigError(f"no API keys in env {settings.server.api_keys_env} and server.open_mode is false: "
                          "set keys, or server.open_mode = true to serve without authentication")
    app = FastAPI(title="clawrl gateway", lifespan=_lifespan, docs_url="/docs", redoc_url=None, exception_handlers={
        GatewayError: _error, RequestValidationError: _validation_error, StarletteHTTPException: _error,
        Exception: _error})
    state = app.state
    state.settings, state.api_keys, state.admin_keys = settings, api_keys, read_api_keys(settings.server.admin_keys_env)
    state.generate_hook = load_hook("generate", settings.hooks.generate)  # loaded once, at app creation
    if store is None:  # refuse a data root we cannot write before loading a model (DataRootError)
        from clawrl.storage.writer import check_data_root

        check_data_root(settings.storage.data_root)
    state.store, state.owned_engine, state.own = store, engine is None, own
    if engine is None:
        canary = canary_engine(settings)  # a config error before any model loads
        engine, tokenizer = build_engine(settings)
        if canary is not None:
            engine = CanaryRouter(engine, canary, settings.gate.canary_share)
    state.engine, state.tokenizer = engine, tokenizer
    if settings.ppo.adapters == "namespace":
        check_serves_adapters(engine)
    served = engine.main if isinstance(engine, CanaryRouter) else engine  # what a weight sync updates
    if hasattr(served, "update_weights_from_disk") and not hasattr(served, "sync_weights_from_disk"):
        # An in-process engine's SGLang control API (pause, update_weights_from_disk, model_info...)
        # under /engine, so a trainer in another process can sync it exactly as it would sync SGLang.
        # Admin only (deps.check_admin_key): its /generate bypasses the session log and its control
        # routes replace the served weights. /engine/health stays open (liveness, no data).
        from clawrl.engine.server import create_engine_app

        app.mount("/engine", AdminGuard(create_engine_app(
            served, model_path=settings.model.name, served_model_name=settings.server.served_model_name,
            max_context_len=getattr(served, "max_context_len", None) or settings.engine.max_context_len),
            admin_keys=state.admin_keys, api_keys=api_keys))
    for router in (v1, responses.router, completions.router, ops, admin.router):
        app.include_router(router)
    app.add_middleware(ApiKeyGuard, api_keys=api_keys)
    if api_keys:
        document_api_key(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    return app


def _warn_about_keys(state, admin_keys_env: str) -> None:
    """What a gateway's keys leave open or shut, said once at start."""
    if not state.api_keys:
        log.warning("OPEN MODE: serving without API keys (server.open_mode = true); every caller "
                    "shares the 'open' session namespace")
    if not state.api_keys and not state.admin_keys:
        log.warning("OPEN ADMIN: no admin keys in env %s either: anyone who reaches this port can "
                    "pause, replay and replace the served weights (/admin, /engine)", admin_keys_env)
    elif not state.admin_keys:
        log.warning("no admin keys in env %s: /admin and /engine (weight sync) refuse every caller", admin_keys_env)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """The service over the app's engine and store (a store of its own if none was given), the
    sessions of the log restored, and the idle-session sweeper."""
    state, settings = app.state, app.state.settings
    store, engine = state.store, state.engine
    if state.store is None:
        from clawrl.storage.writer import DataStore

        store = DataStore(settings.storage.data_root)
    if hasattr(engine, "start"):
        await engine.start()
    if hasattr(engine, "learn_context_len"):  # an HTTP engine: refuse what cannot fit before streaming
        await engine.learn_context_len()
    tokenizer = engine.tokenizer if state.tokenizer is None else state.tokenizer
    state.service = service = ChatService(engine, tokenizer, store, settings, state.generate_hook)
    if settings.ppo.adapters == "namespace":  # each namespace served its own LoRA adapter
        serve_adapters(service, settings.storage.data_root / "checkpoints")
    restored = service.restore_sessions()
    await service.live_weight_version()
    if not state.own:  # the process's own clients on loopback (create_app) need no word about keys
        _warn_about_keys(state, settings.server.admin_keys_env)
    if restored:
        log.info("restored %d open sessions from the session log", restored)
    sweeper = asyncio.create_task(service.sweep_forever())
    try:
        yield
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if state.store is None:
            store.close()
        if state.owned_engine:
            await engine.close()
