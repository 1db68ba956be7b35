"""Engine down, slow, or swapping weights under traffic (a gateway killed under traffic: tests/reliability/test_gateway_kill.py)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from clawrl.engine.sglang_client import SGLangClient
from clawrl.gateway.routes import create_app
from clawrl.storage.writer import DataStore
from tests.utils.engine_server import make_tiny_engine, running_engine_server, save_perturbed_copy
from tests.utils.gateway_server import free_socket, running_gateway

MSG = [{"role": "user", "content": "hello"}]


def test_engine_down_gives_502_and_the_gateway_recovers(gateway_settings, tiny_dir, tiny_engine):
    sock = free_socket()
    dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    s = gateway_settings()
    app = create_app(s, engine=SGLangClient(dead_url, timeout_s=5), tokenizer=tiny_engine.tokenizer,
                     store=DataStore(s.storage.data_root))
    with running_gateway(app) as gw:
        r = httpx.post(gw.base_url + "/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=30)
        # refused at once, not timed out (that would be a 504 after the client's 5 s)
        assert r.status_code == 502 and r.json()["error"]["type"] == "engine_unavailable"
        assert "connection refused" in r.json()["error"]["message"]
        assert httpx.get(gw.url + "/healthz").status_code == 503


def test_engine_timeout_gives_504_then_recovers(gateway_settings, tiny_dir, tiny_engine):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir)) as eng:
        s = gateway_settings(engine__request_timeout_s=1.0)
        client = SGLangClient(eng.url, timeout_s=30)
        app = create_app(s, engine=client, tokenizer=tiny_engine.tokenizer, store=DataStore(s.storage.data_root))
        with running_gateway(app) as gw:
            httpx.post(eng.url + "/pause_generation", json={"mode": "in_place"}).raise_for_status()
            r = httpx.post(gw.base_url + "/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=30)
            # the gateway's 1 s deadline answered, not the engine client's 30 s one
            assert r.status_code == 504 and r.json()["error"]["type"] == "engine_timeout"
            assert r.json()["error"]["message"] == "engine did not answer within 1 s"
            httpx.post(eng.url + "/continue_generation", json={}).raise_for_status()
            ok = httpx.post(gw.base_url + "/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=30)
            assert ok.status_code == 200


def test_weight_update_mid_traffic_rejects_nothing(gateway_settings, tiny_dir, tmp_path):
    """In-process engine: pause (retract) -> update from disk -> continue while 16 clients stream requests."""
    new_weights = save_perturbed_copy(tiny_dir, tmp_path / "v1")
    s = gateway_settings()
    engine = make_tiny_engine(tiny_dir, max_batch_size=16)
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store)
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def user(i: int) -> None:
        client = httpx.Client(timeout=60)
        while not stop.is_set():
            stream = i % 2 == 0
            r = client.post(app_url[0] + "/chat/completions",
                            json={"messages": [{"role": "user", "content": f"user {i}"}], "max_tokens": 24,
                                  "stream": stream, "session_id": f"u{i}", "turn_type": "side"})
            ok = r.status_code == 200 and (not stream or ("[DONE]" in r.text and '"error"' not in r.text))
            version = r.headers.get("x-weight-version", "?") if not stream else "stream"
            results.append((200 if ok else r.status_code, version))

    app_url: list[str] = []
    with running_gateway(app) as gw:
        app_url.append(gw.base_url)
        with ThreadPoolExecutor(16) as pool:
            for i in range(16):
                pool.submit(user, i)
            time.sleep(2.0)
            gw.call(engine.pause_generation("retract"))
            res = gw.call(engine.update_weights_from_disk(str(new_weights), "1"))
            gw.call(engine.continue_generation())
            assert res.success, res.message
            time.sleep(2.0)
            stop.set()
        assert httpx.get(gw.base_url + "/models").json()["data"][0]["weight_version"] == "1"
    codes = [c for c, _ in results]
    assert len(codes) >= 32 and codes.count(200) == len(codes), f"failures: {[c for c in codes if c != 200]}"
    versions = {v for _, v in results}
    assert {"0", "1"} <= versions  # served before and after the swap
