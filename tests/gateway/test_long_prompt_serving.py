"""A 12k-token prompt through `clawrl serve` (a real subprocess, tiny-long model, 16k context, 64
batch rows): the gateway's memory stays bounded, and when the client goes away mid-generation the
engine is idle again within a step and nothing is recorded."""

from __future__ import annotations

import threading
import time

import httpx

from tests.utils.gateway_process import ServerProcess, free_port, serve_env

RSS_BOUND_MB = 300  # growth over the idle gateway; a KV cache of 64 rows x 12k positions alone is ~400 MB here


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def test_a_long_prompt_keeps_memory_bounded_and_a_gone_client_frees_the_engine(tmp_path, model_cache):
    port = free_port()
    env = serve_env(tmp_path / "data", model_cache, model__name="tiny-long", engine__max_context_len=16384,
                    engine__max_batch_size=64, ppo__max_new_tokens=8)
    server = ServerProcess(["serve", "--port", str(port)], port, env, tmp_path / "serve.log")
    server.start()
    try:
        server.wait_ready()
        base = rss_mb(server.pid)
        peak, sampling = [base], [True]

        def sample() -> None:
            while sampling[0]:
                peak[0] = max(peak[0], rss_mb(server.pid))
                time.sleep(0.01)

        threading.Thread(target=sample, daemon=True).start()
        prompt = "the quick brown fox jumps over the lazy dog. " * 1200
        url = f"{server.url}/v1/chat/completions"
        # served in full: prefilled in 2048-token chunks
        r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 12000
        # a client that gives up after 3 s of a 4,000-token answer
        try:
            r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4000,
                                      "min_tokens": 4000}, timeout=3.0)
            raise AssertionError(f"the 4,000-token answer came back within 3 s: nothing was aborted: {r.text[:300]}")
        except httpx.TimeoutException:
            gone = time.monotonic()
        while True:
            load = httpx.get(f"{server.url}/engine/v1/loads", timeout=10).json()["loads"][0]
            if load["num_running_reqs"] == load["num_waiting_reqs"] == 0:
                break
            assert time.monotonic() - gone < 5, f"the engine still runs the abandoned request: {load}"
            time.sleep(0.02)
        sampling[0] = False
        idle_after = time.monotonic() - gone
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.kill()
    assert idle_after < 2.0  # the watch polls every 0.25 s; the engine stops at its next step
    assert 'clawrl_requests_total{status="499"' in metrics  # the abandoned completion: not a turn
    assert 'clawrl_requests_total{status="200",stream="false",turn_type="main"} 1.0' in metrics
    assert peak[0] - base <= RSS_BOUND_MB, f"RSS grew {peak[0] - base} MB (base {base} MB)"
