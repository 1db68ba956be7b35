"""A 12k-token prompt through `clawrl serve` (a real subprocess, tiny-long model, 16k context, 64
batch rows): the gateway's memory stays bounded, and when the client goes away mid-generation the
engine drops the request at its next step and nothing is recorded."""

from __future__ import annotations

import threading
import time

import httpx

from tests.utils.gateway_process import ServerProcess, free_port, serve_env
from tests.utils.waiting import wait_until

RSS_BOUND_MB = 300  # growth over the idle gateway; a KV cache of 64 rows x 12k positions alone is ~400 MB here


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def _idle(url: str) -> bool:
    load = httpx.get(f"{url}/engine/v1/loads", timeout=30).json()["loads"][0]
    return load["num_running_reqs"] == load["num_waiting_reqs"] == 0


def _with_a_499(url: str) -> str | None:
    """The gateway's metrics once they count an abandoned completion (499), else None."""
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return metrics if 'clawrl_requests_total{status="499"' in metrics else None


def _tokens_generated(url: str) -> int:
    return httpx.get(f"{url}/engine/get_server_info", timeout=30).json()["internal_states"][0]["tokens_generated"]


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
        r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8},
                       timeout=600)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 12000
        before = _tokens_generated(server.url)
        # a client that gives up after 3 s of a 4,000-token answer
        try:
            r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4000,
                                      "min_tokens": 4000}, timeout=3.0)
            raise AssertionError(f"the 4,000-token answer came back within 3 s: nothing was aborted: {r.text[:300]}")
        except httpx.TimeoutException:
            pass
        # the gateway has counted the abandoned request (a 499) and the engine holds no request
        metrics = wait_until(lambda: _idle(server.url) and _with_a_499(server.url),
                             "the abandoned request counted and dropped by the engine", proc=server.proc,
                             log=server.log_path)
        sampling[0] = False
        abandoned_tokens = _tokens_generated(server.url) - before
    finally:
        server.kill()
    # stopped, not run to its end (counted in tokens, not seconds: a busy machine decodes slower, and the
    # gateway's watch, polling every 0.25 s, stops the engine at its next step)
    assert abandoned_tokens < 4000, f"the abandoned request ran to its end ({abandoned_tokens} tokens)"
    assert 'clawrl_requests_total{status="200",stream="false",turn_type="main"} 1.0' in metrics  # not a turn
    assert peak[0] - base <= RSS_BOUND_MB, f"RSS grew {peak[0] - base} MB (base {base} MB)"
