"""Engine hung, dead and back, with real processes; the judge backend down while training goes on.

The gateway (`clawrl serve`, engine.kind = "http") and the engine (`clawrl engine`) are separate
subprocesses. A hung engine is SIGSTOPped (it accepts connections and never answers): the gateway
answers 504 once the engine has sent nothing for engine.stall_timeout_s and left its health probe
unanswered as long (at most twice the stall timeout). A dead engine is SIGKILLed: 502 at once. Both come
as OpenAI error bodies. The engine is then started again on the same port and the SAME gateway
process serves again, without a restart. tests/gateway/test_gateway_faults.py covers the same
codes for in-thread servers.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.engine_server import running_engine_server
from tests.utils.gateway_process import engine_process, free_port, gateway_process, serve_env
from tests.utils.scripted_engine import ScriptedEngine
from tests.utils.turns import build_next_state, build_turn
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability]

TIMEOUT_S = 3.0  # engine.stall_timeout_s of the gateway under test


def _openai_error(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] is None  # OpenAI's: a string, or null
    assert isinstance(err["message"], str) and err["message"]
    return err


def _chat(url: str, sid: str, n: int) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": f"question {n}"}], "max_tokens": 4, "session_id": sid,
        "turn_type": "side"})


@pytest.mark.timeout(HANG_S)
def test_engine_hung_dead_and_back_without_a_gateway_restart(tmp_path, model_cache, tiny_dir):
    t_start = time.monotonic()
    data = tmp_path / "data"
    eng_port = free_port()
    eng_url = f"http://127.0.0.1:{eng_port}"
    env = serve_env(data, model_cache, engine__url=eng_url,
                    engine__stall_timeout_s=str(TIMEOUT_S))
    engine = engine_process(tmp_path, env, port=eng_port)
    gw = gateway_process(tmp_path, env)
    engine.start()
    gw.start()  # both start together: the gateway needs no engine to come up
    gw.wait_ready()
    engine.wait_ready()
    gw_pid = gw.pid
    client = OpenAI(base_url=gw.url + "/v1", api_key="open", max_retries=0, timeout=60)
    acked: list[int] = []

    def ok(n: int) -> None:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"question {n}"}],
                                           max_tokens=4, extra_body={"session_id": "faults", "turn_type": "side"})
        acked.append(r.model_extra["turn_index"])

    try:
        ok(0)

        # Hung: the engine process is stopped; its socket still accepts, nothing answers.
        os.kill(engine.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = _chat(gw.url, "faults", 1)
        hung_s = time.monotonic() - t0
        os.kill(engine.pid, signal.SIGCONT)
        assert r.status_code == 504, r.text
        err = _openai_error(r)
        assert err["type"] == "engine_timeout" and f"{TIMEOUT_S:g} s" in err["message"]
        # the stall, then the unanswered health probe; the slack is a busy machine's, far below the client's 60 s
        assert TIMEOUT_S - 0.5 <= hung_s <= 2 * TIMEOUT_S + 30
        ok(2)  # resumed engine: served again, same gateway

        # Dead: SIGKILL; nothing listens on the port any more.
        engine.kill()
        t0 = time.monotonic()
        r = _chat(gw.url, "faults", 3)
        dead_s = time.monotonic() - t0
        assert r.status_code == 502, r.text
        err = _openai_error(r)
        assert err["type"] == "engine_unavailable" and "connection refused" in err["message"]
        with pytest.raises(openai.InternalServerError) as exc:  # what an SDK user sees
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=4)
        assert exc.value.status_code == 502 and exc.value.body["type"] == "engine_unavailable"
        health = httpx.get(gw.url + "/healthz", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "engine_unhealthy"
        stream = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 4, "stream": True})
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "engine_unavailable" and stream.text.rstrip().endswith("data: [DONE]")
        assert all(e.get("choices", [{}])[0].get("finish_reason") is None for e in events[:-1])  # never completed

        # Back: a new engine process on the same port; the same gateway process serves again.
        engine.start()
        engine.wait_ready()
        assert gw.pid == gw_pid and gw.proc.poll() is None
        ok(4)
        assert httpx.get(gw.url + "/healthz", timeout=30).status_code == 200
    finally:
        for p in (engine, gw):
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        gw.stop()
        engine.stop()
    # Only the three answered turns were recorded; the failed requests left nothing behind.
    DataStore(data, background=False).close()
    rows = run_query(data, "SELECT turn_index FROM turns WHERE session_id = 'faults' ORDER BY 1").to_pylist()
    assert [r["turn_index"] for r in rows] == acked == [0, 1, 2]
    print(f"\nFIGURES engine_faults: hung->504 in {hung_s:.2f} s (timeout {TIMEOUT_S:g} s), dead->502 in {dead_s:.2f} s, "
          f"recovered without gateway restart: yes, engine starts={engine.starts}, failed requests recorded=0, "
          f"startup_s gateway={[round(x, 1) for x in gw.startup_s]} engine={[round(x, 1) for x in engine.startup_s]}, "
          f"wall_s={time.monotonic() - t_start:.1f}")


# ------------------------------------------------------------------------------ judge backend down


def _write_judgeable_turns(s, names: list[str]) -> list[str]:
    """Main turns with a user reply as next state, as the gateway records them; returns turn ids."""
    turns = [build_turn([{"role": "user", "content": f"question from {n}"}], session_id=n) for n in names]
    with DataStore(s.storage.data_root) as store:
        store.append(turns)
        store.append([build_next_state(t, [{"role": "user", "content": "thanks, perfect!"}]) for t in turns])
    return [t.turn_id for t in turns]


@pytest.mark.timeout(HANG_S)
def test_judge_backend_down_ends_turns_as_judge_error_and_training_goes_on(prefect_harness, make_settings,
                                                                             tmp_path, tiny_dir, monkeypatch):
    """[prm] backend = "engine" at a judge server (`[prm] engine_url`) that dies: the turns judged before it died train;
    the turns after it end with fate judge_error (the connection error kept in the verdict), are
    not judged again by a rerun under the same judge config, and block nothing."""
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    t_start = time.monotonic()

    def judge_model():  # a judge model that always answers +1 (text scripted, log-probs real)
        from clawrl.engine.embedded import EmbeddedEngine

        tiny = EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=2048)  # the PRM prompt is ~460 tokens
        scripted = ScriptedEngine(tiny, tiny.tokenizer)
        scripted.script.extend(["The user thanked the assistant.\n\\boxed{1}"] * 64)
        return scripted

    with running_engine_server(judge_model) as judge_server:
        monkeypatch.setattr("clawrl.flows.judge.RETRIES", 1)
        monkeypatch.setattr("clawrl.flows.judge.RETRY_DELAY_S", 0.2)
        s = make_settings({"prm.backend": "engine", "prm.engine_url": judge_server.url, "prm.judge_samples": 1,
                           "prm.max_new_tokens": 16,
                           "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2, "ppo.lr": 1e-4,
                           "ppo.micro_batch_size": 2, "engine.stall_timeout_s": 10.0})
        conf = tmp_path / "judge-down.toml"
        conf.write_text(dump_toml(s))
        before = _write_judgeable_turns(s, ["early-a", "early-b"])
        first = judge_flow(config_path=str(conf))
        assert first["fates"] == {"sample": 2}
    # The judge server is gone; nothing listens at prm.engine_url any more.
    after = _write_judgeable_turns(s, ["late-a", "late-b", "late-c"])
    t0 = time.monotonic()
    second = judge_flow(config_path=str(conf))
    judge_down_s = time.monotonic() - t0
    assert second["judged"] == 3 and second["fates"] == {"judge_error": 3}

    def q(sql):
        return run_query(s.storage.data_root, sql).to_pylist()

    fates = {r["turn_id"]: (r["fate"], r["n"]) for r in q("SELECT turn_id, any_value(fate) AS fate, count(*) AS n "
                                                           "FROM turn_fate GROUP BY turn_id")}
    assert {t: fates[t] for t in before} == {t: ("sample", 1) for t in before}
    assert {t: fates[t] for t in after} == {t: ("judge_error", 1) for t in after}
    errors = q(f"SELECT turn_id, error, score_reason, raw_outputs FROM verdicts WHERE turn_id IN "
               f"({', '.join(repr(t) for t in after)})")
    assert len(errors) == 3
    assert all(judge_server.url in e["error"] and "connection refused" in e["error"] for e in errors)
    assert all(e["score_reason"] == "all_failed" for e in errors)
    assert q("SELECT count(*) AS n FROM samples") == [{"n": 2}]

    # judge_error is final for this judge config: a rerun takes nothing (a new config judges afresh).
    assert judge_flow(config_path=str(conf))["judged"] == 0

    # Training is not held up by the failed turns: one PPO step on the two samples judged before.
    out = train_flow(config_path=str(conf), max_steps=3)
    [step] = out["steps"]
    assert step["weight_version"] == "1"
    [batch] = q("SELECT sample_ids FROM batches")
    trained_turns = {r["turn_id"] for r in q("SELECT turn_id FROM samples WHERE sample_id IN "
                                             f"({', '.join(repr(x) for x in batch['sample_ids'])})")}
    assert trained_turns == set(before)
    print(f"\nFIGURES judge_down: turns judged before the backend died=2 (samples=2), turns after=3 -> "
          f"judge_error=3 in {judge_down_s:.1f} s (retries=1), rerun re-judged=0, train steps on other samples=1 "
          f"(weight_version 1), wall_s={time.monotonic() - t_start:.1f}")
