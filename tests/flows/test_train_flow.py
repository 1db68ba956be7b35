"""The closed loop on CPU with the tiny model and rollout_batch_size = 2: gateway -> judge -> train
-> sync -> the gateway serves weight_version 1; MLflow traces the version back to the turns."""

import json
from pathlib import Path

import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.gateway.routes import create_app
from clawrl.flows.common import attach_policy_engine
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.traffic import WEIGHT_VERSION, side_chat, steady_traffic
from tests.utils.waiting import wait_until


def _conversation(client, sid, question, feedback):
    msgs = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=10, extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": feedback}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                   extra_body={"session_id": sid, "session_done": True})


@pytest.fixture
def loop_settings(make_settings, tmp_path):
    s = make_settings({"server.open_mode": True, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "combine",
                       "ppo.temperature": 1.0, "ppo.lr": 1e-3, "prm.backend": "rule", "ppo.micro_batch_size": 2})
    conf = tmp_path / "loop.toml"
    conf.write_text(dump_toml(s))
    return s, conf


def test_closed_loop_serves_version_1_traced_to_its_turns(prefect_harness, loop_settings, tiny_dir):
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    s, conf = loop_settings
    engine = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    attach_policy_engine(engine)  # the in-process sync path: the trainer's state dict
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store)
    try:
        with running_gateway(app) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x")
            _conversation(client, "alice", "What is the capital of France?", "no, answer in one word please")
            _conversation(client, "bob", "Name a primary color.", "thanks, perfect!")
            store.flush()
            judged = judge_flow(config_path=str(conf))
            assert judged["fates"]["sample"] == 2, judged

            with steady_traffic(side_chat(gw.base_url), threads=4, key=WEIGHT_VERSION) as (served, failures):
                wait_until(lambda: "0" in served, "an answer from version 0")
                out = train_flow(config_path=str(conf), max_steps=3)  # across the weight sync
                wait_until(lambda: "1" in served and len(served) >= 4, "an answer from version 1")
            [step] = out["steps"]  # 2 samples = exactly one batch of 2
            assert step["weight_version"] == "1" and step["sync"]["success"], step["sync"]
            r = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                                 max_tokens=4)
            assert r.headers["x-weight-version"] == "1"
            assert client.models.list().data[0].model_extra["weight_version"] == "1"
    finally:
        attach_policy_engine(None)
        store.close()
    assert failures == [] and len(served) >= 4 and {"0", "1"} <= set(served)
    # lineage: checkpoint row -> batch -> samples -> the two sessions' first turns
    [ck] = run_query(s.storage.data_root, "select * from checkpoints").to_pylist()
    assert ck["weight_version"] == "1" and ck["mlflow_run_id"] == step["mlflow_run_id"]
    turns = run_query(s.storage.data_root, f"""
        select s.namespace, t.session_id, t.turn_index from batches b, unnest(b.sample_ids) as u(sid)
        join samples s on s.sample_id = u.sid join turns t on t.turn_id = s.turn_id
        where b.batch_id = '{ck["batch_id"]}' order by 1""").to_pylist()
    assert turns == [{"namespace": "open", "session_id": "alice", "turn_index": 0},  # the judge records the namespace
                     {"namespace": "open", "session_id": "bob", "turn_index": 0}]
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client

    initial, mv = sorted(mlflow_client(s.storage.data_root).search_model_versions(f"name = '{REGISTERED_MODEL}'"),
                         key=lambda m: int(m.version))  # the initial weights are registered before the first step
    assert (initial.tags["weight_version"], initial.run_id, mv.tags["weight_version"]) == ("0", None, "1")
    assert mv.run_id == ck["mlflow_run_id"] and mv.tags["batch_id"] == ck["batch_id"]
    run = mlflow_client(s.storage.data_root).get_run(mv.run_id)
    from mlflow.models import Model  # the version page's MLmodel: flavor and signature, in the checkpoint

    mlmodel = Model.load(mv.source.removeprefix("file://"))
    assert mlmodel.flavors["clawrl"]["sha256"] == ck["sha256"] and mlmodel.flavors["clawrl"]["weight_version"] == "1"
    assert mlmodel.signature.inputs.input_names() == ["messages"]
    assert run.data.params["method"] == "combine" and float(run.data.params["lr"]) == 1e-3
    assert {"loss", "kl", "entropy", "clip_frac"} <= set(run.data.metrics)
    # the sync of version 1 at step 1, like the step's other metrics (step = weight version)
    [synced] = mlflow_client(s.storage.data_root).get_metric_history(mv.run_id, "sync_ok")
    assert (synced.step, synced.value) == (1, 1.0) and run.data.tags["sync_status"] == "ok"
    assert [m.step for m in mlflow_client(s.storage.data_root).get_metric_history(mv.run_id, "loss")] == [1]
    # clawrl doctor's report after the step: one metric per finding, and the report itself
    assert run.data.metrics["doctor_ok_traffic"] == 1.0 and run.data.metrics["doctor_ok_serving"] == 1.0
    assert run.data.metrics["doctor_problems"] == sum(v == 0.0 for k, v in run.data.metrics.items()
                                                      if k.startswith("doctor_ok_"))
    report = json.loads((Path(run.info.artifact_uri.removeprefix("file://")) / "doctor.json").read_text())
    assert [f["name"] for f in report["findings"]][:2] == ["traffic", "next_states"]
    assert report["learning_by_version"][0]["weight_version"] == "0"  # the two judged turns v0 served
    png = Path(run.info.artifact_uri.removeprefix("file://")) / "learning_by_version.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Prefect <-> MLflow: the run names its flow run; the flow run, named for the version, links the run
    fr_id = run.data.tags["prefect.flow_run_id"]
    assert run.data.tags["prefect.flow_run_url"].endswith(f"/flow-run/{fr_id}")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as pc:  # the session's Prefect server: other tests' train-v1 runs are there too
        fr = pc.read_flow_run(fr_id)
        [art] = pc.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
    assert fr.name == "train-v1" and art.key == "train-v1"
    exp_id = run.info.experiment_id
    assert f"(http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{mv.run_id})" in art.data
    assert f"(http://127.0.0.1:5000/#/models/clawrl-policy/versions/{mv.version})" in art.data
    assert mlflow_client(s.storage.data_root).get_experiment(exp_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"  # the UI's model-training view
    [ds] = run.inputs.dataset_inputs
    assert ds.dataset.name == f"batch-{ck['batch_id']}"
    # curves over weight versions: the step's metrics at step 1 (its version) of the policy run, its parent
    ml = mlflow_client(s.storage.data_root)
    policy = ml.get_run(run.data.tags["mlflow.parentRunId"])
    assert policy.info.run_name == "policy" and policy.data.tags["kind"] == "policy"
    [point] = ml.get_metric_history(policy.info.run_id, "loss")
    assert point.step == 1 and point.value == pytest.approx(run.data.metrics["loss"])
    # clawrl lineage prints the chain down to the sessions
    from typer.testing import CliRunner

    from clawrl.cli import app

    res = CliRunner().invoke(app, ["lineage", "1", "--config", str(conf)])
    assert res.exit_code == 0, res.output
    assert "session open:alice" in res.output and "session open:bob" in res.output and ck["batch_id"] in res.output
    assert CliRunner().invoke(app, ["lineage", "latest", "--config", str(conf)]).output == res.output  # v1 is newest


def test_policy_points_are_logged_once_per_version_and_key(tmp_path):
    """A re-run (after a crash) or a second evaluation of a version adds no second point; new keys
    at a known version and new versions do."""
    from clawrl.lineage import client as mlflow_client, log_policy_point

    run_id = log_policy_point(tmp_path, 1, {"loss": 0.5, "kl": 0.01})
    assert log_policy_point(tmp_path, 1, {"loss": 0.9, "heldout_score": 0.75, "skipped": None}) == run_id
    log_policy_point(tmp_path, 2, {"loss": 0.25})
    ml = mlflow_client(tmp_path)
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "heldout_score")] == [(1, 0.75)]
    assert ml.get_metric_history(run_id, "skipped") == []


