"""The promotion gate in the train flow, on CPU with the tiny model: a helpful step is promoted and
served; a deliberately harmful one (the reward's sign flipped) is refused, and serving stays on the
champion without a single rejected request. The decisions are rows of the promotions view, MLflow
aliases and metrics, and a line of `clawrl status`."""

import json

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from clawrl import runtime
from clawrl.chat import ChatAdapter
from clawrl.config import dump_toml
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.evaluation import load_eval_set
from clawrl.flows.common import attach_policy_engine
from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils import gate_eval
from tests.utils.gateway_server import running_gateway
from tests.utils.traffic import WEIGHT_VERSION, canary_sessions, generate, side_chat, steady_traffic
from tests.utils.up_process import wait_healthy
from tests.utils.waiting import run_to_end, wait_until

EVALUATOR = gate_eval.EVALUATOR


def _conversation(client, sid, question):
    msgs = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=10, extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "thanks!"}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                   extra_body={"session_id": sid, "session_done": True})


@pytest.fixture
def gate_confs(make_settings, tmp_path):
    """Two configs over one data root: the users' reward, and the same reward with its sign flipped."""
    base = {"server.open_mode": True, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
            "ppo.temperature": 0.0, "ppo.lr": 1e-2, "prm.backend": "rule", "ppo.micro_batch_size": 2,
            "gate.evaluator": EVALUATOR, "gate.size": 4, "ppo.max_new_tokens": 8,
            "gate.tolerance": 0.05, "gate.alpha": 0.05}
    confs = {}
    for name, hook in (("helpful", "tests.utils.gate_eval:reward"), ("harmful", "tests.utils.gate_eval:flipped_reward")):
        s = make_settings({**base, "hooks.reward": hook})
        confs[name] = tmp_path / f"{name}.toml"
        confs[name].write_text(dump_toml(s))
    return s, confs


def _step(client, store, conf, tag):
    """Two conversations, a judge run and a train run under ``conf``: the train run's one step."""
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    for i, q in enumerate(gate_eval.QUESTIONS[:2]):
        _conversation(client, f"{tag}-{i}", q)
    store.flush()
    # a new judge config (the other reward) judges the earlier turns again too: the oldest batch is
    # the first step's turns, now with the other reward
    assert judge_flow(config_path=str(conf))["fates"]["sample"] >= 2
    [out] = train_flow(config_path=str(conf), max_steps=1)["steps"]
    return out


