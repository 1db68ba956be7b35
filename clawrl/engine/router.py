"""Several engines behind SGLang's own router (the PyPI package ``sglang-router``).

Routing, health checks, retries and session affinity are the router's: clawrl starts it with the
``manual`` policy, which keeps every ``X-SMG-Routing-Key`` (the gateway sends the session) on the
worker that served it first, so that worker's prefix cache keeps the conversation, and gives a new
key to the least loaded worker (``min_load``). The router's ``cache_aware`` policy matches request
*text*, and clawrl sends token ids, so it would not keep a session on one worker.

What the router does not do is load weights (version 0.3.2 answers 404 for
``/update_weights_from_disk`` and ``/pause_generation``): :class:`RoutedEngines` asks the router which
workers it has (``GET /workers``) and updates them one at a time, each paused, loaded and resumed by
itself (SGLang's sequence, :meth:`SGLangClient.sync_weights_from_disk`) while the others serve. A
request the router sends to the worker being loaded waits in that worker's queue for the load to end:
none is refused, and a session, which stays on its worker, never gets an answer from an older
version than one it already got.

LoRA adapters go the same way: :meth:`RoutedEngines.load_lora_adapter` registers an adapter on every
worker in turn (no pause: loading one stops no request), and takes it off those that loaded it when one
refuses, so a name means the same adapter wherever the router sends its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from clawrl.engine.sglang_client import SGLangClient
from clawrl.engine.types import (
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

# The router's policy (module docstring) and how it places a new session; a worker whose circuit opened
# (10 failed requests: it died) is tried again after CB_TIMEOUT_S, not the default 60, and health-checked
# every HEALTH_INTERVAL_S, so a restarted `clawrl engine` (seconds to load) takes traffic again soon after
# it answers.
CB_TIMEOUT_S, HEALTH_INTERVAL_S = 5, 5
ROUTER_POLICY = ("--policy", "manual", "--assignment-mode", "min_load", "--cb-timeout-duration-secs",
                 str(CB_TIMEOUT_S), "--health-check-interval-secs", str(HEALTH_INTERVAL_S))
# A worker that dies keeps its sessions in the router until its circuit breaker opens (after 5 failed
# attempts): the router's own retries pick the same worker again, so a request that met a dead worker
# and got no answer is sent again, RESEND_DELAY_S apart, and lands on a live one. When every worker's
# circuit is open or its health check failed (one died while another was restarting), the router answers
# "no available workers" at once; the first worker back takes requests within a circuit timeout and a
# health check, so resends go on that long before the 503 reaches the client.
RESEND_DELAY_S = 0.5
RESEND_WINDOW_S = CB_TIMEOUT_S + HEALTH_INTERVAL_S + 1
NO_WORKERS = "no available workers"  # the router's 503 when none can take a request now


def router_argv(worker_urls: list[str], host: str, port: int, metrics_port: int) -> list[str]:
    """The command that starts SGLang's router on ``host:port`` in front of ``worker_urls``.
    Its Prometheus exporter gets a port of its own: the default (29000) is one per machine, and a
    second router (the judge engines') would die on it."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, *ROUTER_POLICY, "--prometheus-host", host,
            "--prometheus-port", str(metrics_port), "--log-level", "warn"]


