"""The :class:`~clawrl.engine.types.Engine` protocol over SGLang's native HTTP API.

Talks to a real SGLang server (0.5.23 semantics, degrading to 0.5.15 as in shared/ref/sglang.md
§9) or to ``clawrl engine`` (clawrl/engine/server.py), which answers the same contract.

Transport: ``/generate`` (the hot path, one call per served turn) goes through clawrl's own small
HTTP/1.1 client (:mod:`clawrl.engine.http1`); everything else through httpx. httpx's connection
pool re-checks every pooled connection (a poll and a getpeername system call each) whenever a
request starts or ends, which with 16 requests in flight cost the gateway ~2 ms of CPU per turn;
aiohttp, used before, cost twice the CPU of http1 per call (docs/benchmarks.md, gateway overhead).

Error mapping: HTTP 400 in any of SGLang's three error shapes -> :class:`BadRequestError` with the
server's message; connection failures, timeouts, 5xx and other unexpected statuses ->
:class:`EngineError` (:class:`EngineTimeoutError` for timeouts) whose message names the URL and
what happened. The weight-update calls report failure as ``UpdateResult(success=False)`` instead,
because SGLang answers a failed update with 400 and a ``{"success": false}`` body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import orjson

from clawrl.engine import http1
from clawrl.engine.types import (
    BadRequestError,
    EngineError,
    EngineTimeoutError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    UpdateResult,
)

log = logging.getLogger(__name__)


def parse_error_message(resp: httpx.Response) -> str:
    """The human message of an SGLang error body, whichever of its shapes (ref §1) it uses:
    ``{"error": "..."}``, ``{"error": {"message": ...}}``, ``{"object": "error", "message": ...}``,
    ``{"success": false, "message": ...}`` or plain text (``/flush_cache``)."""
    return error_message(resp.status_code, resp.content)


def error_message(status: int, content: bytes) -> str:
    """:func:`parse_error_message` for a status and raw body."""
    text = content.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or f"HTTP {status}"
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, Mapping) and err.get("message") is not None:
            return str(err["message"])
        if body.get("message") is not None:
            return str(body["message"])
        if body.get("detail") is not None:  # a plain FastAPI HTTPException (e.g. a proxy in between)
            return str(body["detail"])
    return text.strip() or f"HTTP {status}"


def _connect_failure_reason(e: BaseException) -> str:
    """'connection refused' when that is the root cause (httpx only says 'All connection attempts failed')."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        seen = seen.__cause__ or seen.__context__
    return str(e) or type(e).__name__


class _Generate:
    """``async with``: one POST /generate; the answer once it is 2xx, else the mapped error
    (400 -> BadRequestError, others -> EngineError naming the URL and status). Transport failures
    inside the block become EngineError / EngineTimeoutError too."""

    def __init__(self, client: SGLangClient, exchange: http1.Exchange):
        self.client, self.exchange = client, exchange

    async def __aenter__(self) -> http1.Exchange:
        c, ex = self.client, self.exchange
        try:
            await ex.__aenter__()
        except http1.HTTPError as e:
            raise c._generate_error(e) from e
        if ex.status >= 300:
            try:
                content = await ex.read()
            except http1.HTTPError as e:
                content = str(e).encode()
            finally:
                await ex.__aexit__(None, None, None)
            msg = error_message(ex.status, content)
            if ex.status == 400:
                raise BadRequestError(msg)
            raise EngineError(f"engine at {c.base_url} answered HTTP {ex.status} on POST /generate: {msg}")
        return ex

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.exchange.__aexit__(exc_type, exc, tb)
        if isinstance(exc, http1.HTTPError):  # raised while reading the body
            raise self.client._generate_error(exc) from exc


