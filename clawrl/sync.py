"""Push new weights to the serving engine without rejecting a single request.

* In-process embedded engine: pause (retract) -> copy the trainer's state dict into the served
  parameters -> continue. Requests in flight are re-prefilled on the new weights and keep going in
  the same call; requests that arrive meanwhile are held, never refused.
* HTTP engine (SGLang, or ``clawrl engine``): pause -> flush -> ``update_weights_from_disk`` ->
  continue, through :meth:`SGLangClient.sync_weights_from_disk`.

:func:`sync_checkpoint` picks the target (the one both the train flow and ``clawrl sync`` use).
A failed sync never raises and never leaves the engine paused: the report says what failed and
which version the engine serves afterwards (the previous one), and the failure is logged on the
``clawrl.sync`` logger at ERROR. Failures covered: a checkpoint whose bytes are not the ones the
trainer recorded (``expected_sha256``: truncated, garbled or missing, checked before the engine
is touched; for the promotion gate's engine, which serves nobody, while it loads), an engine that refuses the load (``success: false``: a path it cannot see, a shape
mismatch), and an engine that stops answering mid-update (killed while paused or loading). The
caller records every attempt (``syncs`` table) and retries with the same or the next checkpoint.

Every path is idempotent: an engine already serving the target version is left alone.

A namespace's LoRA adapter (``[ppo] adapters = "namespace"``) syncs without a pause (:func:`sync_adapter`): every
worker loads the new version under its own name beside the old one, the gateway switches the namespace to it,
and the old one is unloaded (:func:`unload_adapter`); every other namespace is served throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from clawrl.checkpoint import CheckpointError, verify_checkpoint
from clawrl.engine.types import BadRequestError, Engine, EngineError, PauseMode, UpdateResult
from clawrl.records import utcnow

log = logging.getLogger("clawrl.sync")

NO_ENGINE = ("no serving engine to sync (none in this process, no [engine] url and no `clawrl serve` "
             "is running on this data root)")


@dataclass(frozen=True)
class SyncReport:
    success: bool
    message: str
    weight_version: str | None  # what the engine serves afterwards; None when it did not answer
    seconds: float
    skipped: bool = False
    target: str | None = None  # "in-process" or the engine's URL; None when there was none to sync
    checkpoint_path: str | None = None  # what the engine loaded; None for a state-dict copy
    started_at: datetime | None = None
    workers: tuple[dict[str, Any], ...] = ()  # several workers behind a router: each one's outcome


async def _version_or_none(engine: Engine) -> str | None:
    try:
        return str((await engine.model_info()).get("weight_version"))
    except Exception:  # the engine is down: nobody knows what it will serve when it comes back
        return None


def _failed(weight_version: str, reason: str, serving: str | None, t0: float) -> SyncReport:
    log.error("weight sync to version %s failed: %s; engine serves %s", weight_version, reason,
              "an unknown version (no answer)" if serving is None else f"version {serving}")
    return SyncReport(False, reason, serving, time.perf_counter() - t0)


async def _paused(engine: Engine, pause_mode: PauseMode, update: Callable[[], Awaitable[UpdateResult]]) -> UpdateResult:
    await engine.pause_generation(pause_mode)
    try:
        return await update()
    finally:
        await engine.continue_generation()  # always resume, also after a failed load


async def _sync(engine: Engine, weight_version: str, update: Callable[[], Awaitable[UpdateResult]]) -> SyncReport:
    """Run ``update`` unless the engine already serves ``weight_version``; a success needs the
    engine to report the new version afterwards."""
    t0 = time.perf_counter()
    try:
        if str((await engine.model_info()).get("weight_version")) == weight_version:
            return SyncReport(True, "already serving this version", weight_version, 0.0, skipped=True)
        res = await update()
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as e:  # corrupt checkpoint, engine unreachable or killed mid-update
        serving = await _version_or_none(engine)
        reason = str(e) if isinstance(e, (EngineError, CheckpointError)) else f"{type(e).__name__}: {e}"
        if serving is None and not isinstance(e, CheckpointError):
            reason = f"the engine stopped answering during the update ({reason})"
        return _failed(weight_version, reason, serving, t0)
    serving = await _version_or_none(engine)
    if not res.success or serving != str(weight_version):
        reason = res.message if not res.success else f"{res.message} (but the engine reports version {serving})"
        return replace(_failed(weight_version, reason or "the engine refused the update", serving, t0),
                       workers=res.workers)
    return SyncReport(True, res.message, serving, time.perf_counter() - t0, workers=res.workers)


async def sync_state_dict(engine: Engine, state_dict: dict[str, Any], weight_version: str,
                          pause_mode: PauseMode = "retract") -> SyncReport:
    """Copy ``state_dict`` into an in-process engine's served parameters as ``weight_version``: its worker
    pauses in ``pause_mode``, copies and continues in one call."""
    return await _sync(engine, weight_version, lambda: engine.update_weights_from_state_dict(
        state_dict, weight_version, pause_mode=pause_mode))


async def sync_from_disk(engine: Engine, checkpoint_dir: str, weight_version: str,
                         pause_mode: PauseMode = "retract", expected_sha256: str | None = None,
                         check_beside: bool = False) -> SyncReport:
    """Load ``checkpoint_dir`` into ``engine`` as ``weight_version``; with ``expected_sha256`` the
    weights file is checked first, so a corrupt checkpoint is never offered to the engine.

    ``check_beside``, for an engine that serves nobody (the promotion gate's): the check runs while the
    engine loads (both read the file at once, ~0.6 s saved for 1.2 GB on the GPU host), and a mismatch
    fails the sync afterwards and relabels the engine's weights as unverified, so nothing measures
    them and the next sync of that version loads it again."""
    if not (check_beside and expected_sha256):
        return await _sync(engine, weight_version, lambda: _load(engine, checkpoint_dir, weight_version, pause_mode,
                                                                 expected_sha256))
    t0 = time.perf_counter()
    check = asyncio.ensure_future(asyncio.to_thread(verify_checkpoint, checkpoint_dir, expected_sha256))
    try:
        rep = await _sync(engine, weight_version, lambda: _load(engine, checkpoint_dir, weight_version, pause_mode))
    finally:
        checked = await asyncio.gather(check, return_exceptions=True)
    if isinstance(err := checked[0], BaseException):
        with contextlib.suppress(Exception):  # an engine that is down loads it again anyway
            await engine.update_weight_version(f"{weight_version}-unverified")
        reason = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        return _failed(weight_version, reason, await _version_or_none(engine), t0)
    return rep


async def _load(engine: Engine, checkpoint_dir: str, weight_version: str, pause_mode: PauseMode,
                expected_sha256: str | None = None) -> UpdateResult:
    if expected_sha256:
        await asyncio.to_thread(verify_checkpoint, checkpoint_dir, expected_sha256)
    if hasattr(engine, "sync_weights_from_disk"):  # SGLangClient: the full SGLang sequence
        return await engine.sync_weights_from_disk(checkpoint_dir, weight_version, pause_mode=pause_mode)
    load = engine.update_weights_from_disk
    return await _paused(engine, pause_mode, lambda: load(checkpoint_dir, weight_version))


async def sync_checkpoint(weight_version: str, path: str, sha256: str, *, engine: Engine | None = None,
                          trainer: Any = None, url: str | None = None, admin_key: str | None = None,
                          timeout_s: float = 600.0) -> SyncReport:
    """Serve checkpoint ``path`` (weights recorded with ``sha256``) as ``weight_version``.

    The target is the in-process ``engine`` when there is one - from the in-memory ``trainer``'s
    state dict when it holds that version, else from disk - otherwise the HTTP engine at ``url``,
    called with ``admin_key`` (the gateway's /engine and a keyed SGLang take only an admin key).
    With neither, the report is a skipped failure saying so. The report names the target, the
    checkpoint path loaded and when the attempt started, for the caller's record of it."""
    started_at = utcnow()
    if engine is not None:
        target = "in-process"
        if trainer is not None and trainer.weight_version == weight_version:
            rep, path = await sync_state_dict(engine, trainer.state_dict(), weight_version), None
        else:  # the trainer moved on or lives elsewhere: load the checkpoint from disk
            rep = await sync_from_disk(engine, path, weight_version, expected_sha256=sha256)
    elif url:  # an engine, a router in front of several (each worker loads it), or a gateway's /engine
        from clawrl.engine.router import RoutedEngines

        target, client = url, RoutedEngines(url, timeout_s=timeout_s, api_key=admin_key)
        try:
            rep = await sync_from_disk(client, path, weight_version, expected_sha256=sha256)
        finally:
            await client.close()
    else:
        return SyncReport(False, NO_ENGINE, None, 0.0, skipped=True)
    return replace(rep, target=target, checkpoint_path=path, started_at=started_at)


@contextlib.asynccontextmanager
async def _adapter_target(engine: Engine | None, url: str | None, admin_key: str | None, timeout_s: float):
    """(the target's name, what loads an adapter on every serving worker): the in-process ``engine``, else
    the HTTP engine or router at ``url`` (``RoutedEngines``: each worker the router lists); (None, None)
    with neither."""
    if engine is not None:
        yield "in-process", engine
    elif not url:
        yield None, None
    else:
        from clawrl.engine.router import RoutedEngines

        routed = RoutedEngines(url, timeout_s=timeout_s, api_key=admin_key)
        try:
            yield url, routed
        finally:
            await routed.close()


async def _call(target: Any, method: str, *args: str) -> tuple[bool, str, tuple[dict[str, Any], ...]]:
    """(ok, message, one row per worker) of ``target.<method>(*args)``; an engine that cannot is a failure."""
    try:
        res = await getattr(target, method)(*args)
    except (EngineError, BadRequestError) as e:
        return False, str(e), ()
    except AttributeError:  # an in-process engine without multi-LoRA serving
        return False, f"{type(target).__name__} does not serve LoRA adapters", ()
    return bool(res.success), str(res.message or ""), tuple(getattr(res, "workers", ()) or ())


async def sync_adapter(name: str, path: str, sha256: str, *, engine: Engine | None = None, url: str | None = None,
                       admin_key: str | None = None, timeout_s: float = 600.0) -> SyncReport:
    """Load the LoRA adapter at ``path`` (its weights recorded with ``sha256``) as ``name`` into every serving
    worker: the in-process ``engine``, else each worker behind the HTTP engine or router at ``url``
    (``load_lora_adapter``, SGLang's ``/load_lora_adapter``, which a router client makes on every worker and
    takes back from those that loaded it when one refuses). Nothing pauses: every other namespace is served
    throughout. The adapter's bytes are checked before any engine sees them. The report's ``weight_version``
    is ``name`` once every worker holds it (None otherwise); the caller then switches the namespace to it
    (``clawrl.adapters.write_served``) and unloads the previous version (:func:`unload_adapter`). Like every
    sync here it never raises for a failure: the report says it."""
    from clawrl.adapters import verify_adapter

    started_at, t0 = utcnow(), time.perf_counter()
    try:
        await asyncio.to_thread(verify_adapter, path, sha256)
    except CheckpointError as e:
        log.error("adapter %s not synced: %s", name, e)
        return SyncReport(False, str(e), None, time.perf_counter() - t0, target=url or None, checkpoint_path=path,
                          started_at=started_at)
    async with _adapter_target(engine, url, admin_key, timeout_s) as (target, loader):
        if loader is None:
            return SyncReport(False, NO_ENGINE, None, 0.0, skipped=True, checkpoint_path=path, started_at=started_at)
        ok, message, workers = await _call(loader, "load_lora_adapter", name, path)
    common = dict(target=target, checkpoint_path=path, started_at=started_at, workers=workers)
    if not ok:
        log.error("adapter %s not synced to %s: %s", name, target, message)
        return SyncReport(False, f"{target} did not load {name}: {message}", None, time.perf_counter() - t0, **common)
    n = max(1, sum(bool(w.get("ok")) for w in workers))
    return SyncReport(True, f"{n} worker{'s hold' if n > 1 else ' holds'} {name}", name, time.perf_counter() - t0,
                      **common)


async def unload_adapter(name: str, *, engine: Engine | None = None, url: str | None = None,
                         admin_key: str | None = None, timeout_s: float = 600.0) -> SyncReport:
    """Unload the adapter ``name`` from every serving worker (a namespace's previous version, once the
    gateway sends the new one; a forgotten namespace's). A failure is logged at WARNING: an adapter left
    loaded serves no one, since no namespace is sent to it any more."""
    started_at, t0 = utcnow(), time.perf_counter()
    async with _adapter_target(engine, url, admin_key, timeout_s) as (target, loader):
        if loader is None:
            return SyncReport(False, NO_ENGINE, None, 0.0, skipped=True, started_at=started_at)
        ok, message, workers = await _call(loader, "unload_lora_adapter", name)
    if not ok:
        log.warning("adapter %s not unloaded from %s: %s", name, target, message)
    return SyncReport(ok, f"{name} unloaded" if ok else f"{name} not unloaded: {message}", None,
                      time.perf_counter() - t0, target=target, started_at=started_at, workers=workers)
