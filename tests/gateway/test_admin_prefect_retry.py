"""submit_deployment_run against a real HTTP server scripted to answer like a busy Prefect API.

Prefect's own server answers 503 when its sqlite store is locked (it rolls the request back); the
reliability test of /admin/replay met one under load. Prefect's client retries such answers; here
they are scripted, so the number of tries and the idempotency key can be asserted exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from clawrl.gateway import admin
from clawrl.gateway.errors import GatewayError

DEPLOYMENT_ID, FLOW_ID = str(uuid.uuid4()), str(uuid.uuid4())


@contextlib.asynccontextmanager
async def prefect_like(create_statuses: list[int]):
    """GET /api/deployments/name/f/d -> the deployment; POST .../create_flow_run answers the given
    statuses in turn (then 201). Yields (api url, the POST bodies received, the run ids answered)."""
    posts: list[dict] = []
    runs: list[str] = []

    async def get_deployment(request):
        return web.json_response({"id": DEPLOYMENT_ID, "name": "d", "flow_id": FLOW_ID})

    async def create(request):
        posts.append(await request.json())
        status = create_statuses[len(posts) - 1] if len(posts) <= len(create_statuses) else 201
        if status != 201:
            return web.json_response({"exception_message": "Service Unavailable"}, status=status,
                                     headers={"Retry-After": "0"})
        runs.append(str(uuid.uuid4()))
        return web.json_response({"id": runs[-1], "name": f"run-{len(posts)}", "flow_id": FLOW_ID}, status=201)

    app = web.Application()
    app.router.add_get("/api/deployments/name/f/d", get_deployment)
    app.router.add_post(f"/api/deployments/{DEPLOYMENT_ID}/create_flow_run", create)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/api")), posts, runs
    finally:
        await server.close()


def _submit(create_statuses: list[int], max_retries: int = 5) -> tuple[dict | GatewayError, list[dict], list[str]]:
    """submit_deployment_run against prefect_like(create_statuses): (the run or the error, the POST
    bodies, the ids of the runs the server created)."""

    async def go():
        async with prefect_like(create_statuses) as (api, posts, runs):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PREFECT_API_URL", api)
                try:
                    return await admin.submit_deployment_run("f/d", {"version": "3"}), posts, runs
                except GatewayError as e:
                    return e, posts, runs

    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: max_retries}):
        return asyncio.run(go())


def test_busy_answers_are_retried_with_one_idempotency_key():
    run, posts, runs = _submit([503, 429])
    assert len(posts) == 3 and len(runs) == 1  # two busy answers, then one run created
    assert run == {"id": runs[0], "name": "run-3"}
    assert {p["idempotency_key"] for p in posts} == {posts[0]["idempotency_key"]}
    assert posts[0]["idempotency_key"].startswith("clawrl-admin-")
    assert all(p["parameters"] == {"version": "3"} for p in posts)


def test_a_prefect_that_stays_busy_is_a_503_after_the_clients_retries():
    err, posts, runs = _submit([503] * 10, max_retries=3)
    assert len(posts) == 4 and runs == []  # the first try + PREFECT_CLIENT_MAX_RETRIES retries
    assert isinstance(err, GatewayError)
    assert err.status == 503 and err.type == "service_unavailable"
    assert "refused the run of f/d: HTTP 503" in err.message


def test_a_client_error_is_not_retried():
    err, posts, runs = _submit([422])
    assert len(posts) == 1 and runs == []
    assert isinstance(err, GatewayError) and "HTTP 422" in err.message


def test_a_missing_deployment_or_api_is_a_503_naming_it(monkeypatch):
    async def submit(name):
        async with prefect_like([]) as (api, _, _):
            monkeypatch.setenv("PREFECT_API_URL", api)
            try:
                await admin.submit_deployment_run(name, {})
            except GatewayError as e:
                return e

    missing = asyncio.run(submit("f/nope"))
    assert missing.status == 503 and "has no deployment f/nope" in missing.message
    monkeypatch.delenv("PREFECT_API_URL")
    with pytest.raises(GatewayError, match="PREFECT_API_URL is not set"):
        asyncio.run(admin.submit_deployment_run("f/d", {}))
