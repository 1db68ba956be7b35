"""Admin routes: pause and resume serving, and replay through the Prefect deployment `clawrl up` serves.

Every route here needs an admin key (``deps.check_admin_key``): 401 without a known key, 403 for an
API key. They are left out of the OpenAPI document: operators use them, API clients never need them.

Pause stops *new* turns (503 with ``Retry-After``, an OpenAI-style body the openai SDK retries);
turns already in flight finish and are recorded. A replay is submitted through Prefect's client to
the API named by ``PREFECT_API_URL`` (never an ephemeral Prefect server started by accident inside
the gateway): the run is created and its id returned; the flow server runs it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from fastapi import APIRouter, Depends

from clawrl.config import ConfigError, parse_override, prefect_api_url
from clawrl.gateway.deps import ServiceDep, require_admin
from clawrl.gateway.schemas import ReplayRequest
from clawrl.gateway.errors import GatewayError
from clawrl.ids import new_id

log = logging.getLogger("clawrl.gateway.admin")

REPLAY_DEPLOYMENT = "replay/on-demand"  # flow name/deployment name (flows/serve.py)
PREFECT_TIMEOUT_S = 10.0
PAUSED_RETRY_AFTER_S = 5

router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_admin)])


def paused_error() -> GatewayError:
    return GatewayError(503, "the gateway is paused by an administrator and takes no new turns; retry later",
                        "service_unavailable", headers={"Retry-After": str(PAUSED_RETRY_AFTER_S)})


@router.post("/pause")
async def pause(service: ServiceDep) -> dict[str, Any]:
    service.paused = True
    log.warning("paused by an admin: new turns get 503 until POST /admin/resume")
    return {"paused": True}


@router.post("/resume")
async def resume(service: ServiceDep) -> dict[str, Any]:
    service.paused = False
    log.warning("resumed by an admin")
    return {"paused": False}


@router.post("/replay")
async def replay(service: ServiceDep, body: ReplayRequest | None = None) -> dict[str, Any]:
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
        from clawrl.storage.queries import version_for_run

        found = await asyncio.to_thread(service.read, version_for_run, body.run_id)
        if found is None:
            raise GatewayError(404, "no checkpoint was trained by that MLflow run", param="run_id")
        version = found
    params = {"version": version, "exclude_sessions": body.exclude_sessions, "reason": body.reason,
              "set_overrides": body.set}
    run = await submit_deployment_run(REPLAY_DEPLOYMENT, params)
    log.info("replay of version %s submitted: flow run %s", version, run["id"])
    return {"flow_run_id": run["id"], "flow_run_name": run["name"], "deployment": REPLAY_DEPLOYMENT,
            "parameters": params}


async def submit_deployment_run(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """Create a flow run of deployment ``name`` ('flow/deployment') with ``parameters`` over the
    deployment's defaults; returns its ``id`` and ``name``. 503 when no Prefect API is reachable or it
    does not serve that deployment. Prefect's client retries answers that say "busy, try again" (429,
    502, 503; ``PREFECT_CLIENT_MAX_RETRIES`` times), each with the same idempotency key: a retried
    POST whose first try did land returns that run, not a second one."""
    api = prefect_api_url()  # checked before Prefect is imported: without it Prefect would start a server
    if api is None:
        raise GatewayError(503, f"no Prefect API to submit {name} to: PREFECT_API_URL is not set (`clawrl up` "
                           "sets it and serves the deployment)", "service_unavailable")
    from prefect.client.orchestration import PrefectClient
    from prefect.deployments import arun_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        async with PrefectClient(api, httpx_settings={"timeout": PREFECT_TIMEOUT_S}) as client:
            run = await arun_deployment(name, client=client, parameters=parameters, timeout=0, as_subflow=False,
                                        idempotency_key=f"clawrl-admin-{new_id()}")
    except ObjectNotFound:
        raise GatewayError(503, f"the Prefect API at {api} has no deployment {name}: is the flow server of "
                           "`clawrl up` running?", "service_unavailable") from None
    except httpx.HTTPStatusError as e:
        raise GatewayError(503, f"the Prefect API at {api} refused the run of {name}: HTTP "
                           f"{e.response.status_code}", "service_unavailable") from None
    except httpx.HTTPError as e:
        raise GatewayError(503, f"the Prefect API at {api} is not reachable: {type(e).__name__}",
                           "service_unavailable") from None
    return {"id": str(run.id), "name": run.name}