def test_a_harmful_step_is_refused_and_serving_stays_on_the_champion(prefect_harness, gate_confs, tiny_dir):
    s, confs = gate_confs
    gate_eval.fill_reference(tiny_dir)
    engine = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    attach_policy_engine(engine)
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store)
    try:
        with running_gateway(app) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x")
            good = _step(client, store, confs["helpful"], "helpful")
            assert good["gate"]["decision"] == "promote", good["gate"]["reason"]
            assert good["sync"]["success"] and good["gate"]["serve_version"] == "1"

            with steady_traffic(side_chat(gw.base_url), threads=3, key=WEIGHT_VERSION) as (served, failures):
                bad = _step(client, store, confs["harmful"], "harmful")  # measured while users keep being served
                wait_until(lambda: len(served) >= 3, "3 answers")
            r = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                                 max_tokens=4)
            assert r.headers["x-weight-version"] == "1"  # still the champion
    finally:
        attach_policy_engine(None)
        store.close()
    gate = bad["gate"]
    assert bad["weight_version"] == "2" and gate["decision"] == "refuse" and gate["serve_version"] == "1"
    assert gate["champion_mean"] == 1.0 and gate["candidate_mean"] < 1.0 and gate["n"] == 4
    assert gate["reason"].startswith(("worse by more than the tolerance 0.05", "significantly worse")), gate["reason"]
    assert bad["sync"]["success"] and bad["sync"]["skipped"]  # the champion already serves: nothing loaded
    assert failures == [] and len(served) >= 3 and set(served) == {"1"}
    # the promotions view: the evidence of both decisions
    rows = run_query(s.storage.data_root, "select action, weight_version, champion_version, source, n, candidate_mean, "
                     "champion_mean, mean_diff, p_value, tolerance from promotions order by created_at").to_pylist()
    assert [(r["action"], r["weight_version"], r["champion_version"]) for r in rows] == [
        ("promote", "1", "0"), ("refuse", "2", "1")]
    assert rows[0]["candidate_mean"] == rows[0]["champion_mean"] == 1.0 and rows[0]["mean_diff"] == 0.0
    assert rows[1]["mean_diff"] == pytest.approx(rows[1]["candidate_mean"] - 1.0) and rows[1]["tolerance"] == 0.05
    evals = run_query(s.storage.data_root, "select weight_version, eval_key, scores, n from evaluations "
                      "order by weight_version").to_pylist()
    assert [(r["weight_version"], r["n"]) for r in evals] == [("0", 4), ("1", 4), ("2", 4)]
    # the decision replays: a fresh evaluation engine measures both versions from their checkpoints again
    from clawrl.gate import decide_promotion
    from clawrl.promotion import score_version

    fresh = EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=1024)
    eval_set = load_eval_set(EVALUATOR, size=4, samples=2, seed=0, max_tokens=8, temperature=0.0)
    again = {v: score_version(s.storage.data_root, fresh, ChatAdapter(fresh.tokenizer), eval_set, v, tiny_dir)
             for v in ("2", "1")}
    runtime.run(fresh.close())
    assert {r["eval_key"] for r in evals} == {eval_set.key}
    assert again == {r["weight_version"]: r["scores"] for r in evals[1:]}
    assert decide_promotion(again["2"], again["1"], tolerance=0.05, alpha=0.05, floor=1.0).reason == gate["reason"]
    # MLflow: aliases on clawrl-policy, the gate's numbers on the step's run
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client

    c = mlflow_client(s.storage.data_root)
    assert c.get_model_version_by_alias(REGISTERED_MODEL, "champion").tags["weight_version"] == "1"
    assert c.get_model_version_by_alias(REGISTERED_MODEL, "candidate").tags["weight_version"] == "2"
    run = c.get_run(bad["mlflow_run_id"])
    assert run.data.metrics["gate_promoted"] == 0.0 and run.data.tags["gate_decision"] == "refuse"
    assert run.data.tags["gate_eval_set"] == "validation"
    assert run.data.metrics["gate_mean_diff"] == pytest.approx(gate["mean_diff"])
    assert c.get_run(good["mlflow_run_id"]).data.metrics["gate_promoted"] == 1.0
    # clawrl status: the champion and the refused candidate, never "waiting"
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status", "--config", str(confs["harmful"])])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("promotion:"))
    assert "champion version 1" in line and "candidate 2 refused" in line, line
    sync_line = next(x for x in res.output.splitlines() if x.startswith("last sync:"))
    assert "serving version 1" in sync_line and "waiting" not in sync_line, sync_line


