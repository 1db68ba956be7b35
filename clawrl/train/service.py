"""The trainer as a long-lived service (``clawrl trainer``): model and optimizer stay in memory
between steps while Prefect flow runs, which execute in their own processes, come and go.

``POST /step {"batch_id"}`` trains on the samples the batch lists (read from storage) and returns
the StepResult; it is idempotent per batch id. ``GET /state`` reports the current version.
Steps run one at a time in a worker thread so the event loop keeps answering ``/state``.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from clawrl.train.trainer import Trainer, samples_from_rows


class StepRequest(BaseModel):
    batch_id: str


def create_trainer_app(trainer: Trainer, data_root) -> FastAPI:
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import batch_samples

    app = FastAPI(title="clawrl trainer")
    lock = asyncio.Lock()  # the HTTP server's own guard; cross-process exclusivity is Prefect's `trainer` limit

    @app.get("/state")
    async def state() -> dict[str, Any]:
        last = None if trainer.last is None else asdict(trainer.last)
        return {"weight_version": trainer.weight_version, "last": last}

    @app.post("/step")
    async def step(req: StepRequest):
        def work():
            with open_catalog(data_root) as con:
                rows = batch_samples(con, req.batch_id).to_pylist()
            return trainer.run(req.batch_id, samples_from_rows(rows))

        async with lock:
            try:
                result = await asyncio.to_thread(work)
            except ValueError as e:
                return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        return asdict(result)

    return app


def request_step(trainer_url: str, batch_id: str, timeout_s: float = 3600.0) -> dict[str, Any]:
    try:
        r = httpx.post(trainer_url.rstrip("/") + "/step", json={"batch_id": batch_id}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RuntimeError(f"trainer at {trainer_url} unreachable: {e!r}") from None
    if r.status_code != 200:
        raise RuntimeError(f"trainer at {trainer_url} failed batch {batch_id}: HTTP {r.status_code} {r.text[:500]}")
    return r.json()
