"""Isolation over real HTTP with the real openai SDK and the tiny engine: API keys (401), per-key
session namespaces (a key cannot read, extend or close another key's session), admin-only routes
(403 for an API key, 401 without one) incl. the engine control API under /engine, pause/resume,
/admin/replay submitting the `replay/on-demand` Prefect deployment, and `clawrl sql` read-only."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import openai
import pytest
from openai import OpenAI

from clawrl.gateway.routes import create_app
from clawrl.records import CheckpointRecord
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.waiting import HANG_S, join, wait_until

pytestmark = [pytest.mark.reliability]

KEY_A, KEY_B = "sk-user-alpha-7d1f0c", "sk-user-beta-92ab4e"
ADMIN = "sk-admin-3c5e8a1b"
WRONG = "sk-not-a-key-55e0"


@pytest.fixture
def start_gateway(make_settings, tiny_engine, monkeypatch):
    """(settings, store, running gateway context) for given API keys / admin keys (None = unset)."""
    stores: list[DataStore] = []

    def start(api_keys: str | None, admin_keys: str | None, engine=None, **overrides):
        for name, value in (("CLAWRL_API_KEYS", api_keys), ("CLAWRL_ADMIN_KEYS", admin_keys)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        s = make_settings({"server.open_mode": api_keys is None, "ppo.max_new_tokens": 8, "ppo.temperature": 1.0,
                           **overrides})
        store = DataStore(s.storage.data_root)
        stores.append(store)
        app = create_app(s, engine=engine or tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)
        return s, store, running_gateway(app)

    yield start
    for store in stores:
        store.close()


def _ask(client: OpenAI, sid: str, messages: list[dict], done: bool = False):
    r = client.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=6, extra_headers={"X-Session-Id": sid,
                                                                   "X-Session-Done": "true" if done else "false"})
    return r.parse(), r


def _assert_openai_error(resp: httpx.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == type_
    assert body["error"]["code"] in (None, "unknown_parameter", "invalid_value")  # OpenAI's: a string, or null
    return body["error"]


@pytest.mark.timeout(HANG_S)
def test_no_key_or_a_wrong_key_is_401_and_the_key_is_not_echoed(start_gateway):
    _, _, ctx = start_gateway(f"{KEY_A},{KEY_B}", ADMIN)
    with ctx as gw:
        chat = gw.base_url + "/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        seen = []
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {KEY_A}"},
                        {"Authorization": f"Bearer {ADMIN}"}):  # an admin key is not an API key
            for method, url, kw in (("POST", chat, {"json": body}), ("GET", gw.base_url + "/models", {}),
                                    ("GET", gw.base_url + "/sessions/s1", {})):
                resp = httpx.request(method, url, headers=headers, **kw)
                err = _assert_openai_error(resp, 401, "authentication_error")
                seen.append(err["message"])
        with pytest.raises(openai.AuthenticationError) as e:
            OpenAI(base_url=gw.base_url, api_key=WRONG, max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        ok = OpenAI(base_url=gw.base_url, api_key=KEY_A, max_retries=0).models.list()
        assert ok.data[0].id == "clawrl-policy"
    assert len(seen) == 12 and set(seen) == {"missing API key: send 'Authorization: Bearer <key>'", "invalid API key"}
    assert not any(k in m for m in seen for k in (WRONG, KEY_A, ADMIN, "alpha", "55e0"))


@pytest.mark.timeout(HANG_S)
def test_a_key_cannot_read_extend_or_close_another_keys_session(start_gateway):
    s, store, ctx = start_gateway(f"{KEY_A},{KEY_B}", ADMIN)
    with ctx as gw:
        a = OpenAI(base_url=gw.base_url, api_key=KEY_A, max_retries=0)
        b = OpenAI(base_url=gw.base_url, api_key=KEY_B, max_retries=0)
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        r0, _ = _ask(a, "shared", msgs)
        msgs += [{"role": "assistant", "content": r0.choices[0].message.content}, {"role": "user", "content": "why?"}]
        r1, _ = _ask(a, "shared", msgs)
        # B sends A's session id, with A's whole history and X-Session-Done: its own new session
        b_msgs = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "B hijacks"}]
        rb, raw_b = _ask(b, "shared", b_msgs, done=True)
        assert rb.model_extra["turn_index"] == 0 and raw_b.headers["x-turn-index"] == "0"
        # A's session is still open and continues where it was (index 2; turn 1 waits for A's reply)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "ok"}]
        r2, _ = _ask(a, "shared", msgs)
        assert [r0.model_extra["turn_index"], r1.model_extra["turn_index"], r2.model_extra["turn_index"]] == [0, 1, 2]
        _ask(a, "only-a", [{"role": "user", "content": "private"}])

        def get(key, sid):
            return httpx.get(f"{gw.base_url}/sessions/{sid}", headers={"Authorization": f"Bearer {key}"})

        mine = get(KEY_A, "shared").json()
        assert mine["open"] is True and [t["turn_index"] for t in mine["turns"]] == [0, 1, 2]
        assert [t["text"] for t in mine["turns"]] == [r.choices[0].message.content for r in (r0, r1, r2)]
        assert [t["has_next_state"] for t in mine["turns"]] == [True, True, None]  # turn 2 still waits
        assert all(t["weight_version"] == "0" and t["turn_type"] == "main" for t in mine["turns"])
        theirs = get(KEY_B, "shared").json()  # B reads only its own session of that id
        assert theirs["open"] is False and [(t["turn_index"], t["text"]) for t in theirs["turns"]] == [
            (0, rb.choices[0].message.content)]
        b_turn = theirs["turns"][0]
        assert (b_turn["has_next_state"], b_turn["next_state_reason"]) == (False, "session_done")
        probe, missing = get(KEY_B, "only-a"), get(KEY_B, "never-existed")
        assert probe.status_code == missing.status_code == 404
        assert probe.content == missing.content  # nothing tells "exists elsewhere" from "does not exist"
        _assert_openai_error(probe, 404, "not_found_error")
        assert get(KEY_A, "only-a").status_code == 200
        _assert_openai_error(get(KEY_A, "bad%20id%3B"), 400, "invalid_request_error")
        store.flush()
    rows = run_query(s.storage.data_root, """
        select t.namespace, t.turn_index, n.has_next_state, n.reason from turns t
        left join next_states n using (turn_id) where t.session_id = 'shared' order by t.namespace, t.turn_index
    """).to_pylist()
    by_ns: dict[str, list] = {}
    for r in rows:
        by_ns.setdefault(r["namespace"], []).append((r["turn_index"], r["has_next_state"], r["reason"]))
    assert sorted(map(len, by_ns.values())) == [1, 3]
    a_rows = next(v for v in by_ns.values() if len(v) == 3)
    b_rows = next(v for v in by_ns.values() if len(v) == 1)
    # A's links are A's own: turn 0 -> "why?", turn 1 -> "ok"; B's done never closed them
    assert a_rows == [(0, True, "next_request"), (1, True, "next_request"), (2, None, None)]
    assert b_rows == [(0, False, "session_done")]
    ns_msgs = run_query(s.storage.data_root, "select messages from next_states where session_id = 'shared' "
                        "and has_next_state order by turn_index").to_pylist()
    assert [json.loads(r["messages"])[-1]["content"] for r in ns_msgs] == ["why?", "ok"]


class GatedEngine:
    """The tiny engine, but generate() waits until ``release`` is set (a turn held in flight)."""

    def __init__(self, engine):
        self.engine, self.entered, self.release = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, req):
        self.entered.set()
        await asyncio.to_thread(self.release.wait, 60)
        return await self.engine.generate(req)


@pytest.mark.timeout(HANG_S)
def test_admin_routes_need_an_admin_key_and_pause_lets_turns_in_flight_finish(start_gateway, tiny_engine):
    gated = GatedEngine(tiny_engine)
    s, store, ctx = start_gateway(KEY_A, ADMIN, engine=gated)
    user, admin = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {ADMIN}"}
    with ctx as gw:
        admin_calls = [("POST", "/admin/pause", None), ("POST", "/admin/resume", None),
                       ("POST", "/admin/replay", {"version": "1"}),
                       ("POST", "/engine/pause_generation", {}), ("POST", "/engine/continue_generation", {}),
                       ("POST", "/engine/update_weights_from_disk", {"model_path": "/nonexistent"}),
                       ("POST", "/engine/flush_cache", None), ("GET", "/engine/model_info", None),
                       ("POST", "/engine/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})]
        statuses = []
        for method, path, body in admin_calls:
            for headers, status, kind in (({}, 401, "authentication_error"),
                                          ({"Authorization": f"Bearer {WRONG}"}, 401, "authentication_error"),
                                          (user, 403, "permission_error")):
                _assert_openai_error(httpx.request(method, gw.url + path, headers=headers, json=body), status, kind)
                statuses.append(status)
        assert statuses.count(401) == 18 and statuses.count(403) == 9
        assert gated.entered.is_set() is False  # nothing reached the engine: /engine/generate was refused
        assert httpx.get(gw.url + "/engine/health").status_code == 200  # liveness stays open
        info = httpx.get(gw.url + "/engine/model_info", headers=admin)
        assert info.status_code == 200 and info.json()["weight_version"] == "0"

        # pause while a turn is in flight: it finishes and is logged; new turns get 503 + Retry-After
        client = OpenAI(base_url=gw.base_url, api_key=KEY_A, max_retries=0, timeout=60)
        results: list = []
        t = threading.Thread(target=lambda: results.append(_ask(client, "inflight", [
            {"role": "user", "content": "held"}])[0]))
        t.start()
        wait_until(gated.entered.is_set, "the turn to reach the engine")
        assert httpx.post(gw.url + "/admin/pause", headers=admin).json() == {"paused": True}
        refused = httpx.post(gw.base_url + "/chat/completions", headers=user,
                             json={"model": "m", "messages": [{"role": "user", "content": "new"}], "max_tokens": 2})
        err = _assert_openai_error(refused, 503, "service_unavailable")
        assert refused.headers["retry-after"] == "5" and "paused" in err["message"]
        with pytest.raises(openai.InternalServerError) as e:  # what an SDK user sees (after its retries)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "new"}])
        assert e.value.status_code == 503
        assert httpx.get(gw.url + "/healthz").json()["paused"] is True
        gated.release.set()
        join(t)
        assert len(results) == 1 and results[0].model_extra["turn_index"] == 0
        assert httpx.post(gw.url + "/admin/resume", headers=admin).json() == {"paused": False}
        after, _ = _ask(client, "after", [{"role": "user", "content": "again"}])
        assert after.choices[0].message.content is not None
        store.flush()
    logged = run_query(s.storage.data_root, "select session_id from turns order by created_at").to_pylist()
    assert [r["session_id"] for r in logged] == ["inflight", "after"]  # the 503s left nothing in the log


@pytest.mark.timeout(HANG_S)
def test_open_mode_opens_admin_routes_only_without_admin_keys(start_gateway, caplog):
    with caplog.at_level(logging.WARNING, logger="clawrl.gateway"):
        _, _, ctx = start_gateway(None, None)
        with ctx as gw:
            assert httpx.post(gw.url + "/admin/pause").status_code == 200
            assert httpx.post(gw.url + "/admin/resume").status_code == 200
            assert httpx.get(gw.url + "/engine/model_info").status_code == 200
    assert any("OPEN ADMIN" in r.getMessage() for r in caplog.records)
    _, _, ctx = start_gateway(None, ADMIN)  # open API, keyed admin
    with ctx as gw:
        chat = httpx.post(gw.base_url + "/chat/completions", timeout=60,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}):
            _assert_openai_error(httpx.post(gw.url + "/admin/pause", headers=headers), 401, "authentication_error")
            _assert_openai_error(httpx.get(gw.url + "/engine/model_info", headers=headers), 401, "authentication_error")
        assert httpx.post(gw.url + "/admin/pause", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    _, _, ctx = start_gateway(KEY_A, None)  # keyed API, no admin keys: admin closed to everyone
    with ctx as gw:
        err = _assert_openai_error(httpx.post(gw.url + "/admin/pause", headers={"Authorization": f"Bearer {KEY_A}"}),
                                   403, "permission_error")
        assert "admin_keys_env" in err["message"]


KEY_WARNINGS = ("OPEN MODE", "OPEN ADMIN", "no admin keys in env")


@pytest.mark.timeout(HANG_S)
def test_a_user_gateway_warns_about_missing_admin_keys_but_a_process_own_gateway_does_not(
        start_gateway, make_settings, tiny_engine, monkeypatch, caplog):
    from clawrl.serving import serve_own_gateway

    with caplog.at_level(logging.WARNING, logger="clawrl.gateway"):
        _, _, ctx = start_gateway(KEY_A, None)
        with ctx:
            pass
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(KEY_WARNINGS)]
    assert len(said) == 1 and said[0].startswith("no admin keys in env CLAWRL_ADMIN_KEYS"), said
    caplog.clear()
    monkeypatch.delenv("CLAWRL_ADMIN_KEYS", raising=False)
    s = make_settings({"server.open_mode": False})
    store = DataStore(s.storage.data_root)
    with caplog.at_level(logging.WARNING, logger="clawrl.gateway"):
        for keys in (["user-key-1", "user-key-2"], None):  # the users demo's panel; a bench's open client
            gw = serve_own_gateway(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store, api_keys=keys)
            try:
                assert httpx.get(gw.url + "/v1/models", timeout=30,
                                 headers={"Authorization": f"Bearer {(keys or ['x'])[0]}"}).status_code == 200
            finally:
                gw.stop()
    store.close()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(KEY_WARNINGS)] == []


@pytest.mark.timeout(HANG_S)
def test_admin_replay_submits_the_on_demand_deployment(prefect_harness, start_gateway, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from clawrl.flows.replay import replay_flow

    api = PREFECT_API_URL.value()
    s, store, ctx = start_gateway(KEY_A, ADMIN)
    deployment_id = replay_flow.to_deployment(name="on-demand", parameters={"config_path": "/conf/x.toml"}).apply()
    store.append(CheckpointRecord(weight_version="3", step=3, batch_id="b3", parent_version="2", path="/p",
                                  sha256="0" * 64, mlflow_run_id="a" * 32))
    store.flush()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with ctx as gw:
        url = gw.url + "/admin/replay"
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        err = _assert_openai_error(httpx.post(url, headers=admin, json={"version": "1"}), 503, "service_unavailable")
        assert "PREFECT_API_URL" in err["message"]
        monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens on port 9
        err = _assert_openai_error(httpx.post(url, headers=admin, json={"version": "1"}), 503, "service_unavailable")
        assert "not reachable" in err["message"]
        monkeypatch.setenv("PREFECT_API_URL", api)
        _assert_openai_error(httpx.post(url, headers=admin, json={"version": "1", "run_id": "a" * 32}), 400,
                             "invalid_request_error")
        _assert_openai_error(httpx.post(url, headers=admin, json={"set": ["nodot"]}), 400, "invalid_request_error")
        _assert_openai_error(httpx.post(url, headers=admin, json={"run_id": "b" * 32}), 404, "invalid_request_error")
        typo = _assert_openai_error(httpx.post(url, headers=admin, json={"versoin": "1"}), 400, "invalid_request_error")
        assert (typo["param"], typo["code"]) == ("versoin", "unknown_parameter")
        by_version = httpx.post(url, headers=admin, json={"version": "1", "exclude_sessions": ["s1"],
                                                          "reason": "user asked", "set": ["ppo.lr=1e-4"]})
        by_run = httpx.post(url, headers=admin, json={"run_id": "a" * 32})
        assert by_version.status_code == by_run.status_code == 200, (by_version.text, by_run.text)

    async def read(run_id):
        async with get_client() as client:
            return await client.read_flow_run(run_id)

    r1, r2 = (asyncio.run(read(r.json()["flow_run_id"])) for r in (by_version, by_run))
    assert r1.deployment_id == r2.deployment_id == deployment_id
    assert r1.parameters == {"config_path": "/conf/x.toml", "version": "1", "exclude_sessions": ["s1"],
                             "reason": "user asked", "set_overrides": ["ppo.lr=1e-4"]}
    assert r2.parameters["version"] == "3"  # the version that MLflow run trained
    assert r1.state.type.value == "SCHEDULED"  # the flow server of `clawrl up` picks it up


@pytest.mark.timeout(HANG_S)
def test_clawrl_sql_is_read_only_but_queries_and_exports_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from clawrl.cli import app
    from tests.utils.turns import build_turn

    data = tmp_path / "data"
    with DataStore(data, background=False) as store:
        store.append([build_turn([{"role": "user", "content": f"q{i}"}], session_id=f"s{i}") for i in range(3)])
        store.flush()
    conf = tmp_path / "conf.toml"
    conf.write_text(f'[storage]\ndata_root = "{data}"\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)  # DuckDB's default temp directory is ./.tmp: nothing may appear here either
    tables = data / "tables" / "turns"

    def files():
        return sorted(p for root in (data, outside) for p in root.rglob("*"))

    before = files()
    runner = CliRunner()

    def sql(*args):
        return runner.invoke(app, ["sql", *args, "-c", str(conf)], env={"COLUMNS": "200"})

    refused = {
        f"COPY (SELECT 1) TO '{outside / 'x.csv'}'": "COPY statements are not allowed",
        f"COPY turns TO '{tables / 'evil.parquet'}' (FORMAT parquet)": "COPY statements are not allowed",
        "CREATE TABLE t AS SELECT 1": "CREATE statements are not allowed",
        "INSERT INTO turns SELECT * FROM turns": "INSERT statements are not allowed",
        f"ATTACH '{outside / 'x.duckdb'}' AS x": "ATTACH statements are not allowed",
        "INSTALL httpfs": "INSTALL statements are not allowed",
        "LOAD httpfs": "LOAD statements are not allowed",
        "SET enable_external_access = true": "SET statements are not allowed",
        f"EXPORT DATABASE '{outside / 'exp'}'": "EXPORT statements are not allowed",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{outside / 'y.csv'}'": "EXPLAIN statements are not allowed",
        f"SELECT 1; COPY (SELECT 1) TO '{outside / 'z.csv'}'": "COPY statements are not allowed",
        "PRAGMA enable_profiling": "PRAGMA statements are not allowed",
        # queries that try to reach files outside the tables: refused by DuckDB's own locked settings
        "SELECT * FROM read_csv('/etc/passwd')": "file system operations are disabled",
        f"SELECT * FROM glob('{outside}/*')": "file system operations are disabled",
        "SELECT * FROM read_text('/etc/hostname')": "file system operations are disabled",
    }
    for query, message in refused.items():
        res = sql(query)
        assert res.exit_code == 2 and message in res.stderr, (query, res.output)
        assert "Traceback" not in res.output
    assert "read-only" in sql("CREATE TABLE t AS SELECT 1").stderr
    assert files() == before  # nothing written, anywhere
    # what still works: queries, and exports that clawrl itself writes
    ok = sql("SELECT session_id FROM turns ORDER BY session_id", "-f", "csv")
    assert ok.exit_code == 0 and ok.stdout == "session_id\ns0\ns1\ns2\n"
    assert sql("EXPLAIN SELECT count(*) FROM turns").exit_code == 0
    assert sql("DESCRIBE turns").exit_code == 0
    out = tmp_path / "export.parquet"
    assert sql("SELECT session_id, output_ids FROM turns ORDER BY 1", "-f", "parquet", "-o", str(out)).exit_code == 0
    import pyarrow.parquet as pq

    assert pq.read_table(out).to_pylist() == [{"session_id": f"s{i}", "output_ids": [11, 12, 13]} for i in range(3)]
    js = tmp_path / "export.json"
    assert sql("SELECT count(*) AS n FROM turns", "-f", "json", "-o", str(js)).exit_code == 0
    assert json.loads(js.read_text()) == [{"n": 3}]
