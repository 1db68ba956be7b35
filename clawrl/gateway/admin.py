"""Admin routes: pause and resume serving, and replay through the Prefect deployment `clawrl up` serves.

Every route here needs an admin key (``deps.check_admin_key``): 401 without a known key, 403 for an
API key. They are left out of the OpenAPI document: operators use them, API clients never need them.

Pause stops *new* turns (503 with ``Retry-After``, an OpenAI-style body the openai SDK retries);
turns already in flight finish and are recorded. The replay request is submitted to the Prefect
API over its REST interface (no Prefect import here, and never an ephemeral Prefect server started
by accident inside the gateway): the run is created and its id returned; the flow server runs it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from fastapi import APIRouter

from clawrl.config import ConfigError, parse_override, prefect_api_url
from clawrl.gateway.deps import AdminDep, ServiceDep
from clawrl.gateway.schemas import ReplayRequest
from clawrl.gateway.service import GatewayError
from clawrl.ids import new_id

log = logging.getLogger("clawrl.gateway.admin")

REPLAY_DEPLOYMENT = ("replay", "on-demand")  # flow name, deployment name (flows/serve.py)
PREFECT_TIMEOUT_S = 10.0
PAUSED_RETRY_AFTER_S = 5


def paused_error() -> GatewayError:
    return GatewayError(503, "the gateway is paused by an administrator and takes no new turns; retry later",
                        "service_unavailable", headers={"Retry-After": str(PAUSED_RETRY_AFTER_S)})


def build_admin_router(data_root) -> APIRouter:
    router = APIRouter(prefix="/admin", include_in_schema=False)

    @router.post("/pause")
    async def pause(_: AdminDep, service: ServiceDep) -> dict[str, Any]:
        service.paused = True
        log.warning("paused by an admin: new turns get 503 until POST /admin/resume")
        return {"paused": True}

    @router.post("/resume")
    async def resume(_: AdminDep, service: ServiceDep) -> dict[str, Any]:
        service.paused = False
        log.warning("resumed by an admin")
        return {"paused": False}

    @router.post("/replay")
    async def replay(_: AdminDep, body: ReplayRequest | None = None) -> dict[str, Any]:
        body = body or ReplayRequest()
        if body.version is not None and body.run_id is not None:
            raise GatewayError(400, "give version or run_id, not both", param="version")
        for item in body.set:
            try:
                parse_override(item)
            except ConfigError as e:
                raise GatewayError(400, str(e), param="set") from None
        version = body.version or "latest"
        if body.run_id is not None:
            found = await asyncio.to_thread(_version_for_run, data_root, body.run_id)
            if found is None:
                raise GatewayError(404, "no checkpoint was trained by that MLflow run", param="run_id")
            version = found
        params = {"version": version, "exclude_sessions": body.exclude_sessions, "reason": body.reason,
                  "set_overrides": body.set}
        run = await submit_deployment_run(REPLAY_DEPLOYMENT, params)
        log.info("replay of version %s submitted: flow run %s", version, run["id"])
        return {"flow_run_id": run["id"], "flow_run_name": run.get("name"), "deployment": "/".join(REPLAY_DEPLOYMENT),
                "parameters": params}

    return router


def _version_for_run(data_root, run_id: str) -> str | None:
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import version_for_run

    with open_catalog(data_root) as con:
        return version_for_run(con, run_id)


PREFECT_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)  # after each answer that says "busy, try again"


async def _retrying(send) -> httpx.Response:
    """``send()`` again while the Prefect API answers 429 or 503 (its sqlite store busy, say: it
    rolls back and says so), at most len(PREFECT_RETRY_DELAYS_S) more times; a Retry-After of up to
    the delay's double is honoured. The last answer is returned whatever it is."""
    for delay in PREFECT_RETRY_DELAYS_S:
        resp = await send()
        if resp.status_code not in (429, 503):
            return resp
        after = resp.headers.get("retry-after", "")
        wait = min(float(after), 2 * delay) if after.replace(".", "", 1).isdigit() else delay
        log.warning("Prefect API answered %d to %s; retrying in %.2f s", resp.status_code, resp.request.url.path, wait)
        await asyncio.sleep(wait)
    return await send()


async def submit_deployment_run(deployment: tuple[str, str], parameters: dict[str, Any]) -> dict[str, Any]:
    """Create a flow run of ``deployment`` (flow name, deployment name) with ``parameters`` over the
    deployment's defaults; returns the flow run (its ``id``). 503 when no Prefect API is reachable
    or it does not serve that deployment."""
    api = prefect_api_url()
    name = "/".join(deployment)
    if api is None:
        raise GatewayError(503, f"no Prefect API to submit {name} to: PREFECT_API_URL is not set (`clawrl up` "
                           "sets it and serves the deployment)", "service_unavailable")
    api = api.rstrip("/")
    # one key for every attempt: a retried POST whose first try did land returns that run, not a second one
    body = {"parameters": parameters, "idempotency_key": f"clawrl-admin-{new_id()}"}
    try:
        async with httpx.AsyncClient(base_url=api, timeout=PREFECT_TIMEOUT_S) as client:
            found = await _retrying(lambda: client.get(f"/deployments/name/{deployment[0]}/{deployment[1]}"))
            if found.status_code == 404:
                raise GatewayError(503, f"the Prefect API at {api} has no deployment {name}: is the flow server "
                                   "of `clawrl up` running?", "service_unavailable")
            found.raise_for_status()
            created = await _retrying(lambda: client.post(f"/deployments/{found.json()['id']}/create_flow_run",
                                                          json=body))
            created.raise_for_status()
            return created.json()
    except httpx.HTTPStatusError as e:
        raise GatewayError(503, f"the Prefect API at {api} refused the run of {name}: HTTP "
                           f"{e.response.status_code}", "service_unavailable") from None
    except httpx.HTTPError as e:
        raise GatewayError(503, f"the Prefect API at {api} is not reachable: {type(e).__name__}",
                           "service_unavailable") from None