def test_held_out_scores_are_points_at_the_candidates_version_and_the_served_score_a_series_of_its_own():
    """Refused candidates no longer pile their scores onto the served version's step 0 (one point, a bar in
    MLflow): each candidate's held-out score sits at its own version, the served score beside it."""
    from clawrl.flows.loop import policy_points

    keys = ["score", "on_topic_rate", "candidate_score", "kl"]
    base = {"step": 0, "weight_version": "0", "score": 0.25, "on_topic_rate": 0.5, "candidate_score": 0.25, "kl": 0.0}
    refused = {"step": 1, "weight_version": "0", "candidate_version": "1", "gate": "refuse", "score": 0.25,
               "on_topic_rate": 0.5, "candidate_score": 0.125, "kl": 0.0}
    promoted = {"step": 2, "weight_version": "2", "candidate_version": "2", "gate": "promote", "score": 0.75,
                "on_topic_rate": 1.0, "candidate_score": 0.75, "kl": 0.03}
    assert policy_points(base, keys, True) == [(0, {"heldout_score": 0.25, "heldout_on_topic_rate": 0.5,
                                                    "heldout_kl": 0.0, "served_heldout_score": 0.25})]
    assert policy_points(refused, keys, True) == [(1, {"heldout_score": 0.125, "served_heldout_score": 0.25})]
    assert policy_points(refused, keys, False) == [(1, {"served_heldout_score": 0.25})]  # tools: not measured
    assert policy_points(promoted, keys, True) == [(2, {"heldout_score": 0.75, "heldout_on_topic_rate": 1.0,
                                                        "heldout_kl": 0.03, "served_heldout_score": 0.75})]
    assert policy_points({"step": 3, "weight_version": None}, keys, True) == []