class SGLangClient:
    """Async client for one SGLang-compatible server (or router) at ``base_url``.

    One instance belongs to one event loop (it holds an ``httpx.AsyncClient``); ``close`` it when
    done. ``flush_retries`` / ``flush_retry_interval_s``: how long :meth:`flush_cache` keeps asking
    while the server answers 400 busy (slime: 60 × 1 s).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        api_key: str | None = None,
        flush_retries: int = 60,
        flush_retry_interval_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")  # a trailing slash must not produce '//generate'
        self.timeout_s = timeout_s
        self.flush_retries = flush_retries
        self.flush_retry_interval_s = flush_retry_interval_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool = http1.Pool(self.base_url, headers=headers, timeout_s=timeout_s)  # POST /generate
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            headers=headers,
            transport=transport,
            # RL rollouts keep many requests in flight; httpx's default pool of 100 would queue them
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )
        self._has_update_session: bool | None = None  # False once /begin_weight_update answered 404

    # ------------------------------------------------------------------ plumbing

    def _transport_error(self, e: httpx.HTTPError, method: str, path: str) -> EngineError:
        where = f"engine at {self.base_url}"
        if isinstance(e, httpx.TimeoutException):
            return EngineTimeoutError(f"{where} timed out after {self.timeout_s:g} s on {method} {path}")
        if isinstance(e, httpx.ConnectError):
            return EngineError(f"{where} unreachable: {_connect_failure_reason(e)}")
        return EngineError(f"{where} failed on {method} {path}: {type(e).__name__}: {e}")

    def _status_error(self, resp: httpx.Response, method: str, path: str) -> Exception:
        msg = parse_error_message(resp)
        if resp.status_code == 400:
            return BadRequestError(msg)
        return EngineError(f"engine at {self.base_url} answered HTTP {resp.status_code} on {method} {path}: {msg}")

    async def _request(
        self, method: str, path: str, json_body: Any = None, *, accept: tuple[int, ...] = ()
    ) -> httpx.Response:
        """Send one request; statuses other than 2xx and ``accept`` raise (see module docstring)."""
        try:
            resp = await self._http.request(method, path, json=json_body)
        except httpx.HTTPError as e:
            raise self._transport_error(e, method, path) from e
        if resp.is_success or resp.status_code in accept:
            return resp
        raise self._status_error(resp, method, path)

    def _json(self, resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise EngineError(f"engine at {self.base_url} answered {resp.request.method} {resp.request.url.path} "
                              f"with non-JSON: {resp.text[:200]!r}") from None

    # ------------------------------------------------------------------ generation

    def _generate_body(self, req: GenerateRequest, stream: bool) -> dict[str, Any]:
        body = req.to_sglang()
        body["stream"] = stream
        if req.text is not None:
            body["return_prompt_token_ids"] = True  # so the result carries the tokenized prompt, as in-process
        return body

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        async with self._post_generate(req, stream=False) as resp:
            content = await resp.read()
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise EngineError(f"engine at {self.base_url} answered POST /generate with non-JSON: "
                              f"{content[:200].decode('utf-8', 'replace')!r}") from None
        if not isinstance(data, Mapping):
            raise EngineError(f"engine at {self.base_url}: /generate answered a {type(data).__name__}, "
                              f"expected an object")
        return GenerateResult.from_sglang(data)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Cumulative partial results parsed from SGLang's SSE stream; the last one is finished.

        A mid-stream ``data: {"error": ...}`` event raises BadRequestError (code 400) or EngineError.
        """
        last: GenerateResult | None = None
        async with self._post_generate(req, stream=True) as resp:
            async for line in self._lines(resp):
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
                    raise self._stream_error(event["error"])
                last = GenerateResult.from_sglang(event)
                yield last
        if last is None or not last.finished:
            raise EngineError(f"engine at {self.base_url}: the stream of request {req.rid} ended before it finished")

    def _post_generate(self, req: GenerateRequest, stream: bool) -> _Generate:
        return _Generate(self, self._pool.post("/generate", orjson.dumps(self._generate_body(req, stream))))

    async def _lines(self, resp: http1.Exchange) -> AsyncIterator[bytes]:
        """The body's lines, of any length (a stream event with the log-probs of a long answer
        can be hundreds of KB)."""
        buf = b""
        async for chunk in resp.chunks():
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if buf:
            yield buf

    def _generate_error(self, e: http1.HTTPError) -> EngineError:
        where = f"engine at {self.base_url}"
        if isinstance(e, TimeoutError):
            return EngineTimeoutError(f"{where} timed out after {self.timeout_s:g} s on POST /generate")
        if isinstance(e, http1.ConnectFailed):
            return EngineError(f"{where} unreachable: {_connect_failure_reason(e)}")
        return EngineError(f"{where} failed on POST /generate: {e}")

    def _stream_error(self, err: Any) -> Exception:
        if isinstance(err, Mapping):
            msg, code = str(err.get("message", err)), err.get("code", 400)
        else:
            msg, code = str(err), 400
        if code == 400:
            return BadRequestError(msg)
        return EngineError(f"engine at {self.base_url} failed mid-stream (code {code}): {msg}")

    # ------------------------------------------------------------------ information

    async def model_info(self) -> dict[str, Any]:
        return self._json(await self._request("GET", "/model_info"))

    async def server_info(self) -> dict[str, Any]:
        return self._json(await self._request("GET", "/server_info"))

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; False on 503 or when the server is unreachable."""
        try:
            resp = await self._http.get("/health")
        except httpx.HTTPError as e:
            log.warning("%s", self._transport_error(e, "GET", "/health"))
            return False
        return resp.status_code == 200

    # ------------------------------------------------------------------ control

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """Flush the server's caches; retry while it answers 400 (busy). False when it never succeeded."""
        for attempt in range(self.flush_retries + 1):
            resp = await self._request("POST", "/flush_cache", accept=(400,))
            if resp.status_code == 200:
                return True
            if attempt < self.flush_retries:
                await asyncio.sleep(self.flush_retry_interval_s)
        log.warning("engine at %s refused /flush_cache %d times: %s", self.base_url,
                    self.flush_retries + 1, parse_error_message(resp))
        return False

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateResult:
        """Reload HF weights from ``model_path`` on the server; old weights keep serving on failure."""
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        resp = await self._request("POST", "/update_weights_from_disk", body, accept=(400,))
        return self._update_result(resp, weight_version)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> UpdateResult:
        """Relabel the served weights without touching them (SGLang's default aborts everything; we don't)."""
        resp = await self._request("POST", "/update_weight_version",
                                   {"new_version": str(new_version), "abort_all_requests": abort_all_requests},
                                   accept=(400,))
        return self._update_result(resp, new_version)

    async def begin_weight_update(self, selector: str = "all") -> UpdateResult:
        """Open an update session (SGLang >= 0.5.21). On 404 the server predates sessions: remember
        it and make this and :meth:`end_weight_update` no-ops from then on."""
        return await self._update_session("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> UpdateResult:
        return await self._update_session("/end_weight_update", {})

    async def _update_session(self, path: str, body: dict[str, Any]) -> UpdateResult:
        if self._has_update_session is False:
            return UpdateResult(True, f"skipped {path}: the server predates weight update sessions (SGLang < 0.5.21)")
        resp = await self._request("POST", path, body, accept=(400, 404))
        if resp.status_code == 404:
            self._has_update_session = False
            log.info("engine at %s has no %s: treating it as SGLang < 0.5.21", self.base_url, path)
            return UpdateResult(True, f"skipped {path}: the server predates weight update sessions (SGLang < 0.5.21)")
        self._has_update_session = True
        return self._update_result(resp, None)

    @staticmethod
    def _update_result(resp: httpx.Response, weight_version: str | None) -> UpdateResult:
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, Mapping) and "success" in body:
            ok = bool(body["success"]) and resp.status_code == 200
            msg = str(body.get("message", ""))
        else:  # e.g. a 400 validation error body: the update did not happen
            ok, msg = False, parse_error_message(resp)
        return UpdateResult(ok, msg, str(weight_version) if ok and weight_version is not None else None)

    async def sync_weights_from_disk(
        self, model_path: str, weight_version: str, pause_mode: PauseMode = "retract"
    ) -> UpdateResult:
        """Swap the served weights for the checkpoint at ``model_path`` without failing user requests.

        pause(``pause_mode``) -> flush_cache (retried) -> update_weights_from_disk -> continue (always,
        even after a failure: a paused server holds every user request) -> confirm via /model_info.
        The update is sent with ``flush_cache: false`` because the cache was flushed while paused
        (ref §9); on SGLang 0.5.23 a post-load flush refused by still-running requests would report
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
                                       f"expected {expected!r})", now)
        return UpdateResult(result.success, result.message, now)

    async def close(self) -> None:
        await self._pool.close()
        await self._http.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
