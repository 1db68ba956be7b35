"""submit_deployment_run against a real HTTP server scripted to answer like a busy Prefect API.

Prefect's own server answers 503 when its sqlite store is locked (it rolls the request back); the
reliability test of /admin/replay met one under load. Here the answers are scripted, so the retry
count and the idempotency key can be asserted exactly.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from clawrl.gateway import admin
from clawrl.gateway.service import GatewayError


@contextlib.asynccontextmanager
async def prefect_like(create_statuses: list[int]):
    """GET /api/deployments/name/f/d -> the deployment; POST .../create_flow_run answers the given
    statuses in turn (then 201). Yields (api url, the POST bodies received)."""
    posts: list[dict] = []

    async def get_deployment(request):
        return web.json_response({"id": "dep-1", "name": "d"})

    async def create(request):
        posts.append(await request.json())
        status = create_statuses[len(posts) - 1] if len(posts) <= len(create_statuses) else 201
        if status != 201:
            return web.json_response({"exception_message": "Service Unavailable"}, status=status,
                                     headers={"Retry-After": "0"})
        return web.json_response({"id": f"run-{len(posts)}"}, status=201)

    app = web.Application()
    app.router.add_get("/api/deployments/name/f/d", get_deployment)
    app.router.add_post("/api/deployments/dep-1/create_flow_run", create)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/api")), posts
    finally:
        await server.close()


def _submit(create_statuses: list[int]) -> tuple[dict | GatewayError, list[dict]]:
    """submit_deployment_run against prefect_like(create_statuses): (the run or the error, the POST bodies)."""

    async def go():
        async with prefect_like(create_statuses) as (api, posts):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PREFECT_API_URL", api)
                try:
                    return await admin.submit_deployment_run(("f", "d"), {"version": "3"}), posts
                except GatewayError as e:
                    return e, posts

    return asyncio.run(go())


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(admin, "PREFECT_RETRY_DELAYS_S", (0.01, 0.01, 0.01, 0.01))


def test_busy_answers_are_retried_with_one_idempotency_key(quick_retries):
    run, posts = _submit([503, 429])
    assert run == {"id": "run-3"}  # the third POST was taken
    assert len(posts) == 3
    assert {p["idempotency_key"] for p in posts} == {posts[0]["idempotency_key"]}
    assert posts[0]["idempotency_key"].startswith("clawrl-admin-")
    assert all(p["parameters"] == {"version": "3"} for p in posts)


def test_a_prefect_that_stays_busy_is_a_503_after_five_tries(quick_retries):
    err, posts = _submit([503] * 10)
    assert len(posts) == 5  # the first try + len(PREFECT_RETRY_DELAYS_S) retries
    assert isinstance(err, GatewayError)
    assert err.status == 503 and err.type == "service_unavailable"
    assert "refused the run of f/d: HTTP 503" in err.message


def test_a_client_error_is_not_retried():
    err, posts = _submit([422])
    assert len(posts) == 1
    assert isinstance(err, GatewayError) and "HTTP 422" in err.message
