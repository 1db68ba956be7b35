"""Serve any in-process :class:`~clawrl.engine.types.Engine` over SGLang's native HTTP contract.

Paths, bodies, status codes and error shapes follow SGLang 0.5.23 (shared/ref/sglang.md §1–4, §8),
so :class:`~clawrl.engine.sglang_client.SGLangClient` cannot tell this server from a real SGLang
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
  * ``/begin_weight_update`` / ``/end_weight_update`` only keep session bookkeeping (a tensor update
    path that needs them is not served here).
  * ``/release_memory_occupation`` / ``/resume_memory_occupation`` answer ``null`` and do nothing.
  * ``/v1/loads`` reports only ``num_running_reqs`` / ``num_waiting_reqs`` per load entry (no KV
    token usage or throughput); ``/server_info`` is a subset of SGLang's server args.
  * ``/abort_request`` and ``/update_weight_version`` exist only when the engine has methods of
    those names (EmbeddedEngine has both; with another engine they answer 404).
  * ``top_logprobs_num`` above ``MAX_TOP_LOGPROBS`` (20) is a 400; SGLang has no cap.

As in SGLang, a client that disconnects gets its request aborted: streams are closed when the
connection drops, and a non-streaming call notices within ``DISCONNECT_POLL_S``.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema

from clawrl.engine.types import (
    SGLANG_SAMPLING_KEYS,
    BadRequestError,
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)

log = logging.getLogger(__name__)

SERVER_VERSION = "clawrl-embedded"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
DISCONNECT_POLL_S = 0.5  # how often a waiting /generate checks whether its client went away
# vLLM's default max_logprobs and OpenAI's top_logprobs limit. Uncapped, one request could ask for
# the whole vocabulary at every position: 28 tokens at k = 10**6 made a 45 MB response here.
MAX_TOP_LOGPROBS = 20

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# responses: SGLang serialises with orjson (NaN/inf -> null) and uses several error shapes (ref §1)


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS), status_code, media_type="application/json")


def _value_error(message: str, status_code: int = 400) -> Response:
    """A ValueError inside /generate and most control routes: ``{"error": {"message": ...}}``."""
    return _json({"error": {"message": message}}, status_code)


def _contract_error(message: str) -> Response:
    """The typed /generate contract of SGLang 0.5.22+ (unknown sampling_params keys): a plain string."""
    return _json({"error": message}, 400)


def _validation_error(message: str) -> Response:
    """Pydantic validation of a route body (also malformed JSON): SGLang's ErrorResponse."""
    return _json({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400)


class _BodyError(Exception):
    """The body is not JSON, or not the JSON shape the route needs."""


async def _read_json(request: Request, *, required: bool) -> Any:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise _BodyError("request body is empty; expected a JSON object")
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _BodyError(f"request body is not valid JSON: {e}") from None


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


# --------------------------------------------------------------------------------------------
# control-route bodies (SGLang io_struct fields; unknown keys are ignored, as SGLang's dataclasses do)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskBody(_Body):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: relabelling aborts everything in flight


class WeightUpdateSessionBody(_Body):
    selector: Literal["all", "target", "draft"] = "all"


class AbortRequestBody(_Body):
    rid: str = ""
    abort_all: bool = False


class TokenizeBody(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    prompt: str | list[str] | SkipJsonSchema[None] = None  # exactly one of prompt / messages
    messages: list[dict[str, Any]] | SkipJsonSchema[None] = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(_Body):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class SamplingParamsBody(BaseModel):
    """The ``sampling_params`` keys this engine implements (OpenAPI only: /generate validates by
    hand, as SGLang does; other SGLang keys are accepted only at their no-op value)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(128, ge=0)  # capped at the context room; 0 = score the prompt
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 or >= 1
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = Field(1, ge=1, le=1)


_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]  # ids must also be < the vocabulary size


class GenerateBody(_Body):
    """SGLang's /generate body, the fields this server reads (OpenAPI only, see SamplingParamsBody).
    Exactly one of ``text`` / ``input_ids``; a list of prompts is a batch."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})
    text: _Text | Annotated[list[_Text], Field(min_length=1)] | SkipJsonSchema[None] = None
    input_ids: _Ids | Annotated[list[_Ids], Field(min_length=1)] | SkipJsonSchema[None] = None
    # a batch may also send one sampling_params object and one rid per prompt
    sampling_params: SamplingParamsBody | None = None
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # and < the prompt length
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = False


def _body_doc(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body by hand: the body is ``model``."""
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def document_request_models(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the JSON schemas of request bodies that routes declare by ``$ref`` (routes that read
    their body by hand, see ``_body_doc``) to the app's OpenAPI components. A name already there
    must hold the same schema."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in {**js.pop("$defs", {}), model.__name__: js}.items():
                    if schemas.setdefault(name, sub) != sub:
                        raise RuntimeError(f"OpenAPI component {name} is declared twice, differently")
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _parse_body(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, Mapping):
        raise _BodyError(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _BodyError(str(e)) from None


# --------------------------------------------------------------------------------------------
# the app


@dataclass
class _ServerState:
    paused: bool = False
    pause_mode: str | None = None
    update_session_open: bool = False
    running: int = 0  # /generate calls in flight through this server (for /v1/loads)
    started_at: float = 0.0


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
            return await _json({"error": "Unauthorized"}, 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def create_engine_app(
    engine: Engine,
    *,
    model_path: str,
    served_model_name: str,
    max_context_len: int,
    max_running_requests: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """An ASGI app exposing ``engine`` over SGLang's native routes (module docstring lists them).

    The caller owns the engine's lifetime (``start``/``close``); the app only forwards calls. The
    engine's ``tokenizer`` attribute, when present, serves /tokenize, /detokenize and the texts of
    ``return_text_in_logprobs``; ``abort_request`` and ``update_weight_version`` routes exist only
    when the engine has methods of those names.
    """
    # /openapi.json documents the bodies routes read by hand (the schema fuzz tests generate from it)
    app = FastAPI(title="clawrl engine (SGLang-compatible)", docs_url=None, redoc_url=None)
    state = _ServerState(started_at=time.time())
    tokenizer = _private_copy(getattr(engine, "tokenizer", None))
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(str(exc))  # FastAPI would answer 422; SGLang answers 400

    @app.exception_handler(_BodyError)
    async def _on_body_error(request: Request, exc: _BodyError) -> Response:
        return _validation_error(str(exc))

    @app.exception_handler(_ClientGone)
    async def _on_client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(BadRequestError)
    async def _on_bad_request(request: Request, exc: BadRequestError) -> Response:
        return _value_error(str(exc))

    @app.exception_handler(EngineError)
    async def _on_engine_error(request: Request, exc: EngineError) -> Response:
        log.error("engine error on %s: %s", request.url.path, exc)
        return _value_error(str(exc), 500)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return _value_error(f"internal error: {exc!r}", 500)

    def decode_token(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def engine_paused() -> bool:
        stats = getattr(engine, "stats", None)
        stats = stats() if callable(stats) else stats
        if isinstance(stats, Mapping) and "paused" in stats:
            return bool(stats["paused"])  # the engine knows best (it may be paused in-process)
        return state.paused

    def render(res: GenerateResult, req: GenerateRequest, body: Mapping[str, Any]) -> dict[str, Any]:
        prompt_ids = req.input_ids if req.input_ids is not None else res.prompt_ids
        out = res.to_sglang(
            decode_token=decode_token,
            return_text_in_logprobs=req.return_text_in_logprobs,
            with_logprobs=req.return_logprob,
            input_ids=prompt_ids,
            logprob_start_len=req.logprob_start_len,
        )
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = list(prompt_ids or [])
        return out

    async def run_one(req: GenerateRequest) -> GenerateResult:
        state.running += 1
        try:
            return await engine.generate(req)
        finally:
            state.running -= 1

    # ---------------------------------------------------------------- generation

    # one route per method (not api_route(methods=[...])): each gets its own OpenAPI operation id
    @app.post("/generate", openapi_extra=_body_doc(GenerateBody))
    @app.put("/generate", openapi_extra=_body_doc(GenerateBody))
    async def generate(request: Request) -> Response:
        body = await _read_json(request, required=True)
        if not isinstance(body, Mapping):
            raise _BodyError(f"request body must be a JSON object, got {type(body).__name__}")
        items = _split_batch(body)
        for item in items:
            if (msg := _unknown_sampling_keys(item.get("sampling_params"))) is not None:
                return _contract_error(msg)
        reqs = [_parse_generate(item) for item in items]  # all validated before any runs
        if len(items) == 1 and not _is_batch(body):
            if reqs[0].stream:
                return await _stream(request, reqs[0], body)
            res = await _unless_disconnected(request, run_one(reqs[0]))
            return _json(render(res, reqs[0], body))
        if any(r.stream for r in reqs):
            raise BadRequestError("streaming a batch of prompts is not supported; send one request per prompt")
        results = await _unless_disconnected(request, asyncio.gather(*(run_one(r) for r in reqs),
                                                                     return_exceptions=True))
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return _json([render(res, req, item) for res, req, item in zip(results, reqs, items)])

    async def _stream(request: Request, req: GenerateRequest, body: Mapping[str, Any]) -> Response:
        parts = engine.generate_stream(req).__aiter__()
        state.running += 1
        try:
            # Pull the first partial before answering: bad input then gets a real HTTP 400, not an
            # SSE error event behind a 200 status.
            first = await _unless_disconnected(request, parts.__anext__())
        except StopAsyncIteration:
            state.running -= 1
            raise EngineError("the engine ended the stream without a result") from None
        except BaseException:
            state.running -= 1
            await _aclose(parts)
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _sse(render(first, req, body))
                async for part in parts:
                    yield _sse(render(part, req, body))
            except Exception as e:  # the status line is sent already: report in-band, as SGLang does
                code, kind = (400, "invalid_request_error") if isinstance(e, BadRequestError) else (500, "engine_error")
                if code == 500:
                    log.error("stream %s failed: %r", req.rid, e)
                yield _sse({"error": {"message": str(e), "type": kind, "code": code, "retryable": False}})
            finally:
                state.running -= 1
                await _aclose(parts)  # a client that went away aborts its request in the engine
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---------------------------------------------------------------- information and health

    async def current_model_info() -> dict[str, Any]:
        info = {
            "model_path": model_path,
            "served_model_name": served_model_name,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
        }
        info.update(await engine.model_info())
        return info

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated alias, still served by SGLang 0.5.23
    async def model_info() -> Response:
        return _json(await current_model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        info = await current_model_info()
        return _json(
            {
                "model_path": info.get("model_path", model_path),
                "served_model_name": info.get("served_model_name", served_model_name),
                "context_length": max_context_len,
                "max_req_input_len": max_context_len - 1,  # a prompt must leave room for one token
                "max_running_requests": max_running_requests,
                "weight_version": info.get("weight_version"),
                "startup_time": state.started_at,
                "version": SERVER_VERSION,
                "frontend": "python",
            }
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        name = (await current_model_info()).get("served_model_name", served_model_name)
        card = {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "clawrl",
                "root": name, "parent": None, "max_model_len": max_context_len}
        return _json({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await engine.health() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine_paused():
            return Response(status_code=503)  # SGLang would hold the probe for 20 s, then 503
        probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                                rid=f"HEALTH_CHECK_{time.time()}")
        try:
            await asyncio.wait_for(engine.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError, BadRequestError) as e:
            log.error("health_generate probe failed: %r", e)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        ok = not engine_paused() and await engine.health()
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/loads")
    async def loads() -> Response:
        """The subset of SGLang's load report this engine can fill (what slime polls for idleness)."""
        stats = getattr(engine, "stats", None)
        stats = stats() if callable(stats) else (stats or {})
        load = {
            "dp_rank": 0,
            "num_running_reqs": int(stats.get("running", state.running)),
            "num_waiting_reqs": int(stats.get("queued", 0)),
        }
        device = getattr(getattr(engine, "model", None), "device", None)
        return _json({"timestamp": time.time(), "version": SERVER_VERSION,
                      "accelerator": getattr(device, "type", "unknown"), "num_accelerators": 1, "loads": [load]})

    # ---------------------------------------------------------------- pause, flush, weights

    @app.post("/pause_generation", openapi_extra=_body_doc(PauseGenerationBody, required=False))
    async def pause_generation(request: Request) -> Response:
        body = _parse_body(PauseGenerationBody, await _read_json(request, required=False))
        await engine.pause_generation(body.mode)
        state.paused, state.pause_mode = True, body.mode
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation", openapi_extra=_body_doc(ContinueGenerationBody, required=False))
    async def continue_generation(request: Request) -> Response:
        await _read_json(request, required=False)  # torch_empty_cache: nothing to empty here
        await engine.continue_generation()
        state.paused, state.pause_mode = False, None
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if await engine.flush_cache():
            return Response("Cache flushed.\n", 200, media_type="text/plain")
        return Response(
            "Cache not flushed: requests are running and generation is not paused. "
            "Pause first or retry when idle.\n",
            400,
            media_type="text/plain",
        )

    @app.post("/update_weights_from_disk", openapi_extra=_body_doc(UpdateWeightsFromDiskBody))
    async def update_weights_from_disk(request: Request) -> Response:
        body = _parse_body(UpdateWeightsFromDiskBody, await _read_json(request, required=True))
        if body.abort_all_requests and hasattr(engine, "abort_request"):
            await engine.abort_request(abort_all=True)
        result = await engine.update_weights_from_disk(body.model_path, body.weight_version)
        content = {"success": result.success, "message": result.message, "num_paused_requests": 0}
        return _json(content, 200 if result.success else 400)

    @app.post("/begin_weight_update", openapi_extra=_body_doc(WeightUpdateSessionBody, required=False))
    async def begin_weight_update(request: Request) -> Response:
        _parse_body(WeightUpdateSessionBody, await _read_json(request, required=False))
        if state.update_session_open:
            return _json({"success": False, "message": "A weight update session is already open; "
                          "call /end_weight_update first."}, 400)
        state.update_session_open = True
        return _json({"success": True, "message": "Weight update session opened."})

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> Response:
        await _read_json(request, required=False)
        if not state.update_session_open:
            return _json({"success": False, "message": "No weight update session is open; "
                          "call /begin_weight_update first."}, 400)
        state.update_session_open = False
        return _json({"success": True, "message": "Weight update session closed."})

    if hasattr(engine, "update_weight_version"):

        @app.post("/update_weight_version", openapi_extra=_body_doc(UpdateWeightVersionBody))
        async def update_weight_version(request: Request) -> Response:
            body = _parse_body(UpdateWeightVersionBody, await _read_json(request, required=True))
            if body.abort_all_requests and hasattr(engine, "abort_request"):
                await engine.abort_request(abort_all=True)
            await engine.update_weight_version(body.new_version)
            return _json({"success": True, "message": f"Weight version updated to {body.new_version}",
                          "new_version": body.new_version})

    if hasattr(engine, "abort_request"):

        @app.post("/abort_request", openapi_extra=_body_doc(AbortRequestBody, required=False))
        async def abort_request(request: Request) -> Response:
            body = _parse_body(AbortRequestBody, await _read_json(request, required=False))
            await engine.abort_request(rid=body.rid, abort_all=body.abort_all)
            return Response(status_code=200)

    @app.get("/release_memory_occupation")
    @app.post("/release_memory_occupation")
    @app.get("/resume_memory_occupation")
    @app.post("/resume_memory_occupation")
    async def memory_occupation() -> Response:
        return _json(None)  # nothing to release on this engine; RL drivers call these unconditionally

    # ---------------------------------------------------------------- tokenizer

    def need_tokenizer():
        if tokenizer is None:
            raise BadRequestError("this engine exposes no tokenizer")
        return tokenizer

    @app.post("/tokenize", openapi_extra=_body_doc(TokenizeBody))
    @app.post("/v1/tokenize", openapi_extra=_body_doc(TokenizeBody))
    async def tokenize(request: Request) -> Response:
        body = _parse_body(TokenizeBody, await _read_json(request, required=True))
        tok = need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise BadRequestError("send exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            tokens: list[int] | list[list[int]] = _apply_chat_template(
                tok, body.messages, body.tools, body.add_generation_prompt
            )
            count: int | list[int] = len(tokens)
        elif isinstance(body.prompt, str):
            tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            count = len(tokens)
        else:
            tokens = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
            count = [len(t) for t in tokens]
        return _json({"tokens": tokens, "count": count, "max_model_len": max_context_len})

    @app.post("/detokenize", openapi_extra=_body_doc(DetokenizeBody))
    @app.post("/v1/detokenize", openapi_extra=_body_doc(DetokenizeBody))
    async def detokenize(request: Request) -> Response:
        body = _parse_body(DetokenizeBody, await _read_json(request, required=True))
        tok = need_tokenizer()
        rows = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
        bad = sorted({t for row in rows for t in row if not 0 <= t < len(tok)})  # type: ignore[union-attr]
        if bad:  # the Rust tokenizer raises OverflowError on ids that do not fit in u32
            raise BadRequestError(f"tokens contain {len(bad)} id(s) outside [0, {len(tok)}), e.g. {bad[:3]}")
        if body.tokens and isinstance(body.tokens[0], list):
            text: str | list[str] = [tok.decode(t, skip_special_tokens=body.skip_special_tokens) for t in body.tokens]
        else:
            text = tok.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)
        return _json({"text": text})

    document_request_models(app, GenerateBody, PauseGenerationBody, ContinueGenerationBody,
                            UpdateWeightsFromDiskBody, WeightUpdateSessionBody, UpdateWeightVersionBody,
                            AbortRequestBody, TokenizeBody, DetokenizeBody)
    app.state.engine = engine
    app.state.server_state = state
    return app


# --------------------------------------------------------------------------------------------
# helpers


def _is_batch(body: Mapping[str, Any]) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)) or isinstance(text, list)


