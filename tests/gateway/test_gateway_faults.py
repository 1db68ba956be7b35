"""Engine down, slow, or swapping weights under traffic (a gateway killed under traffic: tests/reliability/test_gateway_kill.py)."""

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from clawrl.engine.sglang_client import SGLangClient
from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.engine_server import make_tiny_engine, running_engine_server, save_perturbed_copy
from tests.utils.fake_engine import FakeEngine
from tests.utils.gateway_server import free_socket, running_gateway
from tests.utils.waiting import wait_until

MSG = [{"role": "user", "content": "hello"}]


def test_engine_down_gives_502_and_the_gateway_recovers(gateway_settings, tiny_dir, tiny_engine):
    sock = free_socket()
    dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    s = gateway_settings()
    app = create_app(s, engine=SGLangClient(dead_url, timeout_s=5), tokenizer=tiny_engine.tokenizer,
                     store=DataStore(s.storage.data_root))
    with running_gateway(app) as gw:
        r = httpx.post(gw.base_url + "/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 2}, timeout=30)
        # refused at once, not timed out (that would be a 504 after the client's 5 s)
        assert r.status_code == 502 and r.json()["error"]["type"] == "engine_unavailable"
        assert "connection refused" in r.json()["error"]["message"]
        assert httpx.get(gw.url + "/healthz").status_code == 503


@contextlib.contextmanager
def _gateway_over_http_engine(gateway_settings, tokenizer, engine: FakeEngine, stall_s: float):
    """The gateway (stall timeout ``stall_s``) in front of ``engine`` behind the SGLang-compatible
    server, both over real HTTP; yields (gateway, OpenAI SDK client, store)."""
    with running_engine_server(lambda: engine) as eng:
        s = gateway_settings(engine__stall_timeout_s=stall_s)
        store = DataStore(s.storage.data_root)
        http_engine = SGLangClient(eng.url, timeout_s=stall_s)
        app = create_app(s, engine=http_engine, tokenizer=tokenizer, store=store)
        with running_gateway(app) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="open", max_retries=0, timeout=60)
            yield gw, client, lambda: _turns_stored(store, s.storage.data_root)
            gw.call(http_engine.close())  # ours, not the gateway's: closed on its loop


def _turns_stored(store: DataStore, data_root) -> int:
    store.flush()
    return run_query(data_root, "SELECT count(*) AS n FROM turns").to_pylist()[0]["n"]


def test_answers_that_keep_coming_outlive_the_stall_timeout(gateway_settings, tiny_engine):
    # 12 tokens 0.25 s apart: 3 s of answer under a 2 s stall timeout (the old whole-answer cap failed it); the
    # margin between a token's gap and the stall timeout is wide enough for a busy machine's scheduling delays
    engine = FakeEngine(len(tiny_engine.tokenizer), step_s=0.25)
    with _gateway_over_http_engine(gateway_settings, tiny_engine.tokenizer, engine, 2.0) as (gw, client, stored):
        t0 = time.monotonic()
        chunks = list(client.chat.completions.create(model="m", messages=MSG, max_tokens=12, stream=True))
        assert time.monotonic() - t0 > 2.5
        assert chunks[-1].choices[0].finish_reason == "length"
        plain = client.chat.completions.create(model="m", messages=MSG, max_tokens=12)  # non-streamed: 3 s too
        assert (plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("length", 12)
        assert stored() == 2


def test_a_stalled_engine_gets_504_engine_timeout_then_recovers(gateway_settings, tiny_engine):
    engine = FakeEngine(len(tiny_engine.tokenizer), stall_after=3)  # 3 tokens, then nothing
    with _gateway_over_http_engine(gateway_settings, tiny_engine.tokenizer, engine, 1.0) as (gw, client, stored):
        t0 = time.monotonic()
        r = httpx.post(gw.base_url + "/chat/completions", timeout=30,
                       json={"model": "m", "messages": MSG, "max_tokens": 8, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        err = events[-1]["error"]  # the status line went out with the first chunk: an OpenAI error event
        assert set(err) == {"message", "type", "param", "code"} and (err["type"], err["code"]) == ("engine_timeout", None)
        assert "nothing for 1 s" in err["message"] and r.text.rstrip().endswith("data: [DONE]")
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])  # never completed
        with pytest.raises(openai.APIStatusError) as exc:  # non-streamed: the stall, then the failed health probe
            client.chat.completions.create(model="m", messages=MSG, max_tokens=8)
        assert exc.value.status_code == 504 and exc.value.body["type"] == "engine_timeout"
        assert "has not answered POST /generate, and GET /health did not answer healthy" in exc.value.body["message"]
        assert time.monotonic() - t0 < 45  # the stall timeout ended both, not the client's 60 s (a busy machine is slower)
        ok = client.chat.completions.create(model="m", messages=MSG, max_tokens=2)  # shorter than the stall point
        assert ok.choices[0].finish_reason == "length"
        assert stored() == 1  # only the answered one


def test_weight_update_mid_traffic_rejects_nothing(gateway_settings, tiny_dir, tmp_path):
    """In-process engine: pause (retract) -> update from disk -> continue while 16 clients stream requests."""
    new_weights = save_perturbed_copy(tiny_dir, tmp_path / "v1")
    s = gateway_settings()
    engine = make_tiny_engine(tiny_dir, max_batch_size=16)
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store)
    results: list[tuple[int | str, str]] = []
    stop = threading.Event()

    def user(i: int) -> None:
        client = httpx.Client(timeout=300)  # 16 clients on 2 busy cores: slow answers are not what this tests
        while not stop.is_set():
            stream = i % 2 == 0
            try:
                r = client.post(app_url[0] + "/chat/completions",
                                json={"model": "m", "messages": [{"role": "user", "content": f"user {i}"}],
                                      "max_tokens": 24, "stream": stream, "session_id": f"u{i}", "turn_type": "side"})
            except httpx.HTTPError as e:  # counted as a failure, not lost with the thread
                results.append((repr(e), "?"))
                continue
            ok = r.status_code == 200 and (not stream or ("[DONE]" in r.text and '"error"' not in r.text))
            version = r.headers.get("x-weight-version", "?") if not stream else "stream"
            results.append((200 if ok else r.status_code, version))

    app_url: list[str] = []
    with running_gateway(app) as gw:
        app_url.append(gw.base_url)
        with ThreadPoolExecutor(16) as pool:
            for i in range(16):
                pool.submit(user, i)
            # the swap comes once version 0 has answered (the clients keep requests in flight meanwhile), and
            # the traffic stops once version 1 has answered too and 32 answers are in: events, not seconds
            wait_until(lambda: any(v == "0" for _, v in results), "an answer from version 0")
            gw.call(engine.pause_generation("retract"))
            res = gw.call(engine.update_weights_from_disk(str(new_weights), "1"))
            gw.call(engine.continue_generation())
            assert res.success, res.message
            wait_until(lambda: any(v == "1" for _, v in results) and len(results) >= 32,
                       "an answer from version 1 and 32 answers in all", progress=lambda: len(results))
            stop.set()
        assert httpx.get(gw.base_url + "/models").json()["data"][0]["weight_version"] == "1"
    codes = [c for c, _ in results]
    assert len(codes) >= 32 and codes.count(200) == len(codes), f"failures: {[c for c in codes if c != 200]}"
    versions = {v for _, v in results}
    assert {"0", "1"} <= versions  # served before and after the swap