class RoutedEngines:
    """The :class:`~clawrl.engine.types.Engine` of the workers behind the router at ``router_url``:
    requests go through the router, weight updates to each worker (module docstring)."""

    def __init__(self, router_url: str, *, timeout_s: float = 120.0, api_key: str | None = None):
        self.url = router_url.rstrip("/")
        self.router = SGLangClient(self.url, timeout_s=timeout_s, api_key=api_key)
        self.timeout_s, self.api_key = timeout_s, api_key
        self.max_context_len: int | None = None
        self._clients: dict[str, SGLangClient] = {}
        self._pause_mode: PauseMode = "retract"
        self._loaded: tuple[str, str] | None = None  # (checkpoint path, version) every worker last loaded
        self.routed: bool | None = None  # a router with workers behind it (workers() learns it): resend what a dead one failed

    def _client(self, url: str) -> SGLangClient:
        if url not in self._clients:
            self._clients[url] = SGLangClient(url, timeout_s=self.timeout_s, api_key=self.api_key)
        return self._clients[url]

    async def workers(self) -> list[SGLangClient]:
        """A client per worker the router lists (``GET /workers``), in its order; a plain engine (SGLang
        or `clawrl engine`, which answer 404 there) is its own one worker."""
        status, content = await self.router._request("GET", "/workers", accept=(404,))
        if status == 404:
            self.routed = False
            return [self.router]
        urls = [w["url"] for w in self.router._json(content, "GET", "/workers").get("workers", [])]
        if not urls:
            raise EngineError(f"the router at {self.url} lists no workers")
        self.routed = True
        return [self._client(u) for u in urls]

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        deadline = time.monotonic() + RESEND_WINDOW_S
        for attempt in itertools.count(1):
            try:
                return await self.router.generate(req)
            except EngineError as e:
                await self._before_resend(e, attempt, deadline)
        raise AssertionError("unreachable")

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        deadline = time.monotonic() + RESEND_WINDOW_S
        for attempt in itertools.count(1):
            parts = self.router.generate_stream(req)
            try:
                try:
                    first = await anext(parts)
                except EngineError as e:  # nothing was answered yet: the request may go again
                    await self._before_resend(e, attempt, deadline)
                    continue
                yield first
                async for part in parts:
                    yield part
                return
            finally:  # a caller that stops reading closes the stream now: the engine stops generating
                await parts.aclose()

    async def _before_resend(self, e: EngineError, attempt: int, deadline: float) -> None:
        """Raise ``e`` unless it is a failure a resend can mend (module constants) and time is left:
        a worker that died, or none available for now; never a timeout or a full queue."""
        no_workers = isinstance(e, EngineOverloadedError) and NO_WORKERS in str(e).lower()
        if (time.monotonic() + RESEND_DELAY_S > deadline or isinstance(e, EngineTimeoutError)
                or (isinstance(e, EngineOverloadedError) and not no_workers)):
            raise e
        if self.routed is None:
            with contextlib.suppress(EngineError):
                await self.workers()
        if not self.routed:
            raise e
        log.warning("%s; sending the request again (%d)", e, attempt)
        await asyncio.sleep(RESEND_DELAY_S)

    async def model_info(self) -> dict[str, Any]:
        """The first worker's model info, with ``weight_version`` the oldest any worker serves (during
        an update some serve the new one already) and ``workers``: each worker's URL and version."""
        workers = await self.workers()
        infos = [await w.model_info() for w in workers]
        if len(infos) == 1 and workers[0] is self.router:
            return infos[0]
        versions = [str(info.get("weight_version")) for info in infos]
        oldest = min(versions, key=lambda v: int(v) if v.isdigit() else -1)
        return {**infos[0], "weight_version": oldest,
                "workers": [{"url": w.base_url, "weight_version": v} for w, v in zip(workers, versions)]}

    async def learn_context_len(self) -> int | None:
        """The smallest context any worker serves (the router's own /server_info does not say); None when
        nothing answers yet (the engine's own refusal still comes per request)."""
        try:
            workers = await self.workers()
        except EngineError as e:
            log.warning("no context length from %s yet: %s", self.url, e)
            return None
        lens = [await w.learn_context_len() for w in workers]
        self.max_context_len = min((n for n in lens if n), default=None)
        return self.max_context_len

    async def health(self) -> bool:
        return await self.router.health()

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._pause_mode = mode  # each worker pauses by itself, in turn, when it loads

    async def continue_generation(self) -> None:
        return None

    async def flush_cache(self) -> bool:
        return True  # each worker flushes its own while it is paused for its load

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       **_: Any) -> UpdateResult:
        """Every worker loads ``model_path`` as ``weight_version``, one at a time while the others serve
        (``workers`` of the result: each one's URL, outcome, version and seconds). A worker that refuses
        stops the update there, and those loaded before it go back to the last checkpoint this object
        loaded, so all serve one version; a worker the router lists that does not answer is passed over
        (the router stops sending it requests; `clawrl engine --resume` restarts it on the last version
        synced)."""
        version = str(weight_version) if weight_version is not None else "unknown"
        workers = await self.workers()
        if workers == [self.router]:  # a plain engine, or a gateway's /engine that reports its own workers
            return await self.router.sync_weights_from_disk(model_path, version, pause_mode=self._pause_mode)
        done = await _fan_out(workers, lambda w: _load(w, model_path, version, self._pause_mode))
        loaded = [d for d in done if d["ok"]]
        if loaded and len(loaded) == len(done) - sum(d["unreachable"] for d in done):
            self._loaded = (model_path, version)
            each = ", ".join(f"{d['url']} {d['seconds']:.2f} s" if d["ok"] else f"{d['url']} not answering"
                             for d in done)
            return UpdateResult(True, f"{len(loaded)} workers serve version {version} ({each})", version,
                                workers=tuple(done))
        if loaded and self._loaded is not None:  # one version for all: back to the last one loaded
            for d in loaded:
                back = await _load(self._client(d["url"]), *self._loaded, self._pause_mode)
                d["message"] += f"; back to version {self._loaded[1]}: {back['message']}"
        bad = next((d for d in done if not d["ok"]), None)
        why = f"{bad['url']} did not load it: {bad['message']}" if bad else "no worker answers"
        return UpdateResult(False, f"version {version} not served: {why}", None, workers=tuple(done))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAUpdateResult:
        """Every worker registers ``lora_name`` for ``lora_path``, one after another while all serve (``workers`` of
        the result: each one's URL, outcome and seconds). A worker that refuses stops it there and those that had
        loaded it unload it again; a worker that does not answer is passed over (its restart loads none)."""
        workers = await self.workers()
        if workers == [self.router]:
            return await self.router.load_lora_adapter(lora_name, lora_path)
        done = await _fan_out(workers, lambda w: _on_worker(w, w.load_lora_adapter(lora_name, lora_path)))
        bad = next((d for d in done if not d["ok"] and not d["unreachable"]), None)
        if bad is None and any(d["ok"] for d in done):
            return LoRAUpdateResult(True, "", done[-1]["loaded_adapters"], tuple(done))
        for d in done:
            if d["ok"]:  # one name, one adapter, on every worker
                back = await self._client(d["url"]).unload_lora_adapter(lora_name)
                d["message"] = f"unloaded again: {back.message or 'ok'}"
        why = f"{bad['url']} did not load it: {bad['message']}" if bad else "no worker answers"
        return LoRAUpdateResult(False, f"adapter {lora_name} not loaded: {why}", {}, tuple(done))

    async def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateResult:
        """Every worker unregisters ``lora_name`` (all are asked, whatever one answers); success when every worker
        that answers has unloaded it."""
        workers = await self.workers()
        if workers == [self.router]:
            return await self.router.unload_lora_adapter(lora_name)
        done = [await _on_worker(w, w.unload_lora_adapter(lora_name)) for w in workers]
        bad = [d for d in done if not d["ok"] and not d["unreachable"]]
        ok = not bad and any(d["ok"] for d in done)
        why = "" if ok else "; ".join(f"{d['url']}: {d['message']}" for d in bad) or "no worker answers"
        loaded = next((d["loaded_adapters"] for d in done if d["ok"]), {})
        return LoRAUpdateResult(ok, why, loaded, tuple(done))

    async def update_weight_version(self, new_version: str, **_: Any) -> UpdateResult:
        results = [await w.update_weight_version(new_version) for w in await self.workers()]
        bad = [r for r in results if not r.success]
        return bad[0] if bad else UpdateResult(True, f"{len(results)} workers relabelled", new_version)

    async def close(self) -> None:
        for c in [self.router, *self._clients.values()]:
            await c.close()


