"""Two `clawrl engine` processes behind one `clawrl serve` (``[engine] urls``), driven by the openai SDK
from several threads: sessions stay on their engine, one engine is SIGKILLed under traffic (no
acknowledged turn lost, none logged twice, no request refused), weight syncs go through the
gateway's /engine under traffic (zero rejected requests, versions never go back within a session),
and the killed engine, started again with its initial weights, is brought to the served version
before it takes traffic."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

import httpx
import pytest
from openai import OpenAI

from clawrl.runtime import run
from clawrl.storage.catalog import run_query
from clawrl.sync import sync_checkpoint
from tests.utils.engine_server import save_perturbed_copy
from tests.utils.gateway_process import engine_process, free_port, gateway_process, serve_env

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

    def wait_for(self, more: int, timeout_s: float = 120.0) -> None:
        target, t0 = self.count() + more, time.monotonic()
        while self.count() < target and not self.errors:
            assert time.monotonic() - t0 < timeout_s, f"traffic stalled at {self.count()} answers"
            time.sleep(0.05)


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


def _engines(gw_url: str) -> list[dict]:
    return httpx.get(gw_url + "/engine/model_info", timeout=30).json()["engines"]


def _sync(gw_url: str, version: str, path) -> object:
    return run(sync_checkpoint(version, str(path), "", url=gw_url + "/engine", timeout_s=120))


@pytest.mark.timeout(600)
def test_two_engines_behind_the_gateway_kill_and_sync_under_traffic(tmp_path, model_cache, tiny_dir):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    data = tmp_path / "data"
    env = serve_env(data, model_cache, engine__kind="http", engine__urls=json.dumps(urls),
                    engine__sync_waves="2", engine__down_retry_s="1", engine__stall_timeout_s="60",
                    engine__max_context_len="4096")
    engines = [engine_process(tmp_path, env, port=p, name=f"engine{i}") for i, p in enumerate(ports)]
    gw = gateway_process(tmp_path, env)
    v1, v2 = save_perturbed_copy(tiny_dir, tmp_path / "v1"), save_perturbed_copy(tiny_dir, tmp_path / "v2", 0.1)
    for e in engines:
        e.start()
    for e in engines:
        e.wait_ready()
    gw.start()
    gw.wait_ready()
    traffic = Traffic(gw.url)
    try:
        # each session stays on one engine (by the engines' own counts), the sessions spread over both
        served = _pinned(gw.url, urls)
        assert all(len(engines_of) == 1 for engines_of in served.values()), served
        assert sorted(e for (e,) in served.values()) == [0, 0, 1, 1]
        traffic.start()
        traffic.wait_for(4 * SESSIONS)

        engines[0].kill()  # under traffic: its requests go to the other engine
        traffic.wait_for(4 * SESSIONS)
        states = _engines(gw.url)
        assert [s["up"] for s in states] == [False, True] and states[0]["failures"] >= 1
        metrics = httpx.get(gw.url + "/metrics", timeout=30).text  # per engine, for Prometheus
        assert f'clawrl_engine_up{{engine="{urls[0]}"}} 0.0' in metrics
        assert f'clawrl_engine_up{{engine="{urls[1]}"}} 1.0' in metrics
        assert f'clawrl_engine_weight_version{{engine="{urls[1]}"}} 0.0' in metrics

        rep = _sync(gw.url, "1", v1)  # reaches the engine that answers; the dead one loads it when back
        assert rep.success and rep.weight_version == "1", rep.message
        assert f"out (loads it when back): {urls[0]}" in rep.message
        traffic.wait_for(2 * SESSIONS)

        engines[0].start()  # back with the initial weights: it loads version 1 before it serves
        engines[0].wait_ready()
        t0 = time.monotonic()
        while not all(s["up"] and s["weight_version"] == "1" for s in _engines(gw.url)):
            assert time.monotonic() - t0 < 120, _engines(gw.url)
            time.sleep(0.2)

        rep = _sync(gw.url, "2", v2)  # both engines, two waves, under traffic
        assert rep.success and rep.weight_version == "2" and "2 engines serve version 2 (2 waves)" in rep.message
        traffic.wait_for(3 * SESSIONS)
    finally:
        traffic.stop()
        gw.stop()
        for e in engines:
            e.stop()
    assert traffic.errors == []  # zero rejected requests: through the kill and both syncs
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

