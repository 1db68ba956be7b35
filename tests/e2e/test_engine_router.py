"""Two `clawrl engine` processes behind SGLang's router (the real `sglang-router`, as `clawrl up --engines 2`
starts it) and one `clawrl serve` in front of the router, driven by the openai SDK from several threads:
sessions stay on their engine, one engine is SIGKILLed under traffic (no acknowledged turn lost, none logged
twice, no request refused), weight syncs go through the gateway's /engine to each worker under traffic
(zero rejected requests, versions never go back within a session, a row per worker in the sync record),
and the killed engine, started again with ``--resume``, serves the version synced last."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from clawrl.config import load_settings
from clawrl.engine.router import router_argv
from clawrl.runtime import run
from clawrl.storage.catalog import run_query
from clawrl.sync import sync_checkpoint
from tests.utils.engine_server import save_perturbed_copy
from tests.utils.gateway_process import engine_process, free_port, gateway_process, serve_env
from tests.utils.waiting import HANG_S, wait_until

pytestmark = [pytest.mark.reliability]

SESSIONS = 4


class Traffic:
    """``SESSIONS`` threads, each one conversation of its own (a session id per thread), one turn after
    the other; every answer is kept with the turn index and weight version it came with."""

    def __init__(self, base_url: str):
        self.client = OpenAI(base_url=base_url + "/v1", api_key="open", max_retries=0, timeout=120)
        self.acked: dict[str, list[dict]] = defaultdict(list)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _talk(self, sid: str) -> None:
        messages: list[dict] = []
        while not self._stop.is_set():
            messages.append({"role": "user", "content": f"question {len(messages) // 2} of {sid}"})
            try:
                r = self.client.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"session_id": sid})
            except Exception as e:  # any refusal fails the test below
                self.errors.append(f"{sid}: {type(e).__name__}: {e}")
                return
            c = r.parse()
            self.acked[sid].append({"turn_index": int(r.headers["x-turn-index"]),
                                    "version": r.headers["x-weight-version"]})
            messages.append({"role": "assistant", "content": c.choices[0].message.content or "ok"})

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._talk, args=(f"s{i}",), daemon=True) for i in range(SESSIONS)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def count(self) -> int:
        return sum(len(v) for v in self.acked.values())

    def wait_for(self, more: int) -> None:
        """Until ``more`` answers more have come (or a request failed: the test's asserts say which)."""
        target = self.count() + more
        wait_until(lambda: self.count() >= target or self.errors, f"{more} more answers (from {target - more})",
                   progress=self.count, poll_s=0.05)


def _done(url: str) -> int:
    """Requests an engine process finished, by its own count (SGLang's /server_info internal_states)."""
    return httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["requests_done"]


def _pinned(gw_url: str, urls: list[str]) -> dict[str, set[int]]:
    """Three turns of each of the sessions, one request at a time: which engine served each."""
    client = OpenAI(base_url=gw_url + "/v1", api_key="open", max_retries=0, timeout=120)
    served: dict[str, set[int]] = defaultdict(set)
    for turn in range(3):
        for i in range(SESSIONS):
            before = [_done(u) for u in urls]
            client.chat.completions.create(model="tiny", max_tokens=4, extra_body={"session_id": f"p{i}"},
                                           messages=[{"role": "user", "content": f"turn {turn}"}])
            after = [_done(u) for u in urls]
            [engine] = [k for k in range(len(urls)) if after[k] == before[k] + 1]
            served[f"p{i}"].add(engine)
    return served


def _placed(gw_url: str) -> None:
    """The sessions' first turns, all at once: the router gives each new session to the least loaded worker."""
    client = OpenAI(base_url=gw_url + "/v1", api_key="open", max_retries=0, timeout=120)
    with ThreadPoolExecutor(SESSIONS) as pool:
        list(pool.map(lambda i: client.chat.completions.create(
            model="tiny", max_tokens=32, extra_body={"session_id": f"p{i}"},
            messages=[{"role": "user", "content": "turn 0"}]), range(SESSIONS)))


def _wait_healthy(router: subprocess.Popen, router_url: str, log, n: int) -> None:
    wait_until(lambda: sum(w["is_healthy"] for w in httpx.get(router_url + "/workers", timeout=30).json()["workers"])
               >= n, f"{n} healthy workers in the router", proc=router, log=log, poll_s=0.5)


def _workers(url: str) -> list[dict]:
    return httpx.get(url + "/engine/model_info", timeout=30).json()["workers"]


def _sync(gw_url: str, version: str, path, data) -> object:
    """Serve checkpoint ``path`` as ``version`` through the gateway's /engine, the checkpoint and the sync
    recorded as the train flow records them (what `clawrl engine --resume` reads)."""
    from clawrl.checkpoint import WEIGHTS_FILE, weights_digest
    from clawrl.flows.common import data_store, record_sync
    from clawrl.records import CheckpointRecord

    s = load_settings(env={"CLAWRL__STORAGE__DATA_ROOT": str(data)})
    digest = weights_digest(path / WEIGHTS_FILE)
    data_store(s).append(CheckpointRecord(version, int(version), f"b{version}", str(int(version) - 1), str(path),
                                          digest, None))
    rep = run(sync_checkpoint(version, str(path), digest, url=gw_url + "/engine", timeout_s=120))
    record_sync(s, rep, version, None)
    return rep


def _router(tmp_path, urls: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(router_argv(urls, "127.0.0.1", port, free_port()), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    # ready once both workers answer its health checks
    wait_until(lambda: httpx.get(url + "/readiness", timeout=10).status_code == 200, "the router ready", proc=proc,
               log=log, poll_s=0.2)
    return proc, url


@contextmanager
def engines_behind_router(tmp_path, envs: dict[str, dict[str, str]]):
    """A `clawrl engine` per (name, environment), started, with SGLang's router in front: yields the workers'
    processes and the router's URL; everything is stopped after."""
    workers = [engine_process(tmp_path, env, port=free_port(), name=name) for name, env in envs.items()]
    for e in workers:
        e.start()
    router = None
    try:
        for e in workers:
            e.wait_ready()
        router, url = _router(tmp_path, [e.url for e in workers])
        yield workers, url
    finally:
        if router is not None:
            router.terminate()
            router.wait(60)
        for e in workers:
            e.stop()


@pytest.mark.timeout(HANG_S)
def test_two_engines_behind_the_router_kill_and_sync_under_traffic(tmp_path, model_cache, tiny_dir):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    data = tmp_path / "data"
    base = serve_env(data, model_cache, engine__max_context_len="4096")
    engines = [engine_process(tmp_path, base, port=p, name=f"engine{i}") for i, p in enumerate(ports)]
    v1, v2 = save_perturbed_copy(tiny_dir, tmp_path / "v1"), save_perturbed_copy(tiny_dir, tmp_path / "v2", 0.1)
    for v in (v1, v2):  # whole checkpoints, as the trainer writes them: `clawrl engine --resume` serves one
        for f in tiny_dir.iterdir():
            if not (v / f.name).exists():
                shutil.copy(f, v / f.name)
    for e in engines:
        e.start()
    for e in engines:
        e.wait_ready()
    router, router_url = _router(tmp_path, urls)
    gw = gateway_process(tmp_path, {**base, "CLAWRL__ENGINE__URL": router_url,
                                    "CLAWRL__ENGINE__STALL_TIMEOUT_S": "60"})
    gw.start()
    gw.wait_ready()
    traffic = Traffic(gw.url)
    try:
        # each session stays on one engine (by the engines' own counts), the sessions spread over both
        _placed(gw.url)
        served = _pinned(gw.url, urls)
        assert all(len(engines_of) == 1 for engines_of in served.values()), served
        assert {e for (e,) in served.values()} == {0, 1}
        traffic.start()
        traffic.wait_for(4 * SESSIONS)

        engines[0].kill()  # under traffic: its sessions' requests are sent again and land on the other engine
        traffic.wait_for(4 * SESSIONS)
        engines[0].args.append("--resume")
        engines[0].start()  # back on the version synced last (none yet: the initial weights)
        engines[0].wait_ready()

        rep = _sync(gw.url, "1", v1, data)  # each worker in turn, under traffic
        assert rep.success and rep.weight_version == "1", rep.message
        assert sorted(w["url"] for w in rep.workers) == sorted(urls)
        assert all(w["ok"] and w["weight_version"] == "1" for w in rep.workers)
        assert {w["weight_version"] for w in _workers(gw.url)} == {"1"}
        traffic.wait_for(2 * SESSIONS)

        _wait_healthy(router, router_url, tmp_path / "router.log", 2)  # the router takes the restarted engine back (health checks every 5 s)
        engines[1].kill()  # under traffic, then back as `clawrl up` restarts its engines: on the version synced last
        engines[1].args.append("--resume")
        engines[1].start()
        engines[1].wait_ready()
        assert httpx.get(urls[1] + "/model_info", timeout=30).json()["weight_version"] == "1"
        traffic.wait_for(2 * SESSIONS)

        rep = _sync(gw.url, "2", v2, data)
        assert rep.success and rep.weight_version == "2" and "2 workers serve version 2" in rep.message
        traffic.wait_for(3 * SESSIONS)
    finally:
        traffic.stop()
        gw.stop()
        router.terminate()
        router.wait(30)
        for e in engines:
            e.stop()
    assert traffic.errors == []  # zero rejected requests: through the kills and both syncs
    for sid, acks in traffic.acked.items():
        assert [a["turn_index"] for a in acks] == list(range(len(acks))), sid  # no turn lost or repeated
        ranks = [int(a["version"]) for a in acks]
        assert ranks == sorted(ranks) and ranks[-1] == 2, (sid, ranks)  # never back to an older version
    rows = run_query(data, "select session_id, turn_index, count(*) as n from turns where session_id like 's%' "
                           "group by all").to_pylist()
    logged = {(r["session_id"], r["turn_index"]): r["n"] for r in rows}
    acked = {(sid, a["turn_index"]) for sid, acks in traffic.acked.items() for a in acks}
    assert acked <= set(logged) and all(n == 1 for n in logged.values())  # every answer logged, once
    assert len(logged) <= len(acked) + SESSIONS  # at most the turn each thread had in flight at stop
    syncs = run_query(data, "select weight_version, ok, workers from syncs order by created_at").to_pylist()
    assert [(r["weight_version"], r["ok"], len(r["workers"])) for r in syncs] == [("1", True, 2), ("2", True, 2)]
    assert all(w.startswith(tuple(urls)) and ": version " in w for r in syncs for w in r["workers"])
