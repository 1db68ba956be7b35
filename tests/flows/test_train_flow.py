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

    [mv] = mlflow_client(s.storage.data_root).search_model_versions(f"name = '{REGISTERED_MODEL}'")
    assert (mv.version, mv.tags["weight_version"]) == (1, "1")  # model version N is weight version N
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
    assert [f["name"] for f in report["findings"]][:3] == ["traffic", "judge_config", "next_states"]
    assert report["learning_by_version"][0]["weight_version"] == "0"  # the two judged turns v0 served
    png = Path(run.info.artifact_uri.removeprefix("file://")) / "learning_by_version.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Prefect <-> MLflow: the run names its flow run; the flow run, named for the version, links the run
    fr_id = run.data.tags["prefect.flow_run_id"]
    url = run.data.tags["prefect.flow_run_url"]
    assert url.endswith(f"/runs/flow-run/{fr_id}") and f"[{fr_id}]({url})" in run.data.tags["mlflow.note.content"]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as pc:  # the session's Prefect server: other tests' train-v1 runs are there too
        fr = pc.read_flow_run(fr_id)
        [art] = pc.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
    assert fr.name == "train-v1" and art.key == "train-v1"
    assert _beginning_line(fr.id) == "Beginning flow run 'train-v1' for flow 'train'"  # named so from its start
    exp_id = run.info.experiment_id
    view = "?workflowType=machine_learning"  # the MLflow UI's model-training view
    assert f"(http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{mv.run_id}{view})" in art.data
    assert f"(http://127.0.0.1:5000/#/models/clawrl-policy/versions/{mv.version}{view})" in art.data
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
    assert log_policy_point(tmp_path, 1, {"loss": 0.9, "served_score": 0.75, "skipped": None}) == run_id
    log_policy_point(tmp_path, 2, {"loss": 0.25})
    ml = mlflow_client(tmp_path)
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    assert [(m.step, m.value) for m in ml.get_metric_history(run_id, "served_score")] == [(1, 0.75)]
    assert ml.get_metric_history(run_id, "skipped") == []


def test_every_row_reaches_the_policy_run_at_its_version_with_the_served_and_the_candidate_score_apart():
    """Each curve row is a point at the version it decided on, refused candidate or not, so the served
    on-topic, persona, KL and word-count curves end at the same version as the scores (they stopped at the
    last promoted version); ``served_*`` is what users got after the decision, ``candidate_score`` the
    candidate's own, two names for two numbers."""
    from clawrl.flows.loop import policy_points

    keys = ["served_score", "on_topic_rate", "candidate_score", "kl"]
    base = {"step": 0, "weight_version": "0", "served_score": 0.25, "on_topic_rate": 0.5, "candidate_score": 0.25,
            "kl": 0.0}
    refused = {"step": 1, "weight_version": "0", "candidate_version": "1", "gate": "refuse", "served_score": 0.25,
               "on_topic_rate": 0.5, "candidate_score": 0.125, "kl": 0.0}
    unmeasured = {**refused, "candidate_score": None}  # tools: a refused candidate's score is not measured
    promoted = {"step": 2, "weight_version": "2", "candidate_version": "2", "gate": "promote", "served_score": 0.75,
                "on_topic_rate": 1.0, "candidate_score": 0.75, "kl": 0.03}
    assert policy_points(base, keys) == [(0, {"served_score": 0.25, "served_on_topic_rate": 0.5, "served_kl": 0.0,
                                              "candidate_score": 0.25})]
    assert policy_points(refused, keys) == [(1, {"served_score": 0.25, "served_on_topic_rate": 0.5, "served_kl": 0.0,
                                                 "candidate_score": 0.125})]
    assert policy_points(unmeasured, keys)[0][1]["candidate_score"] is None  # log_policy_point leaves it out
    assert policy_points(promoted, keys) == [(2, {"served_score": 0.75, "served_on_topic_rate": 1.0, "served_kl": 0.03,
                                                  "candidate_score": 0.75})]
    assert policy_points({"step": 3, "weight_version": None}, keys) == []


def test_a_refused_candidate_gets_its_measured_score_or_none_never_the_served_one():
    from clawrl.flows.loop import _gate_row

    served = {"served_score": 0.5}
    refuse = {"decision": "refuse", "reason": "worse", "candidate_version": "3"}
    assert _gate_row(refuse, served, 0.25)["candidate_score"] == 0.25
    assert _gate_row(refuse, served, None)["candidate_score"] is None
    assert _gate_row({**refuse, "decision": "promote"}, served, None)["candidate_score"] == 0.5
    assert _gate_row(None, served, None) == {"candidate_score": 0.5}  # no step: the served version stands