async def _fan_out(workers: list[SGLangClient], call) -> list[dict[str, Any]]:
    """``call(worker)`` (a row, as :func:`_on_worker` makes it) on each worker in turn, stopping at the first that
    refuses; one that does not answer is passed over."""
    done: list[dict[str, Any]] = []
    for w in workers:
        done.append(await call(w))
        if not done[-1]["ok"] and not done[-1]["unreachable"]:
            break
    return done


async def _on_worker(worker: SGLangClient, call) -> dict[str, Any]:
    """The awaited ``call`` on ``worker`` (an UpdateResult or LoRAUpdateResult) as a row of the result's ``workers``."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"url": worker.base_url}
    try:
        res = await call
        ok, message, unreachable = res.success, res.message, False
        if isinstance(res, LoRAUpdateResult):
            row["loaded_adapters"] = res.loaded_adapters
    except EngineError as e:
        ok, message, unreachable = False, str(e), isinstance(e, EngineUnreachableError)
    return {**row, "ok": ok, "unreachable": unreachable, "message": message,
            "seconds": round(time.perf_counter() - t0, 3)}


async def _load(worker: SGLangClient, model_path: str, version: str, mode: PauseMode) -> dict[str, Any]:
    """One worker's pause -> load -> resume, as a row of the update's ``workers``."""
    row = await _on_worker(worker, worker.sync_weights_from_disk(model_path, version, pause_mode=mode))
    return {**row, "weight_version": version if row["ok"] else None}
