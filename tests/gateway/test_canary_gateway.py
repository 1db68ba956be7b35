"""`clawrl serve` with ``[gate] canary_share`` and ``canary_url``: the gateway builds the canary router over
its own embedded engine and the `clawrl engine` at canary_url (real HTTP both ways), main turns of canary
sessions are answered there while it holds a newer version, and a weight sync through the gateway's
/engine reaches the main engine only."""

from __future__ import annotations

import time

import httpx
from openai import OpenAI

from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from tests.utils.engine_server import make_tiny_engine, running_engine_server
from tests.utils.gateway_server import running_gateway
from tests.utils.traffic import canary_sessions


def test_canary_sessions_are_served_by_the_engine_at_canary_url(make_settings, tiny_dir):
    on_canary, on_champion = canary_sessions(0.5)
    with running_engine_server(lambda: make_tiny_engine(tiny_dir, weight_version="5")) as canary:
        s = make_settings({"gate.canary_share": 0.5, "gate.canary_url": canary.url, "server.open_mode": True})
        with running_gateway(create_app(s)) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)

            def version(sid, turn_type="main"):
                r = client.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": f"hello from {sid}"}], max_tokens=3,
                    extra_body={"session_id": sid, "turn_type": turn_type})
                return r.headers["x-weight-version"]

            got = {sid: version(sid) for sid in on_canary[:3] + on_champion[:3]}
            side = version(on_canary[1], "side")
            # the gateway's /engine is the main engine's: relabelled there, the canary is no longer newer
            root = gw.base_url.removesuffix("/v1")
            r = httpx.post(f"{root}/engine/update_weight_version", json={"new_version": "9"}, timeout=30)
            assert r.status_code == 200, r.text
            assert httpx.get(f"{canary.url}/get_model_info", timeout=30).json()["weight_version"] == "5"
            time.sleep(1.1)  # the router asks both versions again once a second (CanaryRouter.refresh_s)
            after = version(on_canary[2])
    assert got == {**{sid: "5" for sid in on_canary[:3]}, **{sid: "0" for sid in on_champion[:3]}}
    assert side == "0" and after == "9"
    rows = run_query(s.storage.data_root, "select session_id, weight_version from turns where turn_type = 'main' "
                     "order by created_at").to_pylist()
    assert [(r["session_id"], r["weight_version"]) for r in rows] == [*got.items(), (on_canary[2], "9")]
