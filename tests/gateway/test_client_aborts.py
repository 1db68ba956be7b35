"""A client that goes away mid-answer, over real HTTP: its engine request stops, and the gateway
logs one line and counts one abort (``clawrl_client_aborts_total``) per such request."""

from __future__ import annotations

import logging

import httpx

from tests.utils.waiting import wait_until

LONG = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2000, "min_tokens": 2000}


def _aborts(gw, stream: str) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'clawrl_client_aborts_total{{stream="{stream}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_gone_mid_answer_is_logged_counted_and_stopped(gateway, tiny_engine, caplog):
    caplog.set_level(logging.WARNING, logger="clawrl.gateway")
    _, _, ctx = gateway()
    with ctx as gw:
        assert _aborts(gw, "true") == _aborts(gw, "false") == 0
        with httpx.stream("POST", gw.base_url + "/chat/completions", json={**LONG, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():  # a few tokens of 2,000, then the client hangs up
                events += line.startswith("data: {")
                if events == 4:
                    break
        wait_until(lambda: _aborts(gw, "true") == 1, "the abandoned stream counted")
        wait_until(lambda: tiny_engine.stats["running"] == 0, "the engine to stop the abandoned stream")
        try:  # not streamed: the client gives up after 2 s of a 2,000-token answer
            httpx.post(gw.base_url + "/chat/completions", json=LONG, timeout=2.0)
            raise AssertionError("the 2,000-token answer came back within 2 s: nothing was abandoned")
        except httpx.TimeoutException:
            pass
        wait_until(lambda: _aborts(gw, "false") == 1, "the abandoned completion counted")
        wait_until(lambda: tiny_engine.stats["running"] == 0, "the engine to stop the abandoned completion")
        assert _aborts(gw, "true") == 1  # one count per abort
    gone = [r.getMessage() for r in caplog.records if r.getMessage().startswith("client went away")]
    assert len(gone) == 2, gone
    assert all("aborted in the engine, nothing recorded" in m for m in gone)
