"""What every completion route shares: the JSON body parse, serving one turn (paused check, the
service's prepare and complete or stream, metrics, headers, Server-Timing), the disconnect watch and
the server-sent events. The routes differ only in how they shape a turn's body and its stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pydantic_core
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute

from clawrl.gateway import admin
from clawrl.gateway.errors import GatewayError
from clawrl.gateway.schemas import ChatCompletionRequest, ErrorResponse
from clawrl.gateway.service import ChatService, Turn, TurnContext


class JSONBodyRequest(Request):
    """A request whose JSON body is parsed by pydantic-core's parser instead of the json module: it
    refuses invalid UTF-8 and lone surrogate escapes (which json lets through), and stops at 200
    levels of nesting with a clear error (json would hit Python's recursion limit, a 400 without a
    reason). It also keeps its arrival time, where a completion's Server-Timing starts counting."""

    def __init__(self, scope, receive):
        super().__init__(scope, receive)
        self.arrived = time.perf_counter()

    async def json(self) -> Any:
        try:
            return pydantic_core.from_json(await self.body())
        except ValueError as e:  # FastAPI answers a JSONDecodeError with a json_invalid validation error
            raise json.JSONDecodeError(str(e), "", 0) from None


class JSONBodyRoute(APIRoute):
    """A route whose handler gets a :class:`JSONBodyRequest` (FastAPI's custom request and route class)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def with_json_body(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return with_json_body


def server_timing(total_s: float, engine_s: float) -> str:
    """The ``Server-Timing`` header of a chat completion (W3C Server Timing, milliseconds): ``engine``
    = the engine call (its round trip over HTTP with an http engine), ``gateway`` = the rest of the
    request's time since it was routed - body parse and validation, template, session bookkeeping,
    waiting for the session's previous main turn, the turn record and its write-ahead-log write, the
    response body. Not in it: the time before (the HTTP parse, the event loop's queue) and the
    response's way back, which a client measures as the rest of its latency."""
    return f"gateway;dur={1000.0 * (total_s - engine_s):.3f}, engine;dur={1000.0 * engine_s:.3f}"


DISCONNECT_GRACE_S, DISCONNECT_POLL_S = 1.0, 0.25  # a completion shorter than the grace is never polled


def abort_when_gone(request: Request, service: ChatService, turn: Any):
    """Watch whether the client of a non-streamed completion goes away (polled after a grace
    period, so short completions cost one timer): then the turn is marked (it will not be recorded)
    and its engine request aborted, which the engine ends at its next step or prefill chunk.
    (Streams need no watch: the stream is closed, which aborts it.) Returns the stop function."""
    loop = asyncio.get_running_loop()
    task: asyncio.Task | None = None

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        turn.client_gone = True
        with contextlib.suppress(Exception):
            await service.engine.abort_request(turn.gen.rid)

    def start() -> None:
        nonlocal task
        task = loop.create_task(watch())

    handle = loop.call_later(DISCONNECT_GRACE_S, start)

    def stop() -> None:
        handle.cancel()
        if task is not None:
            task.cancel()

    return stop


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "Invalid request: the message names the field or header."),
        (401, "Missing or invalid API key."),
        (413, "Request body larger than 4 MiB."),
        (502, "The engine is unreachable or answered something unusable."),
        (503, "Paused by an administrator: retry after Retry-After seconds."),
        (504, "The engine sent nothing for [engine] stall_timeout_s."),
        (507, "The turn could not be recorded (disk full or data root unwritable); nothing was recorded."),
    )
}
# OpenAPI 3.1: the `schema` of an event stream describes one event (3.2 would call it itemSchema).
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chat.completion.chunk, or [DONE]"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
}

def sse(body: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event carrying ``body`` as JSON (named ``event``: the Responses API names its events)."""
    return (f"event: {event}\n" if event else "") + f"data: {orjson.dumps(body).decode()}\n\n"


async def chat_events(chunks: AsyncIterator[dict[str, Any]], turn: Turn) -> AsyncIterator[str]:
    """A chat completion's stream: each chunk (or the error body) as an event, then [DONE]."""
    async for chunk in chunks:
        yield sse(chunk)
    yield "data: [DONE]\n\n"


Shape = Callable[[dict[str, Any], Turn], dict[str, Any]]
Events = Callable[[AsyncIterator[dict[str, Any]], Turn], AsyncIterator[str]]


async def run_turn(request: JSONBodyRequest, turn: Turn) -> tuple[dict[str, Any], float, Turn]:
    """One prepared turn served whole: the chat.completion body, the engine's seconds and the turn."""
    service: ChatService = request.app.state.service
    stop_watching = abort_when_gone(request, service, turn)
    try:
        resp, engine_s = await service.complete(turn)
    finally:
        stop_watching()
    return resp, engine_s, turn


async def serve_turn(request: JSONBodyRequest, body: ChatCompletionRequest, ctx: TurnContext, *,
                     shape: Shape | None = None, events: Events = chat_events, input_param: str = "messages",
                     **prepare: Any) -> Response:
    """Serve ``body`` as one turn: its JSON (the chat.completion ``shape`` makes into the route's
    body) or its stream (the chunks ``events`` makes into the route's events). ``input_param``
    names the field a context-length refusal blames; ``prepare`` goes to ChatService.prepare."""
    service = refuse_if_paused(request)
    metrics = service.metrics
    try:
        turn = service.prepare(body, ctx, **prepare)
        if body.stream:  # the service counts a stream's outcome as it ends
            return StreamingResponse(events(service.chunks(turn), turn), media_type="text/event-stream",
                                     headers={**_session_headers(turn), "Cache-Control": "no-cache"})
        resp, engine_s, turn = await run_turn(request, turn)
    except GatewayError as e:
        turn_type = (body.turn_type or ctx.turn_type or prepare.get("default_turn_type")
                     or service.settings.server.default_turn_type)
        metrics.requests.labels(str(e.status), "true" if body.stream else "false", turn_type).inc()
        if e.code == "context_length_exceeded":
            e.param = input_param
        raise
    metrics.requests.labels("200", "false", turn.turn_type).inc()
    payload = orjson.dumps(shape(resp, turn) if shape else resp)
    total = time.perf_counter() - request.arrived
    metrics.latency.labels("false").observe(total)
    return Response(payload, media_type="application/json", headers={
        **_session_headers(turn), "X-Turn-Index": str(resp["turn_index"]),
        "X-Weight-Version": resp["weight_version"], "Server-Timing": server_timing(total, engine_s)})


def refuse_if_paused(request: Request) -> ChatService:
    """The app's service; a 503 while an administrator has paused it."""
    service: ChatService = request.app.state.service
    if service.paused:
        service.metrics.requests.labels("503", "unknown", "unknown").inc()
        raise admin.paused_error()
    return service


def _session_headers(turn: Turn) -> dict[str, str]:
    return {"X-Session-Id": turn.session_id, "X-Turn-Type": turn.turn_type}
