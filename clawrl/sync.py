"""Push new weights to the serving engine without rejecting a single request.

* In-process embedded engine: pause (retract) -> copy the trainer's state dict into the served
  parameters -> continue. Requests in flight are re-prefilled on the new weights and keep going in
  the same call; requests that arrive meanwhile are held, never refused.
* HTTP engine (SGLang, or ``clawrl engine``): pause -> flush -> ``update_weights_from_disk`` ->
  continue, through :meth:`SGLangClient.sync_weights_from_disk` (ref/sglang.md §4.4).

A failed sync never raises and never leaves the engine paused: the report says what failed and
which version the engine serves afterwards (the previous one), and the failure is logged on the
``clawrl.sync`` logger at ERROR. Failures covered: a checkpoint whose bytes are not the ones the
trainer recorded (``expected_sha256``: truncated, garbled or missing, checked before the engine
is touched), an engine that refuses the load (``success: false``: a path it cannot see, a shape
mismatch), and an engine that stops answering mid-update (killed while paused or loading). The
caller records every attempt (``syncs`` table) and retries with the same or the next checkpoint.

Both paths are idempotent: an engine already serving the target version is left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawrl.engine.types import Engine, EngineError, UpdateResult

log = logging.getLogger("clawrl.sync")

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class SyncReport:
    success: bool
    message: str
    weight_version: str | None  # what the engine serves afterwards; None when it did not answer
    seconds: float
    skipped: bool = False


class CheckpointError(RuntimeError):
    """The checkpoint on disk is not the one the trainer recorded."""


def verify_checkpoint(checkpoint_dir: str | Path, expected_sha256: str) -> None:
    """Raise CheckpointError unless ``<checkpoint_dir>/model.safetensors`` has ``expected_sha256``
    (the sync before offering it to an engine, the trainer before resuming from it)."""
    from clawrl.train.trainer import file_sha256

    path = Path(checkpoint_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {WEIGHTS_FILE} is missing")
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {WEIGHTS_FILE} is corrupt (sha256 {actual[:12]}..., "
                              f"{path.stat().st_size} bytes; the trainer recorded {expected_sha256[:12]}...)")


async def _serving_version(engine: Engine) -> str:
    return str((await engine.model_info()).get("weight_version"))


async def _version_or_none(engine: Engine) -> str | None:
    try:
        return await _serving_version(engine)
    except Exception:  # the engine is down: nobody knows what it will serve when it comes back
        return None


def _failed(weight_version: str, reason: str, serving: str | None, t0: float) -> SyncReport:
    log.error("weight sync to version %s failed: %s; engine serves %s", weight_version, reason,
              "an unknown version (no answer)" if serving is None else f"version {serving}")
    return SyncReport(False, reason, serving, time.perf_counter() - t0)


def _error_text(e: BaseException) -> str:
    return str(e) if isinstance(e, (EngineError, CheckpointError)) else f"{type(e).__name__}: {e}"


async def sync_state_dict(engine: Engine, state_dict: dict[str, Any], weight_version: str,
                          pause_mode: str = "retract") -> SyncReport:
    t0 = time.perf_counter()
    try:
        if await _serving_version(engine) == weight_version:
            return SyncReport(True, "already serving this version", weight_version, 0.0, skipped=True)
        await engine.pause_generation(pause_mode)
        try:
            res: UpdateResult = await engine.update_weights_from_state_dict(  # type: ignore[attr-defined]
                state_dict, weight_version)
        finally:
            await engine.continue_generation()  # always resume, also after a failed load
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as e:
        return _failed(weight_version, _error_text(e), await _version_or_none(engine), t0)
    serving = await _version_or_none(engine)
    if not res.success:
        return _failed(weight_version, res.message, serving, t0)
    return SyncReport(True, res.message, serving, time.perf_counter() - t0)


async def sync_from_disk(engine: Engine, checkpoint_dir: str, weight_version: str,
                         pause_mode: str = "retract", expected_sha256: str | None = None) -> SyncReport:
    """Load ``checkpoint_dir`` into ``engine`` as ``weight_version``; with ``expected_sha256`` the
    weights file is checked first, so a corrupt checkpoint is never offered to the engine."""
    t0 = time.perf_counter()
    try:
        if await _serving_version(engine) == weight_version:
            return SyncReport(True, "already serving this version", weight_version, 0.0, skipped=True)
        if expected_sha256:
            await asyncio.to_thread(verify_checkpoint, checkpoint_dir, expected_sha256)
        if hasattr(engine, "sync_weights_from_disk"):  # SGLangClient: the full SGLang sequence
            res = await engine.sync_weights_from_disk(checkpoint_dir, weight_version, pause_mode=pause_mode)
        else:
            await engine.pause_generation(pause_mode)
            try:
                res = await engine.update_weights_from_disk(checkpoint_dir, weight_version)
            finally:
                await engine.continue_generation()
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as e:  # corrupt checkpoint, engine unreachable or killed mid-update
        serving = await _version_or_none(engine)
        reason = _error_text(e)
        if serving is None and not isinstance(e, CheckpointError):
            reason = f"the engine stopped answering during the update ({reason})"
        return _failed(weight_version, reason, serving, t0)
    serving = await _version_or_none(engine)
    if not res.success or serving != str(weight_version):
        reason = res.message if not res.success else f"{res.message} (but the engine reports version {serving})"
        return _failed(weight_version, reason or "the engine refused the update", serving, t0)
    return SyncReport(True, res.message, serving, time.perf_counter() - t0)