def test_a_canary_share_of_sessions_gets_the_refused_candidate(prefect_harness, gate_confs, tiny_dir, tmp_path):
    """[gate] canary_share 0.5: after the harmful step is refused, main turns of canary sessions are
    answered by the candidate (v2) from the canary engine, everything else by the champion (v1); the
    turns record it, nobody is refused, and `syncs` (what every user is served) never names v2."""
    from clawrl.engine.canary import CanaryRouter
    from clawrl.flows.common import attach_canary_engine

    s, confs = gate_confs
    for name in confs:  # the same two configs with a canary
        text = confs[name].read_text()
        assert "canary_share = 0.0\n" in text
        confs[name].write_text(text.replace("canary_share = 0.0\n", "canary_share = 0.5\n"))
    gate_eval.fill_reference(tiny_dir)
    engine = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    canary = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    attach_policy_engine(engine)
    attach_canary_engine(canary)
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=CanaryRouter(engine, canary, 0.5), tokenizer=engine.tokenizer, store=store)
    on_canary, on_champion = canary_sessions(0.5)

    def served(client, sid, turn_type="main"):
        r = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"session_id": sid, "turn_type": turn_type})
        return r.headers["x-weight-version"]

    try:
        with running_gateway(app) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x")
            good = _step(client, store, confs["helpful"], "helpful")
            assert good["gate"]["decision"] == "promote" and good["canary"]["weight_version"] == "1"
            assert served(client, on_canary[0]) == "1"  # both engines hold v1: nothing newer to try
            with steady_traffic(side_chat(gw.base_url), threads=2, key=WEIGHT_VERSION) as (side, failures):
                bad = _step(client, store, confs["harmful"], "harmful")
                wait_until(lambda: len(side) >= 1, "an answer")
            versions = {sid: served(client, sid) for sid in on_canary[:3] + on_champion[:3]}
            side_of_canary = served(client, on_canary[0], "side")
    finally:
        attach_policy_engine(None)
        attach_canary_engine(None)
        store.close()
    assert bad["gate"]["decision"] == "refuse" and bad["gate"]["serve_version"] == "1"
    assert bad["canary"]["success"] and bad["canary"]["weight_version"] == "2" and bad["canary"]["target"] == "in-process"
    assert versions == {**{sid: "2" for sid in on_canary[:3]}, **{sid: "1" for sid in on_champion[:3]}}
    assert side_of_canary == "1"  # a side turn of a canary session: the champion
    assert failures == [] and set(side) == {"1"}
    recorded = run_query(s.storage.data_root, "select session_id, weight_version from turns where session_id like "
                         "'user-%' and turn_type = 'main'").to_pylist()
    assert {(r["session_id"], r["weight_version"]) for r in recorded} == {(on_canary[0], "1"), *versions.items()}
    synced = run_query(s.storage.data_root, "select weight_version, serving_version from syncs").to_pylist()
    assert "2" not in {r["weight_version"] for r in synced} | {r["serving_version"] for r in synced}
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status", "--config", str(confs["harmful"])])
    assert res.exit_code == 0, res.output
    assert "canary: 50% of sessions get the newest trained version (engine in the serving process)" in \
        res.output.splitlines()
    assert "serving version 1" in next(x for x in res.output.splitlines() if x.startswith("last sync:"))


def _write_samples(s, n: int) -> None:
    import random

    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.records import SampleRecord

    rng, chash = random.Random(0), build_judge_config_hash(s)
    with DataStore(s.storage.data_root) as store:
        store.append([SampleRecord(
            sample_id=f"smp{i:02d}", turn_id=f"turn{i:02d}", session_id=f"sess{i:02d}", judge_config_hash=chash,
            method="grpo", prompt_ids=[1] + [rng.randrange(3, 40000) for _ in range(6)],
            output_ids=[rng.randrange(3, 40000) for _ in range(5)] + [2], rollout_logprobs=[-7.0] * 6,
            reward=1.0 if i % 2 else -1.0, has_teacher=False, teacher_logprobs=None, weight_version="0")
            for i in range(n)])


