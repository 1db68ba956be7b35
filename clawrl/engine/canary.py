"""A canary: a share of sessions served by the newest trained version while the others get the champion.

With the promotion gate on, users are served the champion; a refused candidate is never served, so
the learner then trains on the champion's answers only and never sees a reward for its own mistakes.
:class:`CanaryRouter` sits where the gateway's engine goes and sends the generation requests of a
fixed share of sessions to a second engine that the train flow loads every new version into
(``[gate] canary_share`` / ``canary_url``):

* **Which requests.** A request's ``routing_key`` (the gateway's hash of namespace and session)
  picks a bucket in [0, 1); sessions whose bucket is below the share are canary sessions, the same
  ones on every request, so a conversation stays on its side. Only their main turns go to the
  canary (``main_turn``: answers the policy may learn from); side turns (an agent's maintenance
  calls, held-out evaluations) and requests without a key get the champion.
* **Only a newer version.** A canary session goes to the canary engine only while that engine holds
  a newer weight version than the main engine (a refused candidate); once a candidate is promoted
  both hold it and canary sessions go back to the main engine. The two versions are asked at most
  every ``refresh_s``.
* **Never a refused request.** A canary engine that does not answer (unreachable, or no version it
  can report) sends its sessions to the main engine: they get the champion for that request, and
  the canary is asked again after ``down_retry_s``.
* Everything else (weight sync, pause, the model's limits, health) is the main engine's: the
  gateway's ``/engine`` and a trainer's sync reach it as before.

Each turn records the version that answered it, so the judge, the trainer and ``learning_by_version``
see the canary's turns as the newer version's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from clawrl.engine.types import Engine, EngineUnreachableError, GenerateRequest, GenerateResult

log = logging.getLogger("clawrl.engine.canary")


def version_rank(version: str | None) -> int:
    """Order of weight versions: "0" < "1" < ...; a label that is not a number ranks -1."""
    return int(version) if version is not None and version.isdigit() else -1


def bucket(routing_key: str) -> float:
    """Where a session falls in [0, 1): its routing key (hex digits of a hash) read as a fraction."""
    return int(routing_key[:8], 16) / 16 ** 8


class CanaryRouter:
    """An Engine: ``main`` (the champion) for everything but the main turns of a ``share`` of sessions,
    which ``canary`` answers while it holds a newer version."""

    def __init__(self, main: Engine, canary: Engine, share: float, *, refresh_s: float = 1.0,
                 down_retry_s: float = 5.0):
        if not 0 <= share < 1:
            raise ValueError(f"canary share must be in [0, 1), got {share}")
        self.main, self.canary, self.share = main, canary, share
        self.refresh_s, self.down_retry_s = refresh_s, down_retry_s
        self._versions: tuple[str | None, str | None] = (None, None)
        self._checked = float("-inf")
        self._down_until = float("-inf")
        self._lock = asyncio.Lock()
        self.canary_requests = 0  # answered by the canary engine (for tests and `clawrl bench`)

    def __getattr__(self, name: str) -> Any:  # the main engine's limits, control calls and state
        if name in ("main", "canary"):  # not set yet (a copy under construction): never recurse
            raise AttributeError(name)
        return getattr(self.main, name)

    def is_canary_session(self, routing_key: str | None) -> bool:
        return routing_key is not None and bucket(routing_key) < self.share

    async def versions(self) -> tuple[str | None, str | None]:
        """(main, canary) weight versions, asked again once ``refresh_s`` has passed; None: no answer."""
        if time.monotonic() - self._checked < self.refresh_s:
            return self._versions
        async with self._lock:
            if time.monotonic() - self._checked >= self.refresh_s:
                self._versions = (await _version(self.main), await _version(self.canary))
                self._checked = time.monotonic()
        return self._versions

    async def _use_canary(self, req: GenerateRequest) -> bool:
        if not (req.main_turn and self.is_canary_session(req.routing_key)) or time.monotonic() < self._down_until:
            return False
        main, canary = await self.versions()
        return version_rank(canary) > version_rank(main)

    def _canary_failed(self, e: EngineUnreachableError) -> None:
        self._down_until = time.monotonic() + self.down_retry_s
        self._checked = float("-inf")  # its version may have changed when it comes back
        log.warning("canary engine unreachable (%s): its sessions get the main engine for %.0f s", e,
                    self.down_retry_s)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if await self._use_canary(req):
            try:
                res = await self.canary.generate(req)
                self.canary_requests += 1
                return res
            except EngineUnreachableError as e:
                self._canary_failed(e)
        return await self.main.generate(req)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        if await self._use_canary(req):
            last: GenerateResult | None = None
            try:
                async for last in self.canary.generate_stream(req):
                    yield last
                self.canary_requests += 1
                return
            except EngineUnreachableError as e:
                if last is not None:  # tokens already went out: a clean error, not a second answer
                    raise
                self._canary_failed(e)
        async for res in self.main.generate_stream(req):
            yield res

    async def close(self) -> None:
        await asyncio.gather(self.main.close(), self.canary.close())


async def _version(engine: Engine) -> str | None:
    try:
        return str((await engine.model_info()).get("weight_version"))
    except Exception:  # down or not answering: treated as holding nothing newer
        return None