def _split_batch(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One /generate body per prompt; per-prompt ``sampling_params`` and ``rid`` lists are spread."""
    if not _is_batch(body):
        return [dict(body)]
    key = "input_ids" if body.get("input_ids") is not None else "text"
    prompts = body[key]
    if not prompts:
        raise BadRequestError(f"{key} is an empty batch")
    n = len(prompts)
    sps, rids = body.get("sampling_params"), body.get("rid")
    if isinstance(sps, list) and len(sps) != n:
        raise BadRequestError(f"sampling_params has {len(sps)} entries for a batch of {n} prompts")
    if rids is not None and (not isinstance(rids, list) or len(rids) != n):
        raise BadRequestError(f"rid must be a list of {n} ids for a batch of {n} prompts")
    items = []
    for i, prompt in enumerate(prompts):
        item = dict(body)
        item[key] = prompt
        if isinstance(sps, list):
            item["sampling_params"] = sps[i]
        if rids is not None:
            item["rid"] = rids[i]
        items.append(item)
    return items


def _parse_generate(item: Mapping[str, Any]) -> GenerateRequest:
    try:
        req = GenerateRequest.from_sglang(item)
    except BadRequestError:
        raise
    except (TypeError, ValueError) as e:  # e.g. "logprob_start_len": "x" -> int() fails
        raise BadRequestError(f"invalid /generate request: {e}") from None
    if req.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS}, got {req.top_logprobs_num}")
    return req


def _unknown_sampling_keys(sp: Any) -> str | None:
    if not isinstance(sp, Mapping):
        return None  # GenerateRequest.from_sglang reports a non-object sampling_params
    unknown = sorted(set(sp) - SGLANG_SAMPLING_KEYS)
    return f"unknown sampling_params key(s): {', '.join(unknown)}" if unknown else None


def _apply_chat_template(tokenizer, messages, tools, add_generation_prompt: bool) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as e:  # jinja errors, missing roles: the caller's input is the likely cause
        raise BadRequestError(f"could not apply the chat template: {e}") from None
    if isinstance(ids, Mapping):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _private_copy(tokenizer: Any) -> Any:
    """A copy of the engine's tokenizer for this server's own use: an HF fast tokenizer must not be
    used from two threads at once, and the engine decodes on its worker thread."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # an exotic tokenizer that cannot be copied: share it, say so
        log.warning("could not copy the engine's tokenizer (%r); sharing it", e)
        return tokenizer


class _ClientGone(Exception):
    """The HTTP client disconnected before its generation finished."""


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, but cancel it when the client disconnects first: the engine then aborts the
    request instead of generating for nobody (SGLang aborts disconnected requests too)."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})  # let the cancellation land (the engine aborts the request)
                raise _ClientGone()
    except asyncio.CancelledError:  # the server itself cancelled us (shutdown)
        task.cancel()
        raise


async def _aclose(it: Any) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception as e:  # closing must not mask the error that got us here
            log.warning("closing the engine stream failed: %r", e)


# --------------------------------------------------------------------------------------------
# serving


def build_uvicorn_server(app: FastAPI, host: str, port: int, *, log_level: str = "info"):
    """A uvicorn.Server for ``app``; ``await server.serve()`` runs it, ``server.should_exit = True`` stops it."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


async def run_engine_server(
    engine: Engine,
    host: str,
    port: int,
    *,
    model_path: str,
    served_model_name: str,
    max_context_len: int,
    max_running_requests: int | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Start ``engine``, serve it until interrupted, then close it."""
    start = getattr(engine, "start", None)
    if start is not None:
        await start()
    try:
        app = create_engine_app(engine, model_path=model_path, served_model_name=served_model_name,
                                max_context_len=max_context_len, max_running_requests=max_running_requests,
                                api_key=api_key)
        await build_uvicorn_server(app, host, port, log_level=log_level).serve()
    finally:
        await engine.close()


def serve_engine(
    engine: Engine,
    host: str,
    port: int,
    *,
    model_path: str,
    served_model_name: str,
    max_context_len: int,
    max_running_requests: int | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Blocking: serve ``engine`` on ``host:port`` with uvicorn (``clawrl engine`` calls this)."""
    asyncio.run(
        run_engine_server(engine, host, port, model_path=model_path, served_model_name=served_model_name,
                          max_context_len=max_context_len, max_running_requests=max_running_requests,
                          api_key=api_key, log_level=log_level)
    )