def test_promote_and_rollback_by_hand_go_through_the_sync_path(prefect_harness, make_settings, tmp_path, tiny_dir):
    from clawrl.cli import app
    from clawrl.flows.train import train_flow
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client
    from tests.utils.engine_server import CONTEXT, PROMPT, make_tiny_engine, running_engine_server

    with running_engine_server(lambda: make_tiny_engine(tiny_dir), max_context_len=CONTEXT) as srv:
        s = make_settings({"engine.url": srv.url, "ppo.rollout_batch_size": 2,
                           "ppo.advantage_estimator": "grpo", "ppo.lr": 1e-3, "gate.size": 2, 
                           "ppo.max_new_tokens": 4})
        conf = tmp_path / "http.toml"
        conf.write_text(dump_toml(s))
        _write_samples(s, 4)
        steps = train_flow(config_path=str(conf), max_steps=2)["steps"]
        # the tiny model never pleases the default evaluator's user: equal scores, so both are promoted
        assert [(st["gate"]["decision"], st["sync"]["success"]) for st in steps] == [("promote", True)] * 2

        def serving() -> str:
            return srv.call(srv.engine.model_info())["weight_version"]

        assert serving() == "2"
        with steady_traffic(generate(srv.url, PROMPT)) as (served, failures):
            cli = CliRunner()
            res = cli.invoke(app, ["promote", "2", "--config", str(conf)])  # already the champion
            assert res.exit_code == 0 and serving() == "2", res.output
            res = cli.invoke(app, ["rollback", "--config", str(conf), "--reason", "live score fell"])
            assert res.exit_code == 0 and "rolled back from version 2 to version 1" in res.output, res.output
            assert serving() == "1"
            status = cli.invoke(app, ["status", "--config", str(conf)]).output  # v2 was rolled back from
            assert "is waiting" not in status and "checkpoint 2 waiting" not in status, status
            assert "champion version 1, rolled back from version 2 by hand (live score fell)" in status, status
            res = cli.invoke(app, ["rollback", "--config", str(conf)])
            assert res.exit_code == 0 and serving() == "0", res.output  # the initial weights, from the model dir
            res = cli.invoke(app, ["rollback", "--config", str(conf)])
            assert res.exit_code == 2 and "nothing to roll back to: the champion is version 0" in res.output
            res = cli.invoke(app, ["promote", "2", "--config", str(conf)])
            assert res.exit_code == 0 and "promoted version 2" in res.output and serving() == "2", res.output
            assert res.stdout.splitlines()[0] == f"data root {s.storage.data_root} (from {conf})"
            res = cli.invoke(app, ["promote", "9", "--config", str(conf)])
            assert res.exit_code == 2 and "no checkpoint of weight version '9'" in res.output
            wait_until(lambda: len(served) >= 4, "4 answers")
    assert failures == [] and len(served) >= 4
    rows = run_query(s.storage.data_root, "select action, weight_version, champion_version, source, reason "
                     "from promotions order by created_at").to_pylist()
    assert [(r["action"], r["weight_version"], r["champion_version"], r["source"]) for r in rows] == [
        ("promote", "1", "0", "gate"), ("promote", "2", "1", "gate"), ("promote", "2", "2", "manual"),
        ("rollback", "1", "2", "manual"),
        ("rollback", "0", "1", "manual"), ("promote", "2", "0", "manual")]
    assert rows[3]["reason"] == "live score fell"
    syncs = run_query(s.storage.data_root, "select weight_version, ok from syncs order by created_at").to_pylist()
    assert [(r["weight_version"], r["ok"]) for r in syncs][-4:] == [("2", True), ("1", True), ("0", True), ("2", True)]
    alias = mlflow_client(s.storage.data_root).get_model_version_by_alias(REGISTERED_MODEL, "champion")
    assert alias.tags["weight_version"] == "2"
    res = CliRunner().invoke(app, ["status", "--config", str(conf)])
    line = next(x for x in res.output.splitlines() if x.startswith("promotion:"))
    assert line == "promotion: champion version 2, promoted by hand (clawrl promote)", line


def test_rollbacks_reach_back_as_far_as_the_weights_are_kept(prefect_harness, make_settings, tmp_path, tiny_dir):
    """Six promoted versions, the trainer keeping the newest three checkpoints' weights: the gate keeps
    the champion's and the ROLLBACK_DEPTH before it (marked after each decision, pruned at the next
    step), so at least that many rollbacks in a row serve; one past the kept weights is refused in one
    line naming what still serves, with serving, the syncs and the promotions untouched."""
    from clawrl.cli import app
    from clawrl.flows.train import train_flow
    from clawrl.promotion import ROLLBACK_DEPTH
    from tests.utils.engine_server import CONTEXT, make_tiny_engine, running_engine_server

    steps = ROLLBACK_DEPTH + 3
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), max_context_len=CONTEXT) as srv:
        s = make_settings({"engine.url": srv.url, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
                           "ppo.lr": 1e-3, "ppo.max_staleness": steps, "gate.size": 2, "ppo.max_new_tokens": 4})
        conf = tmp_path / "http.toml"
        conf.write_text(dump_toml(s))
        _write_samples(s, 2 * steps)
        trained = train_flow(config_path=str(conf), max_steps=steps)["steps"]
        assert [st["gate"]["decision"] for st in trained] == ["promote"] * steps  # equal scores: all promoted
        kept = [v for v in range(1, steps + 1)
                if (s.storage.data_root / "checkpoints" / f"v{v:06d}" / "model.safetensors").is_file()]
        # step 6 pruned v1: neither among the newest three nor marked by the gate after step 5 (v2-v5)
        assert kept == [2, 3, 4, 5, 6]

        def serving() -> str:
            return srv.call(srv.engine.model_info())["weight_version"]

        def count(table: str) -> int:
            return run_query(s.storage.data_root, f"select count(*) as n from {table}").to_pylist()[0]["n"]

        cli = CliRunner()
        for back_to in ("5", "4", "3", "2"):
            res = cli.invoke(app, ["rollback", "--config", str(conf)])
            assert res.exit_code == 0 and f"to version {back_to}:" in res.stdout and serving() == back_to, res.output
            assert res.stdout.splitlines()[0] == f"data root {s.storage.data_root} (from {conf})"
        syncs, promotions = count("syncs"), count("promotions")
        res = cli.invoke(app, ["rollback", "--config", str(conf)])
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines() == [
            "cannot roll back to version 1: its weights were pruned (kept besides the newest checkpoints: the "
            "champion's and the 3 champions' before it); still servable: 6, 5, 4, 3, 2, 0 (`clawrl promote "
            "VERSION`); serving is unchanged"]
        res = cli.invoke(app, ["promote", "1", "--config", str(conf)])
        assert res.exit_code == 2 and res.stderr.startswith("cannot promote version 1: its weights were pruned; ")
        assert serving() == "2" and (count("syncs"), count("promotions")) == (syncs, promotions)
        status = cli.invoke(app, ["status", "--config", str(conf)]).stdout
        assert next(x for x in status.splitlines() if x.startswith("last sync:")).startswith("last sync: ok "), status
        doctor = json.loads(cli.invoke(app, ["doctor", "--json", "--config", str(conf)]).stdout)
        assert next(f for f in doctor["findings"] if f["name"] == "serving")["ok"], doctor  # no sync failed


