"""The routes of the SGLang-compatible engine server (clawrl/engine/server.py wires them into an app
and lists where they knowingly differ from SGLang). What they serve is :class:`Served`, found in
``app.state.served`` through the ``Srv`` dependency."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from clawrl.engine.schemas import (
    GENERATE_DOC,
    AbortRequestBody,
    ContinueGenerationBody,
    DetokenizeBody,
    LoadLoRAAdapterBody,
    PauseGenerationBody,
    TokenizeBody,
    UnloadLoRAAdapterBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightVersionBody,
    split_batch,
)
from clawrl.engine.types import (
    BadRequestError,
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    UnknownKeyError,
)

log = logging.getLogger(__name__)

SERVER_VERSION = "clawrl-embedded"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
DISCONNECT_POLL_S = 0.5  # how often a waiting /generate checks whether its client went away

T = TypeVar("T")


# SGLang serialises with orjson (NaN/inf -> null); its error shapes are in server.py
def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS), status_code, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


class BodyError(Exception):
    """The /generate body is not JSON, or not a JSON object."""


class ClientGone(Exception):
    """The HTTP client disconnected before its generation finished."""


@dataclass
class Served:
    """The engine behind the routes, how it is described, and this server's own bookkeeping."""

    engine: Engine
    model_path: str
    served_model_name: str
    max_context_len: int
    max_running_requests: int | None
    tokenizer: Any  # a private copy: an HF fast tokenizer must not be used from two threads at once
    started_at: float = field(default_factory=time.time)
    paused: bool = False
    running: int = 0  # /generate calls in flight through this server (for /v1/loads)

    def stats(self) -> Mapping[str, Any]:
        return getattr(self.engine, "stats", None) or {}

    def engine_paused(self) -> bool:
        stats = self.stats()
        return bool(stats["paused"]) if "paused" in stats else self.paused  # the engine may be paused in-process

    def lora_info(self) -> dict[str, Any]:
        """The engine's LoRA settings and adapters (``EmbeddedEngine.lora_info``); {} when it has none."""
        info = getattr(self.engine, "lora_info", None)
        return info() if info is not None else {}

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise BadRequestError("this engine exposes no tokenizer")
        return self.tokenizer

    async def run_one(self, req: GenerateRequest) -> GenerateResult:
        self.running += 1
        try:
            return await self.engine.generate(req)
        finally:
            self.running -= 1

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                **await self.engine.model_info()}


def _served(request: Request) -> Served:
    return request.app.state.served


Srv = Annotated[Served, Depends(_served)]

# One route per method (not api_route(methods=[...])): each gets its own OpenAPI operation id.
router = APIRouter()
relabel_router = APIRouter()  # only for engines with update_weight_version
abort_router = APIRouter()  # only for engines with abort_request
lora_router = APIRouter()  # only for engines with load_lora_adapter


