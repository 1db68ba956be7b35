"""Serve any in-process :class:`~clawrl.engine.types.Engine` over SGLang's native HTTP contract.

Paths, bodies, status codes and error shapes follow SGLang 0.5.23, so
:class:`~clawrl.engine.sglang_client.SGLangClient` cannot tell this server from a real SGLang
server in the parts clawrl uses. This module is HTTP only: JSON or SSE in, one engine call, JSON or
SSE out. Pausing, draining and weight swaps are the engine's job.

Where we knowingly differ from SGLang:
  * ``/health_generate`` answers 503 at once while generation is paused. SGLang holds the probe
    request behind the pause, answers 503 only after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) and then
    marks itself unhealthy until a later probe succeeds.
  * ``/health`` asks the engine (``Engine.health``) and does not generate; SGLang's ``/health`` runs
    the same 1-token probe as ``/health_generate`` unless that is switched off by environment.
  * A batch ``/generate`` (list of prompts) is fanned out concurrently; streaming a batch is refused
    with 400 (SGLang interleaves the streams with an ``index`` field).
  * ``/update_weights_from_disk`` ignores ``flush_cache``: the engine flushes its own cache on every
    successful swap. ``load_format``, ``recapture_cuda_graph`` & co. are accepted and ignored.
  * ``/release_memory_occupation`` / ``/resume_memory_occupation`` answer ``null`` and do nothing.
  * ``/v1/loads`` reports only ``num_running_reqs`` / ``num_waiting_reqs`` per load entry (no KV
    token usage or throughput); ``/server_info`` is a subset of SGLang's server args.
  * ``/abort_request``, ``/update_weight_version`` and ``/load_lora_adapter`` + ``/unload_lora_adapter``
    exist only when the engine has methods of those names (EmbeddedEngine has them all; with another
    engine they answer 404).
  * LoRA: ``lora_path`` names an adapter registered by ``/load_lora_adapter`` (never a directory, which
    SGLang also takes there); ``pinned`` is accepted and ignored (an adapter in use always stays in
    memory); the engine's own routes are SGLang's native ones, so ``model="<base>:<adapter>"`` (SGLang's
    OpenAI routes) has no route here: the gateway in front serves the OpenAI APIs.
  * ``top_logprobs_num`` above 20 (``types.MAX_TOP_LOGPROBS``) is refused, in process too; SGLang has no cap.
  * A route body that fails validation (a string where ``/detokenize`` wants token ids, say) answers
    400 ``{"error": {"message": "tokens.2: Input should be a valid integer, ..."}}``, the shape of
    every other 400 here; SGLang answers its ``ErrorResponse`` with pydantic's error list as text.
  * ``token_ids_logprob`` is scored at prompt positions only (``input_token_ids_logprobs``): a request
    with it must be prefill-only (``max_new_tokens = 0``), else 400.

As in SGLang, a client that disconnects gets its request aborted: streams are closed when the
connection drops, and a non-streaming call notices within ``routes.DISCONNECT_POLL_S`` (0.5 s).
The routes live in clawrl/engine/routes.py, their bodies in clawrl/engine/schemas.py; this
module wires them into an app and serves it.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from clawrl.engine.routes import (
    BodyError,
    ClientGone,
    Served,
    abort_router,
    json_response,
    lora_router,
    relabel_router,
    router,
)
from clawrl.engine.schemas import document_generate_body
from clawrl.engine.types import BadRequestError, Engine, EngineError, EngineOverloadedError
from clawrl.ports import SERVER_KEEPALIVE_S

__all__ = ["create_engine_app", "serve_engine"]

log = logging.getLogger(__name__)


class _ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but the health probes, as SGLang's --api-key.

    Plain ASGI (not BaseHTTPMiddleware) so SSE streams and client disconnects pass through untouched.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(("/health", "/metrics")):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):  # constant time: no key-guessing by timing
            return await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def value_error(message: str, status_code: int = 400) -> Response:
    """SGLang's shape for a ValueError inside /generate and most control routes."""
    return json_response({"error": {"message": message}}, status_code)


async def _on_invalid_body(request: Request, exc: Exception) -> Response:
    """A route body that fails validation, or is not JSON: status 400 (FastAPI's would be 422) in the
    shape of every other 400 here, each error as ``field.path: what is wrong``."""
    if isinstance(exc, RequestValidationError):
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                            for e in exc.errors())
    else:
        message = str(exc)
    return value_error(message)


async def _on_client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def _on_bad_request(request: Request, exc: BadRequestError) -> Response:
    return value_error(str(exc))


async def _on_engine_error(request: Request, exc: EngineError) -> Response:
    if isinstance(exc, EngineOverloadedError):  # SGLang: 503 when its queue is full
        return value_error(str(exc), 503)
    log.error("engine error on %s: %s", request.url.path, exc)
    return value_error(str(exc), 500)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    return value_error(f"internal error: {exc!r}", 500)


EXCEPTION_HANDLERS = {RequestValidationError: _on_invalid_body, BodyError: _on_invalid_body,
                      ClientGone: _on_client_gone, BadRequestError: _on_bad_request,
                      EngineError: _on_engine_error, Exception: _on_unexpected}


def create_engine_app(engine: Engine, *, model_path: str, served_model_name: str, max_context_len: int,
                      max_running_requests: int | None = None, api_key: str | None = None) -> FastAPI:
    """An ASGI app exposing ``engine`` over SGLang's native routes (module docstring lists them).

    The caller owns the engine's lifetime (``start``/``close``); the app only forwards calls. The
    engine's ``tokenizer`` attribute, when present, serves /tokenize, /detokenize and the texts of
    ``return_text_in_logprobs``; ``abort_request`` and ``update_weight_version`` routes exist only
    when the engine has methods of those names.
    """
    app = FastAPI(title="clawrl engine (SGLang-compatible)", docs_url=None, redoc_url=None,
                  exception_handlers=EXCEPTION_HANDLERS)
    # the engine decodes on its worker thread: this server's routes use their own tokenizer copy
    app.state.served = Served(engine, model_path, served_model_name, max_context_len, max_running_requests,
                              copy.deepcopy(getattr(engine, "tokenizer", None)))
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.include_router(router)
    if hasattr(engine, "update_weight_version"):
        app.include_router(relabel_router)
    if hasattr(engine, "abort_request"):
        app.include_router(abort_router)
    if hasattr(engine, "load_lora_adapter"):
        app.include_router(lora_router)
    # /openapi.json documents the body /generate reads by hand (the schema fuzz tests generate from it)
    document_generate_body(app)
    return app


def serve_engine(engine: Engine, host: str, port: int, *, log_level: str = "info", **app_kw: Any) -> None:
    """Blocking: start ``engine``, serve it on ``host:port`` with uvicorn until interrupted, then
    close it (``clawrl engine`` calls this). ``app_kw`` go to :func:`create_engine_app`."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_engine_app(engine, **app_kw), host=host, port=port,
                                           log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=SERVER_KEEPALIVE_S))

    async def run() -> None:
        start = getattr(engine, "start", None)
        if start is not None:
            await start()
        try:
            await server.serve()
        finally:
            await engine.close()

    asyncio.run(run())