def test_the_initial_weights_carry_the_champion_alias_while_they_are_the_champion(tmp_path):
    """Version 0 has no training run, yet it is a model version of clawrl-policy (registered once), so
    `@champion` sits on it while no candidate was promoted, and moves off it when one is."""
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client, register_initial_weights, set_policy_alias

    base = tmp_path / "base-model"
    base.mkdir()
    first = register_initial_weights(tmp_path, base)
    assert register_initial_weights(tmp_path, base) == first  # once
    assert set_policy_alias(tmp_path, "champion", "0", initial_weights=base) == first
    ml = mlflow_client(tmp_path)
    mv = ml.get_model_version_by_alias(REGISTERED_MODEL, "champion")
    assert (str(mv.version), mv.tags["weight_version"], mv.source) == (first, "0", base.as_uri())
    assert set_policy_alias(tmp_path, "champion", "7") is None  # a version with no model version: no alias left
    assert "champion" not in ml.get_registered_model(REGISTERED_MODEL).aliases


def test_sync_points_are_at_the_weight_version_and_retries_stay_visible(tmp_path):
    from clawrl.lineage import client as mlflow_client, experiment_id, log_sync

    ml = mlflow_client(tmp_path)
    run_id = ml.create_run(experiment_id(ml, tmp_path), run_name="step-0003").info.run_id
    log_sync(tmp_path, run_id, ok=False, error="engine refused", serving_version="2", seconds=0.5,
             target="http://e", weight_version="3")
    assert ml.get_run(run_id).data.tags["sync_error"] == "engine refused"
    log_sync(tmp_path, run_id, ok=True, error=None, serving_version="3", seconds=0.25, target="http://e",
             weight_version="3")
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "sync_ok")] == [(3, 0.0), (3, 1.0)]
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "sync_seconds")] == [(3, 0.5), (3, 0.25)]
    tags = ml.get_run(run_id).data.tags
    assert "sync_error" not in tags and (tags["sync_status"], tags["sync_serving_version"]) == ("ok", "3")


