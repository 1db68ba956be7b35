"""Push new weights to the serving engine without rejecting a single request.

* In-process embedded engine: pause (retract) -> copy the trainer's state dict into the served
  parameters -> continue. Requests in flight are re-prefilled on the new weights and keep going in
  the same call; requests that arrive meanwhile are held, never refused.
* HTTP engine (SGLang, or ``clawrl engine``): pause -> flush -> ``update_weights_from_disk`` ->
  continue, through :meth:`SGLangClient.sync_weights_from_disk` (ref/sglang.md §4.4).

A failed load leaves the old weights and version serving; the result says so and the caller
reports it. Both paths are idempotent: an engine already serving the target version is left alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from clawrl.engine.types import Engine, UpdateResult


@dataclass(frozen=True)
class SyncReport:
    success: bool
    message: str
    weight_version: str  # what the engine serves afterwards
    seconds: float
    skipped: bool = False


async def _serving_version(engine: Engine) -> str:
    return str((await engine.model_info()).get("weight_version"))


async def sync_state_dict(engine: Engine, state_dict: dict[str, Any], weight_version: str,
                          pause_mode: str = "retract") -> SyncReport:
    t0 = time.perf_counter()
    if await _serving_version(engine) == weight_version:
        return SyncReport(True, "already serving this version", weight_version, 0.0, skipped=True)
    await engine.pause_generation(pause_mode)
    try:
        res: UpdateResult = await engine.update_weights_from_state_dict(state_dict, weight_version)  # type: ignore[attr-defined]
    finally:
        await engine.continue_generation()  # always resume, also after a failed load
    return SyncReport(res.success, res.message, await _serving_version(engine), time.perf_counter() - t0)


async def sync_from_disk(engine: Engine, checkpoint_dir: str, weight_version: str,
                         pause_mode: str = "retract") -> SyncReport:
    t0 = time.perf_counter()
    if await _serving_version(engine) == weight_version:
        return SyncReport(True, "already serving this version", weight_version, 0.0, skipped=True)
    if hasattr(engine, "sync_weights_from_disk"):  # SGLangClient: the full SGLang sequence
        res = await engine.sync_weights_from_disk(checkpoint_dir, weight_version, pause_mode=pause_mode)
    else:
        await engine.pause_generation(pause_mode)
        try:
            res = await engine.update_weights_from_disk(checkpoint_dir, weight_version)
        finally:
            await engine.continue_generation()
    return SyncReport(res.success, res.message, await _serving_version(engine), time.perf_counter() - t0)
