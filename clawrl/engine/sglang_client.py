"""The :class:`~clawrl.engine.types.Engine` protocol over SGLang's native HTTP API.

Talks to a real SGLang server (0.5.23 semantics, degrading to 0.5.15) or to ``clawrl engine``
(clawrl/engine/server.py), which answers the same contract.

Transport: every call goes through one ``aiohttp.ClientSession``. Measured on a 16-core H200 host
at 16 requests in flight, aiohttp as the engine client adds +0.31 ms p50 (under 1% of an engine
call), while httpx's connection pool cost ~2 ms of CPU per turn (it re-checks every pooled
connection whenever a request starts or ends).

Error mapping: HTTP 400 in any of SGLang's error shapes -> :class:`BadRequestError` with the
server's message; connection failures, timeouts, 5xx and other unexpected statuses ->
:class:`EngineError` (:class:`EngineTimeoutError` for timeouts) whose message names the URL and
what happened. The weight-update calls report failure as ``UpdateResult(success=False)`` instead,
because SGLang answers a failed update with 400 and a ``{"success": false}`` body.

Timeouts are on silence, not on length (``timeout_s``, ``[engine] stall_timeout_s``): a call fails
when the server sends nothing for that long - to the first byte, and between the events of a
stream - however long a stream that keeps sending runs. A non-streamed ``/generate`` sends nothing
until its answer is whole, so silence says nothing there: while it waits, the server is asked
``GET /health`` every ``timeout_s``, and the call fails when that goes unanswered or unhealthy
(SGLang's /health fails when its scheduler stopped producing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
import orjson

from clawrl.engine.types import (
    BadRequestError,
    EngineError,
    EngineOverloadedError,
    EngineTimeoutError,
    EngineUnreachableError,
    GenerateRequest,
    GenerateResult,
    LoRAUpdateResult,
    PauseMode,
    UpdateResult,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# uvicorn (under SGLang and `clawrl engine`) closes a keep-alive connection after 5 s idle, and
# aiohttp does not resend a POST that fails on a connection the server closed as it was reused:
# idle connections are dropped on our side first.
KEEPALIVE_S = 4.0


def error_message(status: int, content: bytes) -> str:
    """The human message of an SGLang error body, whichever of its shapes it uses:
    ``{"error": "..."}``, ``{"error": {"message": ...}}``, ``{"object": "error", "message": ...}``,
    ``{"success": false, "message": ...}``, FastAPI's ``{"detail": ...}`` or plain text
    (``/flush_cache``)."""
    text = content.decode("utf-8", "replace")
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, Mapping) and err.get("message") is not None:
            return str(err["message"])
        for key in ("message", "detail"):
            if body.get(key) is not None:
                return str(body[key])
    return text.strip() or f"HTTP {status}"


class SGLangClient:
    """Async client for one SGLang-compatible server (or router) at ``base_url``.

    One instance belongs to one event loop: its ``aiohttp.ClientSession`` is made on the first
    call, inside that loop; ``close`` it when done. ``flush_retries`` / ``flush_retry_interval_s``:
    how long :meth:`flush_cache` keeps asking while the server answers 400 busy (slime: 60 × 1 s).
    ``timeout_s``: the longest the server may stay silent (the module docstring says how).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 120.0, api_key: str | None = None,
                 flush_retries: int = 60, flush_retry_interval_s: float = 1.0):
        self.base_url = base_url.rstrip("/")  # a trailing slash must not produce '//generate'
        self.timeout_s = timeout_s
        self.flush_retries = flush_retries
        self.flush_retry_interval_s = flush_retry_interval_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self.max_context_len: int | None = None  # set by learn_context_len

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s),
                # RL rollouts keep many requests in flight; aiohttp's default limit of 100 would queue them
                connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(), headers=self._headers)
        return self._session

    def _transport_error(self, e: BaseException, method: str, path: str) -> EngineError:
        where = f"engine at {self.base_url}"
        if isinstance(e, TimeoutError):  # aiohttp's timeouts subclass it
            return EngineTimeoutError(f"{where} sent nothing for {self.timeout_s:g} s on {method} {path}")
        if isinstance(e, aiohttp.ClientConnectorError):
            reason = "connection refused" if isinstance(e.os_error, ConnectionRefusedError) else str(e.os_error)
            return EngineUnreachableError(f"{where} unreachable: {reason}")
        if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)):
            return EngineUnreachableError(f"{where} broke the connection on {method} {path}: {type(e).__name__}: {e}")
        return EngineError(f"{where} failed on {method} {path}: {type(e).__name__}: {e}")

    @asynccontextmanager
    async def _open(self, method: str, path: str, body: Any = None, *, accept: tuple[int, ...] = (),
                    headers: dict[str, str] | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request: the response once its status is 2xx or in ``accept``, else the mapped error
        (400 -> BadRequestError, others -> EngineError naming the URL and status). Transport
        failures inside the block (reading the body too) become EngineError / EngineTimeoutError.
        Leaving the block before the body ended closes the connection: that is how the server
        learns to stop generating."""
        data = None if body is None else orjson.dumps(body)
        try:
            async with self._http().request(method, self.base_url + path, data=data, headers=headers,
                                            **({"timeout": timeout} if timeout else {})) as resp:
                if resp.status >= 300 and resp.status not in accept:
                    msg = error_message(resp.status, await resp.read())
                    if resp.status == 400:
                        raise BadRequestError(msg)
                    if resp.status == 503 and path == "/generate":
                        raise EngineOverloadedError(f"engine at {self.base_url}: {msg}")
                    raise EngineError(f"engine at {self.base_url} answered HTTP {resp.status} on {method} {path}: "
                                      f"{msg}")
                yield resp
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._transport_error(e, method, path) from e

    async def _request(self, method: str, path: str, body: Any = None, *, accept: tuple[int, ...] = (),
                       headers: dict[str, str] | None = None,
                       timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; statuses other than 2xx and ``accept`` raise (see ``_open``)."""
        async with self._open(method, path, body, accept=accept, headers=headers, timeout=timeout) as resp:
            return resp.status, await resp.read()

    def _json(self, content: bytes, method: str, path: str) -> Any:
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            raise EngineError(f"engine at {self.base_url} answered {method} {path} with non-JSON: "
                              f"{content[:200].decode('utf-8', 'replace')!r}") from None

    def _generate_body(self, req: GenerateRequest, stream: bool) -> dict[str, Any]:
        # a text prompt asks for its token ids back: the result carries the tokenized prompt, as in-process
        return {**req.to_sglang(), "stream": stream, "return_prompt_token_ids": req.text is not None}

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        # no read timeout: the answer comes whole, after any time; _while_healthy watches the server instead
        call = asyncio.ensure_future(self._request(
            "POST", "/generate", self._generate_body(req, stream=False), headers=_routing(req),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)))
        _, content = await self._while_healthy(call, "POST /generate")
        data = self._json(content, "POST", "/generate")
        if not isinstance(data, Mapping):
            raise EngineError(f"engine at {self.base_url}: /generate answered a {type(data).__name__}, "
                              f"expected an object")
        return GenerateResult.from_sglang(data)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Cumulative partial results parsed from SGLang's SSE stream; the last one is finished.

        A mid-stream ``data: {"error": ...}`` event raises BadRequestError (code 400) or EngineError.
        """
        last: GenerateResult | None = None
        async with self._open("POST", "/generate", self._generate_body(req, stream=True), headers=_routing(req)) as resp:
            async for line in _lines(resp):
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, keep-alives
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    break
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    raise EngineError(f"engine at {self.base_url} sent a malformed stream event: "
                                      f"{payload[:200].decode('utf-8', 'replace')!r}") from None
                if "error" in event:
                    err = event["error"]
                    msg = str(err.get("message", err)) if isinstance(err, Mapping) else str(err)
                    code = err.get("code", 400) if isinstance(err, Mapping) else 400
                    if code == 400:
                        raise BadRequestError(msg)
                    raise EngineError(f"engine at {self.base_url} failed mid-stream "
                                      f"(code {code}): {msg}")
                last = GenerateResult.from_sglang(event)
                yield last
        if last is None or not last.finished:
            raise EngineError(f"engine at {self.base_url}: the stream of request {req.rid} ended before it finished")

    async def _while_healthy(self, call: asyncio.Future[T], what: str) -> T:
        """``call``'s result; every ``timeout_s`` it has not come, GET /health must answer 200 (within
        ``timeout_s``), else the call is given up (cancelled: its connection closes, and the
        server aborts the request) with EngineTimeoutError."""
        try:
            while not (await asyncio.wait({call}, timeout=self.timeout_s))[0]:
                if not await self.health():
                    raise EngineTimeoutError(f"engine at {self.base_url} has not answered {what}, and GET /health "
                                             f"did not answer healthy (asked every {self.timeout_s:g} s)")
            return call.result()
        finally:
            if not call.done():
                call.cancel()
                await asyncio.wait({call})

    async def model_info(self) -> dict[str, Any]:
        _, content = await self._request("GET", "/model_info")
        return self._json(content, "GET", "/model_info")

    async def learn_context_len(self) -> int | None:
        """The server's context from ``/server_info`` (SGLang's ``max_req_input_len`` + 1), kept as
        ``max_context_len`` so that a caller can refuse what does not fit before streaming; None if
        the server does not say or cannot be reached (its own refusal still comes per request)."""
        try:
            _, content = await self._request("GET", "/server_info")
            self.max_context_len = int(self._json(content, "GET", "/server_info")["max_req_input_len"]) + 1
        except (EngineError, BadRequestError, KeyError, TypeError, ValueError) as e:
            log.warning("engine at %s: no context length from /server_info (%s)", self.base_url, e)
        return self.max_context_len

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; False on 503 or when the server is unreachable."""
        try:
            status, _ = await self._request("GET", "/health", accept=(503,))  # 503: up, not healthy
        except (EngineError, BadRequestError) as e:
            log.warning("%s", e)
            return False
        return status == 200

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """Flush the server's caches; retry while it answers 400 (busy). False when it never succeeded."""
        for attempt in range(self.flush_retries + 1):
            status, content = await self._request("POST", "/flush_cache", accept=(400,))
            if status == 200:
                return True
            if attempt < self.flush_retries:
                await asyncio.sleep(self.flush_retry_interval_s)
        log.warning("engine at %s refused /flush_cache %d times: %s", self.base_url,
                    self.flush_retries + 1, error_message(status, content))
        return False

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                       flush_cache: bool = True, abort_all_requests: bool = False) -> UpdateResult:
        """Reload HF weights from ``model_path`` on the server; old weights keep serving on failure."""
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        answer = await self._request("POST", "/update_weights_from_disk", body, accept=(400,))
        return _update_result(*answer, weight_version)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> UpdateResult:
        """Relabel the served weights without touching them (SGLang's default aborts everything; we don't)."""
        answer = await self._request("POST", "/update_weight_version",
                                     {"new_version": str(new_version), "abort_all_requests": abort_all_requests},
                                     accept=(400,))
        return _update_result(*answer, new_version)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAUpdateResult:
        """Register the PEFT LoRA directory ``lora_path`` (on the server's machine) as ``lora_name``; requests then
        name it in ``lora_path``. No pause: the server keeps serving while it loads (SGLang's 400: not loaded)."""
        answer = await self._request("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)},
                                     accept=(400,))
        return _lora_result(*answer)

    async def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateResult:
        """Unregister ``lora_name``: later requests naming it are refused; those already running finish on it."""
        return _lora_result(*await self._request("POST", "/unload_lora_adapter", {"lora_name": lora_name},
                                                 accept=(400,)))

    async def sync_weights_from_disk(
        self, model_path: str, weight_version: str, pause_mode: PauseMode = "retract"
    ) -> UpdateResult:
        """Swap the served weights for the checkpoint at ``model_path`` without failing user requests.

        pause(``pause_mode``) -> flush_cache (retried) -> update_weights_from_disk -> continue (always,
        even after a failure: a paused server holds every user request) -> confirm via /model_info.
        The update is sent with ``flush_cache: false`` because the cache was flushed while paused;
        on SGLang 0.5.23 a post-load flush refused by still-running requests would report
        ``success: false`` although the new weights are live. With ``retract`` (0.5.23) in-flight
        requests resume on the new weights and report two ``weight_versions`` spans; use ``abort``
        on SGLang 0.5.15, where flushing after ``retract`` fails.

        Returns ``UpdateResult(success, message, weight_version=<what /model_info reports now>)``;
        success is False when the update failed or the reported version is not the expected one
        (``weight_version`` after success, the previous one after a failure).
        """
        before = str((await self.model_info()).get("weight_version"))
        try:
            await self.pause_generation(pause_mode)
            if await self.flush_cache():
                result = await self.update_weights_from_disk(model_path, weight_version, flush_cache=False)
            else:
                result = UpdateResult(False, f"not updated: /flush_cache still refused after "
                                             f"{self.flush_retries + 1} attempts while paused ({pause_mode})")
        finally:
            await self.continue_generation()
        now = str((await self.model_info()).get("weight_version"))
        expected = str(weight_version) if result.success else before
        if now != expected:
            return UpdateResult(False, f"{result.message} (but /model_info reports weight_version {now!r}, "
                                       f"expected {expected!r})", now, result.workers)
        return UpdateResult(result.success, result.message, now, result.workers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _routing(req: GenerateRequest) -> dict[str, str] | None:
    """The SGLang router's sticky-routing header for a request with a routing key (its
    consistent_hashing and manual policies keep one key on one worker)."""
    return {"X-SMG-Routing-Key": req.routing_key} if req.routing_key else None


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines, of any length (aiohttp's own line reader caps them at its buffer size, and
    a stream event with the log-probs of a long answer can be hundreds of KB)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buf:
        yield buf


def _lora_result(status: int, content: bytes) -> LoRAUpdateResult:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, Mapping) and "success" in body:
        return LoRAUpdateResult.from_sglang(body, status)
    return LoRAUpdateResult(False, error_message(status, content))  # e.g. a 400 validation error body


def _update_result(status: int, content: bytes, weight_version: str | None) -> UpdateResult:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    workers: tuple = ()
    if isinstance(body, Mapping) and "success" in body:
        ok = bool(body["success"]) and status == 200
        msg, workers = str(body.get("message", "")), tuple(body.get("workers") or ())
    else:  # e.g. a 400 validation error body: the update did not happen
        ok, msg = False, error_message(status, content)
    return UpdateResult(ok, msg, str(weight_version) if ok and weight_version is not None else None, workers)
