"""HTTP only: headers and JSON in, service call, JSON or SSE out. ``create_app(settings)`` builds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawrl.config import ConfigError, Settings, read_api_keys
from clawrl.engine.types import Engine
from clawrl.gateway.deps import NamespaceDep, ServiceDep, parse_chat_request, turn_context_from_headers
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.schemas import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from clawrl.gateway.service import ChatService, GatewayError, GatewayOptions
from clawrl.gateway.sessions import SessionTracker
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
    from clawrl.train.trainer import latest_checkpoint

    version = "0"
    latest = latest_checkpoint(settings.storage.data_root / "checkpoints")
    if latest is not None and (latest[1] / "model.safetensors").is_file():
        model_dir, version = latest[1], str(latest[0])
    device, _ = resolve_device(settings.model.device)
    engine = EmbeddedEngine(model_dir, dtype=settings.model.dtype, device=device,
                            max_batch_size=settings.engine.max_batch_size,
                            max_context_len=settings.engine.max_context_len, weight_version=version,
                            served_model_name=settings.server.served_model_name)
    return engine, engine.tokenizer, True


def create_app(settings: Settings, *, engine: Engine | None = None, tokenizer: Any = None, store: Any = None) -> FastAPI:
    """The gateway app. Pass ``engine``/``tokenizer``/``store`` to share ones you own (tests, `clawrl up`)."""
    api_keys = read_api_keys(settings.server.api_keys_env)
    if not api_keys and not settings.server.open_mode:
        raise ConfigError(f"no API keys in env {settings.server.api_keys_env} and server.open_mode is false: "
                          "set keys, or server.open_mode = true to serve without authentication")
    metrics = GatewayMetrics()
    generate_hook = load_hook("generate", settings.hooks.generate)  # loaded once, at app creation
    owned_engine = engine is None
    if engine is None:
        engine, tokenizer, _ = build_engine(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal engine, tokenizer, store
        owned_store = False
        if tokenizer is None:
            tokenizer = engine.tokenizer  # type: ignore[attr-defined]
        if store is None:
            from storage.writer import DataStore

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
        app.state.api_keys = api_keys
        if not api_keys:
            log.warning("OPEN MODE: serving without API keys (server.open_mode = true); every caller "
                        "shares the 'open' session namespace")
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

    app = FastAPI(title="clawrl gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.api_keys = api_keys
    if hasattr(engine, "update_weights_from_disk") and not hasattr(engine, "sync_weights_from_disk"):
        # An in-process engine's SGLang control API (pause, update_weights_from_disk, model_info...)
        # under /engine, so a trainer in another process can sync it exactly as it would sync SGLang.
        # Guarded by the first API key (none in open mode).
        from clawrl.engine.server import create_engine_app

        app.mount("/engine", create_engine_app(
            engine, model_path=settings.model.name,
            served_model_name=settings.server.served_model_name, max_context_len=settings.engine.max_context_len,
            api_key=api_keys[0] if api_keys else None))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.server.max_body_bytes)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

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

    # The hot path skips FastAPI's dependency solver and parses the body with pydantic-core's JSON
    # validator directly: together that is most of the gateway's own latency budget (~1 ms).
    @app.post("/v1/chat/completions", response_model=ChatCompletion, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema()}}}})
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        service: ChatService = request.app.state.service
        ctx = turn_context_from_headers(request.headers, request.app.state.api_keys)
        body = parse_chat_request(await request.body())
        metrics.in_flight.inc()
        try:
            if body.stream:
                headers, events = await service.stream(body, ctx)
                return StreamingResponse(_counted(events, metrics), media_type="text/event-stream",
                                         headers={**headers, "Cache-Control": "no-cache"})
            try:
                resp = await service.complete(body, ctx)
            except GatewayError as e:
                turn_type = body.turn_type or ctx.turn_type or settings.server.default_turn_type
                metrics.requests.labels(str(e.status), "false", turn_type).inc()
                raise
            metrics.requests.labels("200", "false", resp.turn_type).inc()
            metrics.latency.labels("false").observe(time.perf_counter() - t0)
            return Response(resp.model_dump_json(), media_type="application/json", headers={
                "X-Session-Id": resp.session_id, "X-Turn-Type": resp.turn_type,
                "X-Turn-Index": str(resp.turn_index), "X-Weight-Version": resp.weight_version})
        finally:
            if not body.stream:
                metrics.in_flight.dec()

    @app.get("/v1/models")
    async def list_models(_: NamespaceDep, service: ServiceDep) -> ModelList:
        name = settings.server.served_model_name
        with contextlib.suppress(Exception):  # the live version (a sync may have happened since the last turn)
            service.weight_version = str((await service.engine.model_info()).get("weight_version"))
        return ModelList(data=[ModelCard(id=name, created=int(time.time()), root=name,
                                         max_model_len=settings.engine.max_context_len,
                                         weight_version=service.weight_version)])

    @app.get("/healthz")
    async def healthz(service: ServiceDep):
        try:
            ok = await asyncio.wait_for(service.engine.health(), timeout=5.0)
        except Exception:
            ok = False
        body = {"status": "ok" if ok else "engine_unhealthy", "weight_version": service.weight_version,
                "open_sessions": len(service.tracker), "pending_turns": service.tracker.pending_turns}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


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
    """Rebuild open sessions from the log after a restart (their last main turn still waits)."""
    try:
        from storage.catalog import open_sessions
    except ImportError:  # pragma: no cover - storage without the helper query
        return 0
    if hasattr(store, "flush"):
        store.flush()
    n = 0
    for row in open_sessions(settings.storage.data_root, settings.server.session_idle_timeout_s):
        tracker.restore(row["namespace"], row["session_id"], row["next_index"], row["pending"], row["age_s"])
        n += 1
    return n