def test_the_persona_demo_shows_the_gate_per_step(tmp_path, model_cache):
    """`clawrl demo` on the tiny model for two steps: every row has the gate's decision, both validation
    means and the candidate's held-out score; the gate scored the demo persona's validation questions.
    With a canary share of 0.5 (an engine in the demo's process), versions never promoted answer only main
    turns of canary sessions; the held-out evaluations (side turns) always get the champion."""
    import json
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    from tests.utils.demo_config import tiny_demo_config

    conf = tiny_demo_config(tmp_path, model_cache)
    conf.write_text(conf.read_text().replace("\nmin_gain = 0.0", "\ncanary_share = 0.5\nmin_gain = 0.0", 1))
    assert "canary_share = 0.5" in conf.read_text()
    run = tmp_path / "run"
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "demo", "-c", str(conf), "--persona", "lowercase",
                      "--steps", "2", "--users", "4", "--heldout", "4", "--eval-samples", "1", "--max-tokens", "8",
                      "--run-dir", str(run)], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((run / "reports" / "learning_curve.json").read_text())
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["candidate_score"] == rows[0]["served_score"] and "gate" not in rows[0]
    for r in rows[1:]:
        assert r["gate"] in ("promote", "refuse") and r["candidate_version"] == str(r["step"])
        assert 0.0 <= r["val_candidate"] <= 1.0 and 0.0 <= r["val_champion"] <= 1.0
        if r["gate"] == "promote":
            assert r["weight_version"] == r["candidate_version"] and r["candidate_score"] == r["served_score"]
        # conf/demo.toml's min_gain = 0: a tie or a loss on validation keeps the champion
        assert (r["gate"] == "promote") == (r["val_candidate"] > r["val_champion"]), r
    assert "promotion: champion version" in out.stdout and "gate" in out.stdout
    assert "by the gate on the validation set (" in out.stdout or "refused on the validation set (" in out.stdout
    run_conf = (run / "config.toml").read_text()
    assert 'evaluator = "clawrl.sim.validation:lowercase"' in run_conf and "max_new_tokens = 8" in run_conf
    evals = run_query(run, "select weight_version, n from evaluations order by weight_version").to_pylist()
    assert [(r["weight_version"], r["n"]) for r in evals] == [("0", 4), ("1", 4), ("2", 4)]
    import hashlib

    from clawrl.engine.canary import bucket

    champions = {"0"} | {r["weight_version"] for r in rows}  # what the curve's evaluations were served by
    turns = run_query(run, "select namespace, session_id, turn_type, weight_version from turns").to_pylist()
    assert {t["weight_version"] for t in turns if t["turn_type"] == "side"} <= champions
    for t in turns:
        if t["weight_version"] not in champions:  # a candidate never promoted: a canary session's main turn
            key = hashlib.blake2b(f"{t['namespace']}:{t['session_id']}".encode(), digest_size=8).hexdigest()
            assert t["turn_type"] == "main" and bucket(key) < 0.5, t
    if rows[1]["gate"] == "refuse":  # step 2's canary sessions (3 of its 4 users) were answered by v1
        assert any(t["weight_version"] == "1" and t["turn_type"] == "main" for t in turns)
    assert "canary: 50% of sessions get the newest trained version (engine in the serving process)" in out.stdout


