"""The background loop of clawrl.runtime, and what exit does with the objects the flows made
(clawrl.flows.common.close_all: async closes awaited on that loop, HTTP clients closed)."""

from __future__ import annotations

import asyncio

import pytest

from clawrl import runtime
from clawrl.flows import common


class _Closable:
    def __init__(self):
        self.closed_on: asyncio.AbstractEventLoop | None = None

    async def close(self):
        self.closed_on = asyncio.get_running_loop()


def test_close_all_awaits_async_closes_on_the_background_loop_and_forgets_everything():
    a, b, plain = _Closable(), _Closable(), object()
    for key, obj in [("test-a", a), ("test-b", b), ("test-plain", plain)]:
        assert common._once((key,), lambda obj=obj: obj) is obj
    loop = runtime.background_loop()
    common.close_all()
    assert a.closed_on is loop and b.closed_on is loop
    fresh = object()
    assert common._once(("test-a",), lambda: fresh) is fresh  # forgotten: made anew on next use


def test_flow_objects_are_made_once_per_process(make_settings):
    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo"})
    assert common.data_store(s) is common.data_store(s)
    assert common.judge_for(s) is common.judge_for(s)  # rule judge: no model loaded
    assert common.trainer_in_process(s) is None
    common.attach_policy_engine(engine := object())
    try:
        assert common.policy_engine() is engine
    finally:
        common.attach_policy_engine(None)
    assert common.policy_engine() is None


def test_run_refuses_to_block_its_own_loop():
    async def nested():
        coro = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="called from the runtime loop itself"):
            runtime.run(coro)
        coro.close()

    runtime.run(nested())


def test_a_judge_closes_the_sglang_clients_it_made():
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from clawrl.engine.sglang_client import SGLangClient
    from clawrl.engine.types import GenerateRequest
    from clawrl.judge.backends import EngineJudge
    from clawrl.judge.pipeline import Judge

    async def answer(request):
        return web.json_response({"text": "a", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": None}})

    async def use_then_close():
        app = web.Application()
        app.router.add_post("/generate", answer)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        client = SGLangClient(str(server.make_url("")))
        judge = Judge(backend=EngineJudge(client, tokenizer=None), backend_name="sglang", teacher=client,
                      teacher_tokenizer=None, method="grpo", judge_samples=1, max_tokens=1, config_hash="h")
        try:
            assert client._session is None  # made on first use, inside the running loop
            assert (await client.generate(GenerateRequest(input_ids=[1]))).output_ids == [5]
            session = client._session
            assert len(server.handler.connections) == 1  # the /generate connection, kept alive
            await judge.close()
            for _ in range(100):  # the server sees the close on its next loop iterations
                if not server.handler.connections:
                    break
                await asyncio.sleep(0.01)
            return client, session, len(server.handler.connections)
        finally:
            await server.close()

    client, session, open_connections = runtime.run(use_then_close())
    assert session.closed and client._session is None and open_connections == 0


def test_freeze_startup_heap_moves_live_objects_out_of_the_collector():
    import subprocess
    import sys

    code = ("import gc, json; import clawrl.serving as s; before = len(gc.get_objects()); n = s.freeze_startup_heap(); "
            "print(json.dumps([before, n, len(gc.get_objects())]))")  # a child: freezing here would stay frozen
    before, frozen, after = __import__("json").loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert frozen > 0.5 * before and after < 0.05 * before  # gc.get_objects() no longer lists frozen ones