def test_the_store_keeps_mlflow_default_experiment_under_the_data_root(tmp_path, monkeypatch):
    """MLflow makes an experiment 0 "Default" in every new store; clawrl's keeps its artifacts under the
    data root (not in the working directory) and, like clawrl's own, opens in the model-training view."""
    from clawrl.lineage import client as mlflow_client, experiment_id

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = tmp_path / "data"
    ml = mlflow_client(root)
    default = ml.get_experiment("0")
    assert default.name == "Default"
    assert default.artifact_location == (root / "mlflow" / "artifacts" / "0").as_uri()
    assert default.tags["mlflow.experimentKind"] == "custom_model_development"
    exp = ml.get_experiment(experiment_id(ml, root))
    assert exp.name == "clawrl" and exp.artifact_location == (root / "mlflow" / "artifacts").as_uri()
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert mlflow_client(root).get_experiment("0").artifact_location == default.artifact_location  # kept
    assert list(cwd.iterdir()) == []  # nothing made in the working directory


def test_a_process_killed_while_making_the_store_leaves_no_half_made_store(tmp_path):
    """MLflow makes its tables, then runs its migrations, each committed on its own, for seconds: a
    process killed in between (a train run's warm-up makes the store while its step trains) must not
    leave an ``mlflow.db`` that every later open fails on ("table guardrails already exists")."""
    import sys
    import textwrap

    from clawrl.lineage import client as mlflow_client, experiment_id
    from tests.utils.waiting import run_to_end

    root = tmp_path / "data"
    script = textwrap.dedent(f"""
        import os, sqlalchemy
        import mlflow.store.db.utils as u
        def killed_mid_migration(engine):  # the first tables, one table of a later migration, then SIGKILL
            with engine.begin() as c:
                c.execute(sqlalchemy.text("create table guardrails (guardrail_id varchar(36))"))
            os._exit(137)
        u._upgrade_db = killed_mid_migration
        from clawrl.lineage import client
        client({str(root)!r})
    """)
    proc = run_to_end([sys.executable, "-c", script])
    assert proc.returncode == 137, proc.stderr[-3000:]
    mdir = root / "mlflow"
    assert not (mdir / "mlflow.db").exists()
    assert [p.name for p in mdir.iterdir() if p.name.endswith(".tmp")] != []  # the killed process's copy
    ml = mlflow_client(root)  # a whole store, the killed process's copy swept away
    assert ml.get_experiment(experiment_id(ml, root)).name == "clawrl"
    assert ml.get_experiment("0").tags["mlflow.experimentKind"] == "custom_model_development"
    assert sorted(p.name for p in mdir.iterdir()) == ["artifacts", "mlflow.db"]


def test_a_store_is_made_where_hard_links_are_not_allowed(tmp_path, monkeypatch):
    from clawrl.lineage import client as mlflow_client, experiment_id

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted", str(dst))

    monkeypatch.setattr("os.link", no_links)
    root = tmp_path / "data"
    ml = mlflow_client(root)
    assert ml.get_experiment(experiment_id(ml, root)).name == "clawrl"
    assert sorted(p.name for p in (root / "mlflow").iterdir()) == ["artifacts", "mlflow.db"]


def test_a_train_run_without_a_batch_is_named_idle_for_when_it_ran(prefect_harness, loop_settings):
    import re

    from prefect.client.orchestration import get_client

    from clawrl.flows.train import train_flow

    s, conf = loop_settings
    state = train_flow(config_path=str(conf), return_state=True)  # no samples: nothing to train
    assert state.result() == {"steps": []}
    with get_client(sync_client=True) as pc:
        name = pc.read_flow_run(state.state_details.flow_run_id).name
    assert re.fullmatch(r"train-idle-\d{8}-\d{6}", name), name  # not a random "sandy-oyster", nor a step's name
