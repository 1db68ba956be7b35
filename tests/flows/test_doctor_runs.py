"""`clawrl doctor` on three runs broken for real, the way users break them: the gateway serves the tiny
model to clients of the openai SDK over HTTP, the judge flow runs in Prefect, and the doctor reads the
tables they leave (tests/test_doctor.py covers each finding from hand-written tables)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from clawrl.cli import app as cli
from clawrl.config import dump_toml
from clawrl.gateway.routes import create_app
from clawrl.judge.pipeline import ERROR_PREFIX
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_process import gateway_process, serve_env
from tests.utils.gateway_server import running_gateway
from tests.utils.judge_model_hook import VERDICT
from tests.utils.samples import two_turn_session
from tests.utils.waiting import wait_until

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "How many legs does a spider have?",
             "What do bees make?", "Which planet is the largest?", "What is 2 + 2?"]


@pytest.fixture
def broken_run(prefect_harness, make_settings, tiny_engine, tmp_path):
    """run(talk, **settings) -> (the run's settings, the doctor's text report, its findings by name):
    ``talk(client)`` plays the clients against a gateway on the run's data root, then one judge flow run
    judges what they left."""

    def run(talk, idle_timeout_s: float | None = None, **overrides):
        s = make_settings({"server.open_mode": True, "ppo.rollout_batch_size": 64, **overrides})
        conf = tmp_path / "run.toml"
        conf.write_text(dump_toml(s))
        store = DataStore(s.storage.data_root)
        app = create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)
        with pytest.MonkeyPatch.context() as mp:
            if idle_timeout_s is not None:  # a short idle timeout: the sweeper closes the sessions while we wait
                mp.setattr("clawrl.gateway.sessions.SESSION_IDLE_TIMEOUT_S", idle_timeout_s)
            with running_gateway(app) as gw:
                talk(OpenAI(base_url=gw.base_url, api_key="x", max_retries=0))
                if idle_timeout_s is not None:  # until the sweeper has closed every session
                    wait_until(lambda: httpx.get(gw.url + "/healthz", timeout=30).json()["open_sessions"] == 0,
                               "the idle sessions closed")
        store.close()
        from clawrl.flows.judge import judge_flow

        judge_flow(config_path=str(conf))
        text = CliRunner().invoke(cli, ["doctor", "-c", str(conf)])
        as_json = CliRunner().invoke(cli, ["doctor", "-c", str(conf), "--json"])
        assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
        findings = {f["name"]: f for f in json.loads(as_json.output)["findings"]}
        return s, text.output, findings

    return run


def failing(findings: dict) -> list[str]:
    return [name for name, f in findings.items() if not f["ok"]]


def fates(s) -> dict[str, int]:
    rows = run_query(s.storage.data_root, "select fate, count(*) as n from turn_outcomes group by fate").to_pylist()
    return {r["fate"]: r["n"] for r in rows}


def test_a_client_that_sends_each_message_alone_starts_a_session_per_request(broken_run):
    """A stateless client: no session id and no history, so every request is a session of its own and no
    turn ever gets the user's next message; the sessions close when idle."""
    def talk(client):
        for i, q in enumerate(QUESTIONS):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=8)
            client.chat.completions.create(model="m", max_tokens=2,
                                           messages=[{"role": "user", "content": f"thanks, that answers {i}!"}])

    s, text, found = broken_run(talk, idle_timeout_s=0.5)
    assert fates(s) == {"no_next_state": 12}
    assert failing(found) == ["next_states"]
    f = found["next_states"]
    assert f["summary"] == ("12 of 12 judged main turns got no next state, 0 of them before the last turn of their "
                            "session; 12 of 12 sessions have one turn")
    assert "every request starts a new session" in f["cause"] and "X-Session-Id" in f["fix"]
    assert "1 problem found" in text and "FAIL next_states" in text and "send a stable session id" in text


def test_a_judge_model_that_never_writes_a_boxed_score(broken_run):
    """The 'engine' judge with the tiny random-init model: its votes are never a \\boxed{} score, so every
    judged turn scores 0 and is dropped."""
    def talk(client):
        for i, q in enumerate(QUESTIONS):
            two_turn_session(client, f"s{i}", q, "no, that's wrong" if i % 2 else "thanks, that's great!")

    s, text, found = broken_run(talk, **{"ppo.advantage_estimator": "grpo", "prm.backend": "engine",
                                         "prm.judge_samples": 3, "prm.max_new_tokens": 24})
    assert fates(s) == {"score_zero": 6, "no_next_state": 6}  # the first turns judged, the last ones have no reply
    assert failing(found) == ["judge_votes", "judge_zero"]
    assert found["judge_votes"]["summary"].startswith("18 of 18 judge votes unparseable (100%) over 6 verdicts; "
                                                      "most common outputs: ")
    assert "\\boxed{1}" in found["judge_votes"]["cause"] and "[prm] backend" in found["judge_votes"]["fix"]
    assert found["judge_zero"]["summary"] == "6 of 12 judged turns scored 0 and were dropped"
    assert "2 problems found" in text


def test_a_hint_model_that_never_writes_a_usable_hint(broken_run, tmp_path, model_cache):
    """On-policy distillation with a judge model (a `clawrl serve` of the tiny model, reached as the
    'provider' backend) that scores every turn -1 but whose hints are the random model's own text: no
    turn gets a teacher, all are dropped as no_hint."""
    judge = gateway_process(tmp_path, serve_env(tmp_path / "judge-data", model_cache, engine__max_context_len="2048",
                                                hooks__generate="tests.utils.judge_model_hook:generate"),
                            name="judge-model")
    judge.start()
    try:
        judge.wait_ready()

        def talk(client):
            for i, q in enumerate(QUESTIONS):
                two_turn_session(client, f"s{i}", q, "no, that's wrong")

        s, text, found = broken_run(talk, **{"ppo.advantage_estimator": "on_policy_distillation",
                                             "prm.backend": "provider", "provider.base_url": judge.url + "/v1",
                                             "provider.model": "tiny", "prm.judge_samples": 3,
                                             "prm.max_new_tokens": 24})
    finally:
        judge.stop()
    assert fates(s) == {"no_hint": 6, "no_next_state": 6}
    verdicts = run_query(s.storage.data_root, "select score, votes, raw_outputs, hint, hint_raw_outputs "
                                              "from verdicts").to_pylist()
    assert [v["score"] for v in verdicts] == [-1] * 6 and all(v["votes"] == [-1, -1, -1] for v in verdicts)
    assert all(json.loads(v["raw_outputs"]) == [VERDICT] * 3 for v in verdicts)
    # the hint votes are the model's own words (no decision, no hint block), not failed requests
    hint_votes = [json.loads(v["hint_raw_outputs"]) for v in verdicts]
    assert all(v["hint"] is None for v in verdicts) and all(len(h) == 1 for h in hint_votes)
    assert all(isinstance(h[0], str) and h[0] and h[0] != VERDICT and "boxed" not in h[0]
               and not h[0].startswith(ERROR_PREFIX) for h in hint_votes)
    assert failing(found) == ["hints"]
    assert found["hints"]["summary"] == "0 usable hints of 6 asked (0% accepted)"
    assert "no usable hindsight hint" in found["hints"]["cause"] and "dropped (no_hint)" in found["hints"]["cause"]
    assert "[prm] backend" in found["hints"]["fix"] and "hint_samples" not in found["hints"]["fix"] and "1 problem found" in text
