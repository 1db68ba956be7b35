"""Several engines behind one :class:`~clawrl.engine.types.Engine`: the policy engines (``[engine] urls``)
and the judge engines holding the initial weights (``[prm] engine_urls``; never synced, started on
the first request).

* **Routing.** A request's ``routing_key`` (the gateway sends one per session) stays on the engine
  that served it first, so that engine's prefix cache keeps the conversation; a new key goes to the
  engine with the fewest requests in flight. Requests without a key go to the least loaded engine
  (ties: the one that served fewer requests, so an idle pool takes turns).
* **Failures.** An engine whose connection fails (refused, reset, closed mid-body:
  :class:`EngineUnreachableError`) is taken out for ``down_retry_s`` and the request goes to another
  engine. Nobody saw an answer from the first one, and the gateway logs a turn only once it has an
  answer, so a retried request is one turn, never two. A stream that already sent tokens ends with
  the error instead. An engine at capacity (503) passes the request to the next one. When the
  retry time is over, the engine is asked its version and, when it came back with other weights
  (restarted), loads the served checkpoint before it gets traffic again.
* **Versions.** Every engine that takes traffic serves the pool's weight version, except during a
  sync, when the old and the new one both serve; a key never gets an answer from a version older
  than one it already got (it waits for an engine that has the newer one).
* **Weight sync.** The pool answers SGLang's control calls, so the gateway serves it under /engine
  and a trainer syncs it as it syncs one engine. ``pause_generation`` only notes the pause mode;
  ``update_weights_from_disk`` then updates the engines in ``sync_waves`` waves: each engine of a
  wave pauses, loads and resumes (SGLang's sequence) while the other waves' engines serve, and new
  keys go to those. ``sync_waves = 1`` pauses every engine at once instead. Held requests are
  never refused, in either mode. An engine that is out during a sync loads the checkpoint when it
  comes back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from clawrl.engine.types import (
    Engine,
    EngineError,
    EngineOverloadedError,
    EngineUnreachableError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    UpdateResult,
)

log = logging.getLogger("clawrl.engine.pool")


def version_rank(version: str | None) -> int:
    """Order of weight versions: "0" < "1" < ...; a label that is not a number ranks -1."""
    return int(version) if version is not None and version.isdigit() else -1


@dataclass(eq=False)
class Member:
    """One engine of the pool and what the pool knows of it."""

    url: str
    engine: Engine
    version: str | None = None  # the weight version it serves, as last seen
    in_flight: int = 0
    sessions: int = 0  # routing keys pinned to it
    down_until: float = 0.0  # out of rotation until then (monotonic clock); 0: in
    reviving: bool = False
    updating: bool = False
    requests: int = 0
    failures: int = 0
    last_error: str = ""

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.down_until == 0.0, "weight_version": self.version,
                "in_flight": self.in_flight, "sessions": self.sessions, "requests": self.requests, "failures": self.failures,
                "updating": self.updating, "last_error": self.last_error}


class EnginePool:
    def __init__(self, members: list[tuple[str, Engine]], *, sync_waves: int = 2, down_retry_s: float = 5.0,
                 version_wait_s: float = 60.0, max_keys: int = 100_000):
        if not members:
            raise ValueError("an engine pool needs at least one engine")
        self.members = [Member(url, engine) for url, engine in members]
        self.sync_waves, self.down_retry_s, self.version_wait_s = sync_waves, down_retry_s, version_wait_s
        self.max_keys = max_keys
        self._keys: collections.OrderedDict[str, tuple[Member, int]] = collections.OrderedDict()  # pin, newest rank
        self.version: str | None = None  # the version every engine in rotation serves
        self._serving: set[str] = set()  # versions allowed to serve: {version}, or {old, new} during a sync
        self._checkpoint: str | None = None  # what `version` was loaded from (to catch a returning engine up)
        self._pause_mode: PauseMode = "retract"
        self._changed = asyncio.Condition()
        self._starting = asyncio.Lock()
        self.max_context_len: int | None = None
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Ask every engine its weight version; the newest one is the pool's, and engines behind it
        stay out until a sync brings them to it."""
        infos = await asyncio.gather(*(m.engine.model_info() for m in self.members), return_exceptions=True)
        now = time.monotonic()
        for m, info in zip(self.members, infos):
            if isinstance(info, BaseException):
                self._take_out(m, info, now)
            else:
                m.version = str(info.get("weight_version"))
        known = [m.version for m in self.members if m.version is not None]
        if not known:
            raise EngineUnreachableError("no engine of the pool answers: " +
                                         "; ".join(f"{m.url}: {m.last_error}" for m in self.members))
        self.version = max(known, key=version_rank)
        self._serving = {self.version}
        behind = [m.url for m in self.members if m.version not in (None, self.version)]
        if behind:
            log.warning("engines %s serve other weights than version %s: out of rotation until a sync reaches them",
                        behind, self.version)

    async def learn_context_len(self) -> int | None:
        """The smallest context length among the engines that say theirs."""
        lens = await asyncio.gather(*(m.engine.learn_context_len() for m in self.members
                                      if hasattr(m.engine, "learn_context_len")), return_exceptions=True)
        known = [n for n in lens if isinstance(n, int)]
        self.max_context_len = min(known) if known else None
        return self.max_context_len

    async def close(self) -> None:
        await asyncio.gather(*(m.engine.close() for m in self.members), return_exceptions=True)

    def engine_states(self) -> list[dict[str, Any]]:
        """Each engine's URL, whether it is in rotation, its version, load and failures (metrics, /engine/model_info)."""
        return [m.stats() for m in self.members]

    # ---- routing ------------------------------------------------------------------------------

    def _take_out(self, m: Member, e: BaseException, now: float | None = None) -> None:
        m.failures += 1
        m.last_error = str(e)
        m.down_until = (now or time.monotonic()) + self.down_retry_s
        log.warning("engine %s taken out for %.0f s: %s", m.url, self.down_retry_s, e)

    def _eligible(self, m: Member, need: int) -> bool:
        """In rotation (never taken out, or revived: a time out that is over is not enough, the engine
        may have come back with other weights), serving an allowed version the key may get."""
        return m.down_until == 0.0 and m.version in self._serving and version_rank(m.version) >= need

    async def _pick(self, key: str | None, tried: list[Member]) -> Member:
        """The engine for ``key``: its pinned one while that one serves, else the least loaded one
        (engines being updated last); waits for an engine while none serves a version the key may get."""
        deadline = time.monotonic() + self.version_wait_s
        async with self._changed:
            while True:
                now = time.monotonic()
                for m in self.members:
                    if m.down_until and m.down_until <= now and not m.reviving:
                        m.reviving = True
                        task = asyncio.get_running_loop().create_task(self._revive(m))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                pin, need = self._keys.get(key, (None, -1)) if key else (None, -1)
                if pin is not None and pin not in tried and self._eligible(pin, need):
                    chosen = pin
                else:
                    ok = [m for m in self.members if m not in tried and self._eligible(m, need)]
                    chosen = min(ok, key=lambda m: (m.updating, m.in_flight, m.sessions, m.requests)) if ok else None
                if chosen is not None:
                    if key:
                        self._pin(key, chosen, need)
                    return chosen
                if all(m in tried or m.down_until > now for m in self.members) or now >= deadline:
                    raise self._none_serves(need, tried)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(1.0, deadline - now))

    def _none_serves(self, need: int, tried: list[Member]) -> EngineError:
        states = "; ".join(f"{m.url}: " + ("out: " + m.last_error if m.down_until > time.monotonic() or m in tried
                                           else f"serves version {m.version}") for m in self.members)
        if need >= 0 and not tried:
            return EngineError(f"no engine serves weight version {need} or newer, which this session already got "
                               f"({states})")
        return EngineUnreachableError(f"no engine of the pool answers ({states})")

    def _pin(self, key: str, m: Member, rank: int) -> None:
        before = self._keys.get(key)
        if before is None or before[0] is not m:
            m.sessions += 1
            if before is not None:
                before[0].sessions -= 1
        self._keys[key] = (m, rank)
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)[1][0].sessions -= 1

    def _served(self, key: str | None, m: Member, version: str) -> None:
        m.version = version
        if key:
            self._pin(key, m, max(version_rank(version), self._keys.get(key, (m, -1))[1]))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _revive(self, m: Member) -> None:
        """Bring an engine whose time out is over back: ask its version; load the pool's checkpoint
        when it serves other weights (restarted); out again for another while when it fails."""
        try:
            version = str((await m.engine.model_info()).get("weight_version"))
            if version not in self._serving and self._checkpoint is not None and self.version is not None:
                log.info("engine %s is back with version %s: loading version %s", m.url, version, self.version)
                res = await _load(m.engine, self._checkpoint, self.version, self._pause_mode)
                if not res.success:
                    raise EngineError(f"could not load version {self.version}: {res.message}")
                version = self.version
            m.version, m.down_until, m.last_error = version, 0.0, ""
            log.info("engine %s is back in rotation (version %s)", m.url, version)
        except Exception as e:  # still down: out for another while
            self._take_out(m, e)
        finally:
            m.reviving = False
            await self._notify()

    # ---- serving ------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        tried: list[Member] = []
        busy: list[EngineOverloadedError] = []
        while True:
            m = await self._next(req.routing_key, tried, busy)
            try:
                res = await m.engine.generate(req)
            except (EngineUnreachableError, EngineOverloadedError) as e:
                self._failed(m, e, tried, busy)
                continue
            finally:
                m.in_flight -= 1
            self._served(req.routing_key, m, res.weight_version)
            return res

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        tried: list[Member] = []
        busy: list[EngineOverloadedError] = []
        while True:
            m = await self._next(req.routing_key, tried, busy)
            last: GenerateResult | None = None
            try:
                async for last in m.engine.generate_stream(req):
                    yield last
            except (EngineUnreachableError, EngineOverloadedError) as e:
                self._failed(m, e, tried, busy)
                if last is not None:  # tokens already went out: a clean error, not a second answer
                    raise
                continue
            finally:
                m.in_flight -= 1
            if last is not None:
                self._served(req.routing_key, m, last.weight_version)
            return

    async def _next(self, key: str | None, tried: list[Member], busy: list[EngineOverloadedError]) -> Member:
        """The next engine to try, counted in flight (the caller's ``finally`` uncounts it); when none
        is left and the last ones were at capacity, their 503."""
        if self.version is None:  # a pool its owner never started (the judge's): ask the engines first
            async with self._starting:
                if self.version is None:
                    await self.start()
        try:
            m = await self._pick(key, tried)
        except EngineUnreachableError:
            if busy:
                raise busy[-1] from None  # every engine that answers is full: retry later, not "unreachable"
            raise
        m.in_flight += 1
        m.requests += 1
        return m

    def _failed(self, m: Member, e: EngineError, tried: list[Member], busy: list[EngineOverloadedError]) -> None:
        tried.append(m)
        if isinstance(e, EngineOverloadedError):
            busy.append(e)
        else:
            self._take_out(m, e)

    # ---- SGLang's control API, for the whole pool ---------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """The first engine in rotation's model info, with the pool's weight version and every engine's state."""
        now = time.monotonic()
        info: dict[str, Any] = {}
        for m in sorted(self.members, key=lambda m: m.down_until > now):
            try:
                info = dict(await m.engine.model_info())
                break
            except EngineError as e:
                self._take_out(m, e)
        if not info:
            raise EngineUnreachableError("no engine of the pool answers")
        return {**info, "weight_version": self.version, "engines": self.engine_states()}

    async def health(self) -> bool:
        return any(await asyncio.gather(*(_healthy(m.engine) for m in self.members)))

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._pause_mode = mode
        if self.sync_waves == 1:
            await self._each(self._in_rotation(), lambda e: e.pause_generation(mode))

    async def continue_generation(self) -> None:
        if self.sync_waves == 1:
            await self._each(self.members, lambda e: e.continue_generation())

    async def flush_cache(self) -> bool:
        if self.sync_waves == 1:
            return all(await self._each(self._in_rotation(), lambda e: e.flush_cache()))
        return True  # each wave flushes its engines' caches

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> UpdateResult:
        """Every engine that answers loads ``model_path`` as ``weight_version``: in waves (each engine
        paused, loaded, resumed by itself) or, with ``sync_waves = 1``, all at once inside the pause
        the caller holds. Success when every engine in rotation serves the new version; an engine that
        is out loads it when it comes back. A refused load stops before the next wave."""
        version = weight_version or self.version or "unknown"
        old = self.version
        targets = [m for m in self.members if m.down_until <= time.monotonic()]
        if not targets:
            return UpdateResult(False, "no engine of the pool answers", old)
        waves = [targets] if self.sync_waves == 1 else _split(targets, self.sync_waves)
        self._serving = {v for v in (old, version) if v is not None}
        failed: list[str] = []
        for wave in waves:
            failed += await self._update_wave(wave, model_path, version)
            if failed:
                break
        updated = [m for m in targets if m.version == version]
        if failed:  # the others still serve the old version: that one stays the pool's
            self._serving = {old} if old is not None else set()
            if updated and self._checkpoint is not None and old is not None:  # back to it, best effort
                await self._update_wave(updated, self._checkpoint, old)
        else:
            self.version, self._serving, self._checkpoint = version, {version}, model_path
        await self._notify()
        if failed:
            return UpdateResult(False, f"{len(updated)} of {len(targets)} engines load version {version}, serving "
                                f"stays on version {self.version}: " + "; ".join(failed), self.version)
        out = [m.url for m in self.members if m not in targets]
        note = f"; out (loads it when back): {', '.join(out)}" if out else ""
        return UpdateResult(True, f"{len(targets)} engines serve version {version} ({len(waves)} waves){note}",
                            version)

    async def _update_wave(self, wave: list[Member], model_path: str, version: str) -> list[str]:
        for m in wave:
            m.updating = True
        await self._notify()  # new keys go to the other waves' engines
        try:
            if self.sync_waves == 1:  # paused by the caller already
                results = await asyncio.gather(*(m.engine.update_weights_from_disk(model_path, version)
                                                 for m in wave), return_exceptions=True)
            else:
                results = await asyncio.gather(*(_load(m.engine, model_path, version, self._pause_mode)
                                                 for m in wave), return_exceptions=True)
        finally:
            for m in wave:
                m.updating = False
        failed = []
        for m, res in zip(wave, results):
            if isinstance(res, EngineUnreachableError):
                self._take_out(m, res)  # loads the checkpoint when it comes back
            elif isinstance(res, BaseException) or not res.success:
                failed.append(f"{m.url}: {res if isinstance(res, BaseException) else res.message}")
            else:
                m.version = version
        return failed

    def _in_rotation(self) -> list[Member]:
        now = time.monotonic()
        return [m for m in self.members if m.down_until <= now]

    async def _each(self, members: list[Member], call) -> list[Any]:
        return list(await asyncio.gather(*(call(m.engine) for m in members)))


async def _load(engine: Engine, model_path: str, version: str, mode: PauseMode) -> UpdateResult:
    """One engine's own pause -> load -> resume (SGLang's full sequence when the client has it)."""
    if hasattr(engine, "sync_weights_from_disk"):
        return await engine.sync_weights_from_disk(model_path, version, pause_mode=mode)
    await engine.pause_generation(mode)
    try:
        return await engine.update_weights_from_disk(model_path, version)
    finally:
        await engine.continue_generation()


async def _healthy(engine: Engine) -> bool:
    try:
        return bool(await engine.health())
    except EngineError:
        return False


def _split(members: list[Member], waves: int) -> list[list[Member]]:
    n = min(waves, len(members))
    return [members[i::n] for i in range(n)]
