"""Syncing a namespace's adapter (clawrl.sync.sync_adapter / unload_adapter) over real HTTP to every worker a
router lists: loaded on each in turn with a row per worker; a worker that refuses stops it and those that loaded
it unload it again; an adapter whose bytes are not the recorded ones reaches no engine. The router and its two
workers are scripted HTTP servers speaking SGLang's routes (GET /workers, /load_lora_adapter,
/unload_lora_adapter): the real multi-LoRA engine is another part, and the real router's fan-out of weight
syncs is tests/engine/test_router.py's."""

from __future__ import annotations

from aiohttp import web

from clawrl.adapters import ADAPTER_FILE
from clawrl.checkpoint import weights_digest
from clawrl.runtime import run
from clawrl.sync import sync_adapter, unload_adapter
from tests.engine.test_sglang_client import scripted_server


def worker(calls: list, refuse: bool = False):
    """A worker's LoRA routes; 404 elsewhere (/workers: it is a plain engine)."""
    async def lora(request):
        if request.path not in ("/load_lora_adapter", "/unload_lora_adapter"):
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        calls.append((request.path, body["lora_name"]))
        if refuse and request.path == "/load_lora_adapter":
            return web.json_response({"success": False, "error_message": "max_loaded_loras reached"}, status=400)
        return web.json_response({"success": True, "error_message": None})

    return scripted_server(lora)


def router(urls: list[str]):
    async def workers(request):
        return web.json_response({"workers": [{"url": u} for u in urls]})

    return scripted_server(workers)


def adapter(tmp_path):
    d = tmp_path / "key-aaaa" / "v000002"
    d.mkdir(parents=True)
    (d / ADAPTER_FILE).write_bytes(b"adapter weights")
    return d, weights_digest(d / ADAPTER_FILE)


def test_every_worker_loads_the_adapter_and_a_refusal_unloads_it_from_those_that_had_it(tmp_path):
    path, sha = adapter(tmp_path)
    first, second = [], []

    async def go(refuse: bool):
        async with worker(first) as w1, worker(second, refuse) as w2, router([w1, w2]) as url:
            rep = await sync_adapter("key-aaaa@v2", str(path), sha, url=url)
            gone = await unload_adapter("key-aaaa@v1", url=url)
            return rep, gone, w1, w2

    rep, gone, w1, w2 = run(go(refuse=False))
    assert (rep.success, rep.weight_version, rep.message, rep.checkpoint_path) == (
        True, "key-aaaa@v2", "2 workers hold key-aaaa@v2", str(path))
    assert [(r["url"], r["ok"]) for r in rep.workers] == [(w1, True), (w2, True)]
    assert gone.success and gone.message == "key-aaaa@v1 unloaded"
    assert first == second == [("/load_lora_adapter", "key-aaaa@v2"), ("/unload_lora_adapter", "key-aaaa@v1")]

    first.clear(), second.clear()
    rep, _, w1, w2 = run(go(refuse=True))
    assert (rep.success, rep.weight_version) == (False, None)
    assert rep.message.startswith(f"{rep.target} did not load key-aaaa@v2: ")
    assert "max_loaded_loras reached" in rep.message
    # the first worker loaded it and unloaded it again: no worker serves a version the others lack
    assert first[:2] == [("/load_lora_adapter", "key-aaaa@v2"), ("/unload_lora_adapter", "key-aaaa@v2")]
    assert second[:1] == [("/load_lora_adapter", "key-aaaa@v2")]


def test_an_adapter_whose_bytes_are_not_the_recorded_ones_reaches_no_engine(tmp_path):
    path, sha = adapter(tmp_path)
    (path / ADAPTER_FILE).write_bytes(b"adapter weighs")  # corrupted after the trainer recorded its digest
    calls = []

    async def go():
        async with worker(calls) as url:
            return await sync_adapter("key-aaaa@v2", str(path), sha, url=url)

    rep = run(go())
    assert not rep.success and rep.weight_version is None and calls == []
    assert f"{ADAPTER_FILE} is corrupt" in rep.message