def test_the_demo_refuses_more_validation_questions_than_it_has(tmp_path, model_cache):
    """[gate] size above the demo's 32 validation questions is named before anything starts."""
    from clawrl.cli import app
    from tests.utils.demo_config import tiny_demo_config

    conf = tiny_demo_config(tmp_path, model_cache)
    conf.write_text(conf.read_text().replace("\nsize = 4 ", "\nsize = 33 "))
    res = CliRunner().invoke(app, ["demo", "-c", str(conf), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "[gate] size = 33: the demo has 32 validation questions" in " ".join(res.output.split())
    assert not (tmp_path / "run").exists()


class _RatingJudge:
    """A scripted judge backend: every answer it is asked to rate gets +1; it keeps the prompts."""

    def __init__(self):
        self.prompts = []

    async def complete(self, messages, *, n, temperature, max_tokens):
        self.prompts.append(messages)
        return ["scripted rating \\boxed{1}"] * n


def test_the_gate_replays_recent_judged_turns_scored_by_the_judge(prefect_harness, make_settings, tmp_path,
                                                                   monkeypatch):
    """[gate] eval_set = "replay": the prompts are the requests of the newest judged main turns (one per
    session first), the judge rates each answer, and the promotion row names the set and its turn ids."""
    from datetime import timedelta
    from types import SimpleNamespace

    import clawrl.flows.common as common
    from clawrl.flows.train import train_flow
    from clawrl.judge.prompts import RATING_SYSTEM
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.records import FateRecord, JudgeVerdict
    from tests.utils.turns import T0, build_turn

    s = make_settings({"prm.backend": "engine", "gate.eval_set": "replay", "gate.size": 3, "ppo.rollout_batch_size": 2,
                       "ppo.advantage_estimator": "grpo", "ppo.lr": 1e-3})
    conf = tmp_path / "replay.toml"
    conf.write_text(dump_toml(s))
    judge = _RatingJudge()
    monkeypatch.setattr(common, "judge_for", lambda settings: SimpleNamespace(
        backend=judge, judge_samples=2, temperature=0.0, max_tokens=32, budget_chars=4000))
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": city}}]
    asked = (("Name a primary color.", "s1", 0, "main"), ("What do bees make?", "s3", 0, "main"),
             ("Weather in Paris?", "s2", 0, "main"), ("And in Rome?", "s1", 1, "main"), ("heartbeat", "s4", 0, "side"))
    turns = [build_turn([{"role": "user", "content": q}], session_id=sid, turn_index=i, turn_type=kind,
                        tools=tools if sid == "s2" else None) for q, sid, i, kind in asked]
    for k, t in enumerate(turns):
        t.created_at = t.completed_at = T0 + timedelta(minutes=k)
    chash = build_judge_config_hash(s)
    with DataStore(s.storage.data_root) as store:
        store.append(turns)
        store.append([r for t in turns for r in (JudgeVerdict(t.turn_id, chash, "engine", 1, "majority", [1, 1], "[]"),
                                                 FateRecord(t.turn_id, t.session_id, chash, "sample"))])
    _write_samples(s, 2)
    [step] = train_flow(config_path=str(conf), max_steps=1)["steps"]
    gate, expected = step["gate"], [turns[3].turn_id, turns[2].turn_id, turns[1].turn_id]
    assert gate["decision"] == "promote" and gate["serve_version"] == "1", gate["reason"]
    assert gate["eval_set"] == "replay" and gate["eval_turn_ids"] == expected and gate["n"] == 3
    assert gate["candidate_mean"] == gate["champion_mean"] == 1.0
    rows = run_query(s.storage.data_root, "select action, weight_version, source, eval_set, eval_turn_ids, eval_key, n "
                     "from promotions").to_pylist()
    evals = run_query(s.storage.data_root, "select weight_version, eval_key, n from evaluations "
                      "order by weight_version").to_pylist()
    assert [(r["action"], r["weight_version"], r["source"], r["eval_set"], r["eval_turn_ids"], r["n"])
            for r in rows] == [("promote", "1", "gate", "replay", expected, 3)]
    assert [(r["weight_version"], r["eval_key"], r["n"]) for r in evals] == [("0", rows[0]["eval_key"], 3),
                                                                            ("1", rows[0]["eval_key"], 3)]
    # 3 prompts x 2 answers x 2 versions, each rated from the conversation alone by the judge's rating prompt
    assert len(judge.prompts) == 12 and {p[0]["content"] for p in judge.prompts} == {RATING_SYSTEM}
    assert sum("Weather in Paris?" in p[1]["content"] for p in judge.prompts) == 4


def test_the_gate_scores_candidates_in_the_evaluation_engine_up_starts(prefect_harness, make_settings, tmp_path,
                                                                        monkeypatch, tiny_dir):
    """Under `clawrl up` each train run is a process of its own: the gate loads the candidate into up's
    evaluation engine (`clawrl engine`, over HTTP) instead of loading the model in the run; its scores are
    what an engine loaded in process measures, and the engine keeps the version it measured last."""
    from clawrl import supervisor
    from clawrl.engine import embedded
    from clawrl.engine.sglang_client import SGLangClient
    from clawrl.flows.train import train_flow
    from clawrl.promotion import score_version
    from clawrl.ports import free_api_port

    gate_eval.fill_reference(tiny_dir)
    s = make_settings({"server.api_port": free_api_port(), "gate.evaluator": EVALUATOR, "gate.size": 4,
                       "ppo.max_new_tokens": 8, "ppo.temperature": 0.0, "ppo.rollout_batch_size": 2, "ppo.lr": 1e-2,
                       "ppo.advantage_estimator": "grpo", "prm.backend": "rule", "engine.max_batch_size": 8,
                       "engine.max_context_len": 1024, "model.dtype": "float32", "model.device": "cpu"})
    conf = tmp_path / "up.toml"
    conf.write_text(dump_toml(s))
    services = {sv.name: sv for sv in supervisor.plan(s, conf, prefect_port=4200, mlflow_port=5000,
                                                      trainer_port=30020)}
    svc = services["eval-engine"]
    supervisor.start(svc, tmp_path / "logs", supervisor.child_env())
    try:
        wait_healthy(svc)
        for key, value in services["flows"].env.items():  # what `clawrl up` hands its flow runs
            monkeypatch.setenv(key, value)
        _write_samples(s, 2)

        def no_loading(*a, **k):
            raise AssertionError("the train run loaded an evaluation engine")

        monkeypatch.setattr(embedded.EmbeddedEngine, "__init__", no_loading)
        [step] = train_flow(config_path=str(conf), max_steps=1)["steps"]
        monkeypatch.undo()
        served = runtime.run(SGLangClient(svc.url).model_info())["weight_version"]
    finally:
        supervisor.stop(svc)
    gate = step["gate"]
    assert step["weight_version"] == "1" and gate["n"] == 4 and gate["decision"] in ("promote", "refuse")
    assert served == "1"  # the candidate it loaded last, from its checkpoint on disk
    evals = run_query(s.storage.data_root, "select weight_version, scores from evaluations "
                      "order by weight_version").to_pylist()
    assert [r["weight_version"] for r in evals] == ["0", "1"]
    fresh = EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=1024)
    eval_set = load_eval_set(EVALUATOR, size=4, samples=2, seed=0, max_tokens=8, temperature=0.0)
    again = {v: score_version(s.storage.data_root, fresh, ChatAdapter(fresh.tokenizer), eval_set, v, tiny_dir)
             for v in ("0", "1")}
    runtime.run(fresh.close())
    assert again == {r["weight_version"]: r["scores"] for r in evals}
    assert gate["candidate_mean"] == sum(again["1"]) / 4 and gate["champion_mean"] == sum(again["0"]) / 4