def test_model_version_n_holds_weight_version_n_and_the_initial_weights_champion_is_a_tag(tmp_path):
    """MLflow numbers versions from 1 and the initial weights were registered first, so version N+1 held weight
    version N (and MLflow's reserved alias @vN named the wrong one). Now only trained versions are registered,
    in order: version N is weight version N. While the initial weights serve, no version is @champion and the
    registered model's tag champion_weight_version says 0."""
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client, set_policy_alias

    first, second = _logged_step(tmp_path, 1), _logged_step(tmp_path, 2)
    ml = mlflow_client(tmp_path)
    versions = sorted(ml.search_model_versions(f"name = '{REGISTERED_MODEL}'"), key=lambda m: int(m.version))
    assert [(m.version, m.tags["weight_version"], m.run_id) for m in versions] == [
        (1, "1", first["run_id"]), (2, "2", second["run_id"])]
    assert versions[1].description == "Weight version 2, trained from version 1 on batch batch2."
    assert ml.get_model_version(REGISTERED_MODEL, "2").source == Path(second["path"]).as_uri()
    assert set_policy_alias(tmp_path, "champion", "2") == "2"
    assert ml.get_model_version_by_alias(REGISTERED_MODEL, "champion").tags["weight_version"] == "2"
    assert set_policy_alias(tmp_path, "champion", "0") is None  # rolled back to the initial weights
    model = ml.get_registered_model(REGISTERED_MODEL)
    assert "champion" not in model.aliases and model.tags["champion_weight_version"] == "0"
    assert "model version N is weight version N" in model.description
    _logged_step(tmp_path, 2)  # a re-run after a crash registers nothing twice
    assert len(ml.search_model_versions(f"name = '{REGISTERED_MODEL}'")) == 2


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
    assert _beginning_line(state.state_details.flow_run_id) == f"Beginning flow run '{name}' for flow 'train'"


def test_a_run_that_finds_nothing_is_named_idle_and_keeps_what_its_name_said():
    import re

    from clawrl.flows.slots import idle_name

    assert idle_name("judge-20261206-182346") == "judge-idle-20261206-182346"
    assert idle_name("judge-overlap-3") == "judge-idle-overlap-3"
    assert idle_name("train-idle-20261206-182346") == "train-idle-20261206-182346"  # named idle when it began
    assert re.fullmatch(r"train-idle-\d{8}-\d{6}", idle_name("train-v4"))  # its batch turned out too stale


def _beginning_line(flow_run_id) -> str:
    """The flow run's "Beginning flow run '<name>' ..." log line, as Prefect's server keeps it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=120)  # the lines this process still queues for the server
    with get_client(sync_client=True) as pc:
        logs = pc.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return next(log.message for log in logs if log.message.startswith("Beginning"))


def _logged_step(root: Path, version: int) -> dict:
    """A step's lineage as the train flow logs it (a checkpoint directory with no weights: MLflow never reads them)."""
    from clawrl.lineage import log_train_step

    ckpt = root / "checkpoints" / f"v{version:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    step = {"batch_id": f"batch{version}", "step": version, "weight_version": str(version),
            "parent_version": str(version - 1), "sha256": "ab" * 32, "path": str(ckpt), "metrics": {"loss": 0.5}}
    manifest = [{"sample_id": f"s{version}", "session_id": "alice", "turn_id": f"t{version}", "reward": 1.0,
                 "has_teacher": False, "weight_version": str(version - 1)}]
    run_id = log_train_step(root, step=step, params={"lr": 1e-3}, manifest=manifest, tags={"method": "combine"})
    return {**step, "run_id": run_id}


def test_logging_a_step_warns_nothing(tmp_path):
    """MLflow warned on every step ("The specified dataset source can be interpreted in multiple ways"), a
    WARNING line per step in the flows' log; the batch manifest's dataset keeps its source all the same."""
    import warnings

    from clawrl.lineage import client as mlflow_client

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = _logged_step(tmp_path, 1)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    [ds] = mlflow_client(tmp_path).get_run(step["run_id"]).inputs.dataset_inputs
    assert (ds.dataset.source_type, json.loads(ds.dataset.source)) == ("local", {"uri": str(tmp_path / "tables" / "batches")})
