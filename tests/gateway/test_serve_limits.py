"""`clawrl serve` says at start the context it serves (by default the model's own limit) and the
most K/V memory its engine may hold; /v1/models and the engine's /server_info say the same. It keeps an
idle keep-alive connection open longer than clients do, so they, not it, close idle ones."""

from __future__ import annotations

import http.client
import time

import httpx

from tests.utils.gateway_process import gateway_process, serve_env


def test_serve_states_the_models_context_and_its_kv_budget(tmp_path, model_cache):
    # max_context_len 0 (the default): tiny's max_position_embeddings, 4096
    env = {**serve_env(tmp_path / "data", model_cache, engine__max_context_len="0", engine__max_batch_size="4"),
           "CLAWRL_ADMIN_KEYS": "adm"}
    gw = gateway_process(tmp_path, env)
    gw.start()
    try:
        gw.wait_ready()
        card = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"][0]
        info = httpx.get(gw.url + "/engine/server_info", headers={"Authorization": "Bearer adm"}, timeout=10).json()
        idle_conn_kept = _keeps_idle_connection(gw.port, idle_s=6.5)
    finally:
        gw.stop()
    log = gw.log_tail()
    # KV: 4 rows x 4096 positions; a token slot is K and V x 2 layers x 2 heads x 16 dims x 4 bytes = 512 B,
    # 16384 x 512 B = 8 MiB; the prefix cache keeps max(context, KV / 4) = 4096 tokens = 2 MiB
    assert ("context 4096 tokens (the model's limit); KV cache up to 16384 tokens = 8 MiB (given back when idle) "
            "+ prefix cache up to 4096 tokens = 2 MiB (kept for reuse)") in log, log
    assert card["max_model_len"] == info["context_length"] == 4096
    # an idle keep-alive connection outlives the 5 s after which httpx (the openai SDK) drops it itself
    assert idle_conn_kept


def _keeps_idle_connection(port: int, idle_s: float) -> bool:
    """One keep-alive request, then ``idle_s`` idle: does a second request on the same connection get an
    answer? (http.client never reconnects by itself: a connection the server closed raises here.)"""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(idle_s)  # the idle time under test, not a wait for something to happen
        conn.request("GET", "/metrics")
        try:
            ok = conn.getresponse().status == 200
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return False
        return ok and conn.sock is first
    finally:
        conn.close()
