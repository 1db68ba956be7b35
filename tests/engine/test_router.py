"""RoutedEngines against the real `sglang-router` in front of two real `clawrl engine` processes: it learns the
workers from the router, loads a checkpoint into each in turn with a row per worker, and when one worker
refuses the load (here: it serves another architecture, so the tensors do not fit) the result says which
and the update stops there. Against a plain engine (no /workers) it is that one engine."""

from __future__ import annotations

import shutil

import pytest

from clawrl.engine.router import RoutedEngines
from clawrl.runtime import run
from tests.e2e.test_engine_router import _router
from tests.utils.engine_server import save_perturbed_copy
from tests.utils.gateway_process import engine_process, free_port, serve_env
from tests.utils.waiting import HANG_S


def _checkpoint(tiny_dir, out):
    path = save_perturbed_copy(tiny_dir, out)
    for f in tiny_dir.iterdir():
        if not (path / f.name).exists():
            shutil.copy(f, path / f.name)
    return path


@pytest.mark.timeout(HANG_S)
def test_each_worker_loads_in_turn_and_a_refusal_names_its_worker(tmp_path, model_cache, tiny_dir):
    env = serve_env(tmp_path / "data", model_cache)
    llama = engine_process(tmp_path, env, port=free_port(), name="llama")
    qwen = engine_process(tmp_path, {**env, "CLAWRL__MODEL__NAME": "tiny-qwen3"}, port=free_port(), name="qwen")
    v1 = _checkpoint(tiny_dir, tmp_path / "v1")
    for e in (llama, qwen):
        e.start()
    router = None
    try:
        for e in (llama, qwen):
            e.wait_ready()
        router, url = _router(tmp_path, [llama.url, qwen.url])

        engines = RoutedEngines(url, timeout_s=300)

        async def go():
            try:
                workers = sorted(w.base_url for w in await engines.workers())
                res = await engines.update_weights_from_disk(str(v1), "1")
                info = await engines.model_info()
                single = RoutedEngines(llama.url, timeout_s=300)
                plain = [w.base_url for w in await single.workers()], await single.model_info()
                await single.close()
                return workers, res, info, plain
            finally:
                await engines.close()

        workers, res, info, (plain_workers, plain_info) = run(go())
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for e in (llama, qwen):
            e.stop()
    assert workers == sorted([llama.url, qwen.url]) and engines.routed is True
    assert not res.success and res.weight_version is None
    rows = {w["url"]: w for w in res.workers}
    refused = rows[qwen.url]
    assert not refused["ok"] and not refused["unreachable"] and refused["weight_version"] is None
    assert f"{qwen.url} did not load it" in res.message
    if llama.url in rows:  # the llama worker came first: it loaded version 1 and keeps it (no earlier load to go back to)
        assert rows[llama.url]["ok"] and rows[llama.url]["weight_version"] == "1"
    versions = {w["url"]: w["weight_version"] for w in info["workers"]}
    assert versions[qwen.url] == "0" and info["weight_version"] == "0"  # the oldest any worker serves
    assert plain_workers == [llama.url] and "workers" not in plain_info
