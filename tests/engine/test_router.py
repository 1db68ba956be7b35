"""RoutedEngines against the real `sglang-router` in front of two real `clawrl engine` processes: it learns the
workers from the router, loads a checkpoint into each in turn with a row per worker, and when one worker
refuses the load (here: it serves another architecture, so the tensors do not fit) the result says which
and the update stops there. Against a plain engine (no /workers) it is that one engine."""

from __future__ import annotations

import shutil

import pytest

from clawrl.engine.router import RoutedEngines
from clawrl.runtime import run
from tests.e2e.test_engine_router import engines_behind_router
from tests.utils.engine_server import save_perturbed_copy
from tests.utils.gateway_process import serve_env
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
    v1 = _checkpoint(tiny_dir, tmp_path / "v1")
    with engines_behind_router(tmp_path, {"llama": env, "qwen": {**env, "CLAWRL__MODEL__NAME": "tiny-qwen3"}}) as (
            (llama, qwen), url):
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


@pytest.mark.timeout(HANG_S)
def test_an_adapter_reaches_every_worker_or_none(tmp_path, model_cache, tiny_dir):
    """Two `clawrl engine` workers behind the router: an adapter loads on both (a row each) and serves through the
    router; a name one worker already holds otherwise is refused there, and the worker that had loaded it unloads
    it again; unloading reaches both."""
    import httpx

    from clawrl.engine.lora import write_random_adapters
    from clawrl.engine.types import GenerateRequest, SamplingParams
    from clawrl.models import load_causal_lm

    a0, a1 = write_random_adapters(load_causal_lm(tiny_dir), [tmp_path / "a0", tmp_path / "a1"], rank=4, alpha=8,
                                   std=0.2)
    env = serve_env(tmp_path / "data", model_cache)
    with engines_behind_router(tmp_path, {"engine0": env, "engine1": env}) as (workers, url):
        engines = RoutedEngines(url, timeout_s=60)
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

        async def go():
            try:
                order = await engines.workers()
                loaded = await engines.load_lora_adapter("u@v1", str(a0))
                answers = [await engines.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=sp,
                                                                  lora_path="u@v1", routing_key=f"s{i}"))
                           for i in range(4)]
                taken = await order[-1].load_lora_adapter("u@v2", str(a1))  # the last worker holds u@v2 already
                refused = await engines.load_lora_adapter("u@v2", str(a0))
                unloaded = await engines.unload_lora_adapter("u@v1")
                return [w.base_url for w in order], loaded, answers, taken, refused, unloaded
            finally:
                await engines.close()

        order, loaded, answers, taken, refused, unloaded = run(go())
        after = {e.url: httpx.get(e.url + "/server_info").json()["lora_paths"] for e in workers}
    assert loaded.success and [w["url"] for w in loaded.workers] == order and all(w["ok"] for w in loaded.workers)
    assert loaded.loaded_adapters == {"u@v1": str(a0)}
    assert len({tuple(a.output_ids) for a in answers}) == 1  # the same adapter whichever worker answered
    assert taken.success and not refused.success
    assert refused.message.startswith(f"adapter u@v2 not loaded: {order[-1]} did not load it: LoRA with name u@v2")
    rows = {w["url"]: w for w in refused.workers}
    assert rows[order[0]]["ok"] and rows[order[0]]["message"] == "unloaded again: ok"
    assert unloaded.success and [w["ok"] for w in unloaded.workers] == [True, True]
    assert after == {order[0]: {}, order[1]: {"u@v2": str(a1)}}  # u@v1 gone from both; u@v2 only where it was


def test_a_request_is_sent_again_while_no_worker_is_available_but_a_full_queue_is_told_at_once(monkeypatch):
    """The router's "no available workers" (one engine died while the other restarts) passes within a
    circuit timeout and a health check: the request goes again until then. A full queue or a timeout is
    the client's to handle (503 with Retry-After, 504) and is raised on the first answer. The router's
    answers are stood in for here: the e2e test in tests/e2e/test_engine_router.py meets the real one."""
    import clawrl.engine.router as router_mod
    from clawrl.engine.types import EngineOverloadedError, EngineTimeoutError, GenerateRequest

    monkeypatch.setattr(router_mod, "RESEND_DELAY_S", 0.01)
    engines = RoutedEngines("http://127.0.0.1:9")
    engines.routed = True
    answers: list[object] = []
    calls = []

    async def fake_generate(req):
        calls.append(req)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(engines.router, "generate", fake_generate)
    no_workers = EngineOverloadedError("engine at http://r: No available workers (all circuits open or unhealthy)")
    req = GenerateRequest(input_ids=[1, 2, 3])
    answers[:] = [no_workers, no_workers, no_workers, "answer"]
    assert run(engines.generate(req)) == "answer" and len(calls) == 4
    for refusal in (EngineOverloadedError("engine at http://r: the request queue is full"),
                    EngineTimeoutError("engine at http://r timed out")):
        calls.clear()
        answers[:] = [refusal, "answer"]
        with pytest.raises(type(refusal)):
            run(engines.generate(req))
        assert len(calls) == 1
    # resends stop when the window is spent: the client then gets the router's 503
    monkeypatch.setattr(router_mod, "RESEND_WINDOW_S", 0.05)
    calls.clear()
    answers[:] = [no_workers] * 100
    with pytest.raises(EngineOverloadedError, match="No available workers"):
        run(engines.generate(req))
    assert 1 <= len(calls) < 100