@router.post("/generate", openapi_extra=GENERATE_DOC)
@router.put("/generate", openapi_extra=GENERATE_DOC)
async def generate(request: Request, srv: Srv) -> Response:
    raw = await request.body()
    if not raw.strip():
        raise BodyError("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BodyError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, Mapping):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    items, batch = split_batch(body)
    try:
        reqs = [GenerateRequest(**item) for item in items]  # all validated before any runs
    except UnknownKeyError as e:  # SGLang 0.5.22+'s typed /generate contract answers these with a plain string
        return json_response({"error": str(e)}, 400)
    if len(rids := [r.rid for r in reqs]) > len(set(rids)):  # SGLang's words
        raise BadRequestError(f"Duplicate request IDs detected within the request: "
                              f"{sorted({r for r in rids if rids.count(r) > 1})}")
    parallel = any(r.sampling_params.n > 1 for r in reqs)
    if not batch and reqs[0].stream and not parallel:
        return await _stream(request, srv, reqs[0])
    if any(r.stream for r in reqs):
        raise BadRequestError("streaming a batch of prompts or n > 1 samples is not supported; send one request "
                              "per prompt and sample")
    reqs = [s for r in reqs for s in r.samples()]  # n samples of a prompt: one list entry each, in order
    # a batch's requests all end (none is left running for nobody) before the first error is raised
    results = await _unless_disconnected(request, asyncio.gather(*(srv.run_one(r) for r in reqs),
                                                                 return_exceptions=True))
    for r in results:
        if isinstance(r, BaseException):
            raise r
    out = [res.to_sglang(req, srv.tokenizer) for res, req in zip(results, reqs)]
    return json_response(out if batch or parallel else out[0])


async def _stream(request: Request, srv: Served, req: GenerateRequest) -> Response:
    parts = srv.engine.generate_stream(req).__aiter__()
    srv.running += 1
    try:
        # Pull the first partial before answering: bad input then gets a real HTTP 400, not an
        # SSE error event behind a 200 status.
        first = await _unless_disconnected(request, parts.__anext__())
    except BaseException as e:
        srv.running -= 1
        await _aclose(parts)
        if isinstance(e, StopAsyncIteration):
            raise EngineError("the engine ended the stream without a result") from None
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _sse(first.to_sglang(req, srv.tokenizer))
            async for part in parts:
                yield _sse(part.to_sglang(req, srv.tokenizer))
        except Exception as e:  # the status line is sent already: report in-band, as SGLang does
            code, kind = (400, "invalid_request_error") if isinstance(e, BadRequestError) else (500, "engine_error")
            if code == 500:
                log.error("stream %s failed: %r", req.rid, e)
            yield _sse({"error": {"message": str(e), "type": kind, "code": code, "retryable": False}})
        finally:
            srv.running -= 1
            await _aclose(parts)  # a client that went away aborts its request in the engine
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


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
                raise ClientGone()
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


@router.get("/model_info")
@router.get("/get_model_info")  # deprecated alias, still served by SGLang 0.5.23
async def model_info(srv: Srv) -> Response:
    return json_response(await srv.model_info())


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(srv: Srv) -> Response:
    info = await srv.model_info()
    return json_response({
        "model_path": info["model_path"], "served_model_name": info["served_model_name"],
        "context_length": srv.max_context_len,
        "max_req_input_len": srv.max_context_len - 1,  # a prompt must leave room for one token
        "max_running_requests": srv.max_running_requests, "weight_version": info.get("weight_version"),
        "max_total_num_tokens": getattr(srv.engine, "max_total_tokens", None)  # the KV cache's token slots
        or srv.max_running_requests * srv.max_context_len,
        "enable_deterministic_inference": getattr(srv.engine, "deterministic", False) is True,  # [engine] deterministic
        "startup_time": srv.started_at, "version": SERVER_VERSION, "frontend": "python",
        "internal_states": [dict(srv.stats())],  # SGLang: one per DP rank; here the engine's counters
        **srv.lora_info(),
    })


@router.get("/v1/models")
async def list_models(srv: Srv) -> Response:
    """The served model, then each LoRA adapter registered on it (``parent``: the model), as SGLang lists them."""
    name = (await srv.model_info())["served_model_name"]
    card = {"id": name, "object": "model", "created": int(srv.started_at), "owned_by": "clawrl",
            "root": name, "parent": None, "max_model_len": srv.max_context_len}
    adapters = [{**card, "id": lora, "root": path, "parent": name}
                for lora, path in srv.lora_info().get("lora_paths", {}).items()]
    return json_response({"object": "list", "data": [card, *adapters]})


@router.get("/health")
async def health(srv: Srv) -> Response:
    return Response(status_code=200 if await srv.engine.health() else 503)


@router.get("/health_generate")
async def health_generate(srv: Srv) -> Response:
    if srv.engine_paused():
        return Response(status_code=503)  # SGLang would hold the probe for 20 s, then 503
    probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                            rid=f"HEALTH_CHECK_{time.time()}")
    try:
        await asyncio.wait_for(srv.engine.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, EngineError, BadRequestError) as e:
        log.error("health_generate probe failed: %r", e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/ready")
async def ready(srv: Srv) -> Response:
    ok = not srv.engine_paused() and await srv.engine.health()
    return Response(status_code=200 if ok else 503)


@router.get("/v1/loads")
async def loads(srv: Srv) -> Response:
    """The subset of SGLang's load report this engine can fill (what slime polls for idleness)."""
    stats = srv.stats()
    load = {"dp_rank": 0, "num_running_reqs": int(stats.get("running", srv.running)),
            "num_waiting_reqs": int(stats.get("queued", 0))}
    device = getattr(getattr(srv.engine, "model", None), "device", None)
    return json_response({"timestamp": time.time(), "version": SERVER_VERSION,
                          "accelerator": getattr(device, "type", "unknown"), "num_accelerators": 1, "loads": [load]})


@router.post("/pause_generation")
async def pause_generation(srv: Srv, body: PauseGenerationBody = PauseGenerationBody()) -> Response:
    await srv.engine.pause_generation(body.mode)
    srv.paused = True
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(srv: Srv, body: ContinueGenerationBody = ContinueGenerationBody()) -> Response:
    await srv.engine.continue_generation()
    srv.paused = False
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.get("/flush_cache")
@router.post("/flush_cache")
async def flush_cache(srv: Srv) -> Response:
    if await srv.engine.flush_cache():
        return Response("Cache flushed.\n", 200, media_type="text/plain")
    return Response("Cache not flushed: requests are running and generation is not paused. "
                    "Pause first or retry when idle.\n", 400, media_type="text/plain")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(srv: Srv, body: UpdateWeightsFromDiskBody) -> Response:
    if body.abort_all_requests and hasattr(srv.engine, "abort_request"):
        await srv.engine.abort_request(abort_all=True)
    result = await srv.engine.update_weights_from_disk(body.model_path, body.weight_version)
    content = {"success": result.success, "message": result.message, "num_paused_requests": 0,
               **({"workers": list(result.workers)} if result.workers else {})}
    return json_response(content, 200 if result.success else 400)


@relabel_router.post("/update_weight_version")
async def update_weight_version(srv: Srv, body: UpdateWeightVersionBody) -> Response:
    if body.abort_all_requests and hasattr(srv.engine, "abort_request"):
        await srv.engine.abort_request(abort_all=True)
    await srv.engine.update_weight_version(body.new_version)
    return json_response({"success": True, "message": f"Weight version updated to {body.new_version}",
                          "new_version": body.new_version})


@lora_router.post("/load_lora_adapter")
async def load_lora_adapter(srv: Srv, body: LoadLoRAAdapterBody) -> Response:
    result = await srv.engine.load_lora_adapter(body.lora_name, body.lora_path)
    return json_response(result.to_sglang(), 200 if result.success else 400)


@lora_router.post("/unload_lora_adapter")
async def unload_lora_adapter(srv: Srv, body: UnloadLoRAAdapterBody) -> Response:
    result = await srv.engine.unload_lora_adapter(body.lora_name)
    return json_response(result.to_sglang(), 200 if result.success else 400)


@abort_router.post("/abort_request")
async def abort_request(srv: Srv, body: AbortRequestBody = AbortRequestBody()) -> Response:
    await srv.engine.abort_request(rid=body.rid, abort_all=body.abort_all)
    return Response(status_code=200)


@router.get("/release_memory_occupation")
@router.post("/release_memory_occupation")
@router.get("/resume_memory_occupation")
@router.post("/resume_memory_occupation")
async def memory_occupation() -> Response:
    return json_response(None)  # nothing to release on this engine; RL drivers call these unconditionally


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(srv: Srv, body: TokenizeBody) -> Response:
    tok = srv.need_tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise BadRequestError("send exactly one of 'prompt' or 'messages'")
    if body.messages is not None:
        try:
            tokens: list[int] | list[list[int]] = tok.apply_chat_template(
                body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                return_dict=False)
        except Exception as e:  # jinja errors, missing roles: the caller's input is the likely cause
            raise BadRequestError(f"could not apply the chat template: {e}") from None
    elif isinstance(body.prompt, str):
        tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tokens = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
    count = [len(t) for t in tokens] if isinstance(body.prompt, list) else len(tokens)
    return json_response({"tokens": tokens, "count": count, "max_model_len": srv.max_context_len})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(srv: Srv, body: DetokenizeBody) -> Response:
    tok = srv.need_tokenizer()
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows = body.tokens if batch else [body.tokens]
    bad = sorted({t for row in rows for t in row if not 0 <= t < len(tok)})  # type: ignore[union-attr]
    if bad:  # the Rust tokenizer raises OverflowError on ids that do not fit in u32
        raise BadRequestError(f"tokens contain {len(bad)} id(s) outside [0, {len(tok)}), e.g. {bad[:3]}")
    texts = [tok.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]
    return json_response({"text": texts if batch else texts[0]})

