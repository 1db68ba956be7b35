"""How judging is scheduled under `clawrl up`: the judge engine service keeps the frozen model loaded
(the flows reach it over HTTP, so no judge run loads weights), and judge runs that overlap end
Completed with ``skipped``, never Cancelled."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
from openai import OpenAI

from clawrl.ports import free_api_port
from clawrl import supervisor
from clawrl.config import dump_toml
from clawrl.gateway.routes import create_app
from clawrl.judge.runner import build_judge_config_hash
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.prefect_runs import clear_runs, deployment_runs
from tests.utils.samples import two_turn_session
from tests.utils.up_process import wait_healthy
from tests.utils.waiting import join, wait_until


def _plan(settings, conf: Path = Path("/conf/up.toml")):
    return {s.name: s for s in supervisor.plan(settings, conf, prefect_port=4200, mlflow_port=5000, trainer_port=30020)}


@pytest.mark.parametrize("overrides, starts", [
    ({"prm.backend": "engine", "ppo.advantage_estimator": "grpo"}, True),
    ({"prm.backend": "rule", "ppo.advantage_estimator": "combine", "opd.teacher": "frozen"}, True),
    ({"prm.backend": "rule", "ppo.advantage_estimator": "on_policy_distillation", "opd.teacher": "policy"}, False),
    ({"prm.backend": "rule", "ppo.advantage_estimator": "grpo"}, False),
    ({"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "prm.engine_url": "http://10.0.0.5:9000"}, False),
])
def test_up_plans_a_judge_engine_only_when_the_judge_uses_the_initial_weights(make_settings, overrides, starts):
    services = _plan(make_settings({**overrides, "server.api_port": 30534, "gate.enabled": False}))  # judge: +21
    _check_engine_service(services, "judge-engine", 30555, "CLAWRL__PRM__ENGINE_URL", starts)


@pytest.mark.parametrize("overrides, starts", [
    ({}, True),
    ({"gate.enabled": False}, False),
    ({"gate.engine_url": "http://10.0.0.7:9100"}, False),
])
def test_up_plans_an_evaluation_engine_for_the_gate_unless_it_is_off_or_named(make_settings, overrides, starts):
    services = _plan(make_settings({**overrides, "server.api_port": 30644, "prm.backend": "rule",  # evaluation: +22
                                    "ppo.advantage_estimator": "grpo"}))
    _check_engine_service(services, "eval-engine", 30666, "CLAWRL__GATE__ENGINE_URL", starts)


@pytest.mark.parametrize("overrides, starts", [
    ({"gate.canary_share": 0.25}, True),
    ({}, False),
    ({"gate.canary_share": 0.25, "gate.canary_url": "http://10.0.0.8:9200"}, False),
])
def test_up_plans_a_canary_engine_for_a_canary_share_unless_one_is_named(make_settings, overrides, starts):
    services = _plan(make_settings({**overrides, "server.api_port": 30754, "gate.engine_url": "http://10.0.0.7:9100",
                                    "prm.backend": "rule", "ppo.advantage_estimator": "grpo"}))
    _check_engine_service(services, "canary-engine", 30777, "CLAWRL__GATE__CANARY_URL", starts)
    # the gateway sends canary sessions to it, the train runs load each new version into it
    assert services["gateway"].env == ({"CLAWRL__GATE__CANARY_URL": "http://127.0.0.1:30777"} if starts else {})


def test_a_canary_share_without_the_gate_is_a_config_error(make_settings):
    from clawrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"canary_share = 0.5: a canary needs the gate \(enabled = true\)"):
        make_settings({"gate.enabled": False, "gate.canary_share": 0.5})


def test_a_gateway_with_a_canary_share_but_no_canary_engine_is_a_config_error(make_settings):
    from clawrl.config import ConfigError

    s = make_settings({"gate.canary_share": 0.25, "server.open_mode": True})
    with pytest.raises(ConfigError, match=r"\[gate\] canary_share = 0.25 needs \[gate\] canary_url"):
        create_app(s)


def _check_engine_service(services, name: str, port: int, env_key: str, starts: bool) -> None:
    """A `clawrl engine` of the initial weights planned before the flows, which get its URL; or none."""
    names, flows = list(services), services["flows"]
    if not starts:
        assert name not in names and flows.env == {}
        return
    eng = services[name]
    assert names == ["prefect", "mlflow", "trainer", "gateway", name, "flows"]  # up before the flows
    assert eng.argv[1:] == ["-m", "clawrl.cli", "engine", "-c", "/conf/up.toml", "--host", "127.0.0.1", "--port",
                            str(port)]
    assert "--resume" not in eng.argv  # the initial weights, never a synced version
    assert eng.health_url == f"http://127.0.0.1:{port}/health" and eng.url == f"http://127.0.0.1:{port}"
    assert flows.env == {env_key: f"http://127.0.0.1:{port}"}


def test_the_judge_and_train_deployments_have_no_cancelling_limit_and_run_exclusive():
    from clawrl.flows.serve import build_deployments

    judge, train, _ = build_deployments("/conf/up.toml", "http://t", "http://e", judge_every_s=7)
    assert judge.concurrency_limit is None and judge.concurrency_options is None
    assert judge.parameters == {"config_path": "/conf/up.toml", "exclusive": True}
    assert judge.schedules == [] and "a run every 7 s while none is going" in judge.description  # the ticker's
    assert train.concurrency_limit is None and train.concurrency_options is None
    assert train.parameters == {"config_path": "/conf/up.toml", "max_steps": 1, "trainer_url": "http://t",
                                "engine_url": "http://e", "exclusive": True}
    # runs come from the ticker and from judge runs, only while none is going: no schedule, no trigger
    assert train.schedules == [] and train.triggers == [] and "every 120 s" in train.description


def test_a_judge_run_that_leaves_a_full_batch_starts_one_train_run(prefect_harness, make_settings, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from clawrl.flows.judge import judge_flow
    from clawrl.flows.serve import build_deployments
    from tests.utils.samples import write_samples

    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    write_samples(s, 2)  # a full batch waits
    _, train, _ = build_deployments(str(conf), None, None)
    dep_id = train.apply()  # registered as `serve` registers it; no runner picks its runs up here

    def waiting():
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])))
        return [r for r in runs if not r.state.is_final()]

    with get_client(sync_client=True) as client:  # the session's Prefect server is shared
        for r in waiting():
            client.delete_flow_run(r.id)
    out = judge_flow(config_path=str(conf), exclusive=True)
    assert out["judged"] == 0 and out["status"]["full_batches"] == 1
    [run] = waiting()
    assert run.state.is_scheduled() and run.parameters["config_path"] == str(conf)
    judge_flow(config_path=str(conf), exclusive=True)  # the batch still waits, and so does that run
    judge_flow(config_path=str(conf))  # not exclusive (`clawrl judge`, the demo): starts nothing
    assert [r.id for r in waiting()] == [run.id]
    with get_client(sync_client=True) as client:
        client.delete_flow_run(run.id)


def test_the_ticker_creates_a_run_only_while_none_is_scheduled_or_going(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from clawrl.flows.serve import JUDGE_DEPLOYMENT, build_deployments, tick
    from clawrl.flows.slots import JUDGE_LIMIT, leased_slot

    judge, _, _ = build_deployments("/conf/up.toml", None, None)
    judge.apply()  # registered as `serve` registers it; no runner picks its runs up here
    clear_runs(JUDGE_DEPLOYMENT)  # none left waiting by another test
    first = tick(JUDGE_DEPLOYMENT)
    assert first is not None and tick(JUDGE_DEPLOYMENT) is None  # the first run is still scheduled: no second one
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(first)
        assert run.state.type.value == "SCHEDULED" and run.parameters == {"config_path": "/conf/up.toml",
                                                                          "exclusive": True}
        client.set_flow_run_state(first, Completed(), force=True)
    second = tick(JUDGE_DEPLOYMENT)  # the first one is done: the next tick creates the next run
    assert second not in (None, first) and tick(JUDGE_DEPLOYMENT) is None
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(second, Running(), force=True)
    with leased_slot(JUDGE_LIMIT) as held:  # running and holding the judge slot: going, no new run
        assert held and tick(JUDGE_DEPLOYMENT) is None
    third = tick(JUDGE_DEPLOYMENT)  # marked Running with the slot free: it died unmarked and does not count
    assert third not in (None, first, second) and tick(JUDGE_DEPLOYMENT) is None
    with get_client(sync_client=True) as client:  # the session's Prefect server is shared: leave no run waiting
        for run_id in (second, third):
            client.delete_flow_run(run_id)


def test_an_idle_up_creates_no_runs_and_judges_when_turns_arrive(prefect_harness, make_settings, tmp_path):
    """The ticker asks the data first: with nothing to judge or train it creates no run (an idle `clawrl up`
    made a judge run every 20 s and a train run every 120 s); a turn ready to judge, then a full batch, each
    make the next tick create one."""
    from prefect.client.orchestration import get_client

    from clawrl.flows.serve import JUDGE_DEPLOYMENT, TRAIN_DEPLOYMENT, ticker, work_waiting
    from tests.utils.samples import write_samples
    from tests.utils.turns import build_turn

    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    work_check = work_waiting(str(conf))
    assert (work_check(JUDGE_DEPLOYMENT), work_check(TRAIN_DEPLOYMENT)) == (False, False)
    asked: list[str] = []

    def has_work(name: str) -> bool:  # counted: the ticks are events to wait for, not seconds
        asked.append(name)
        return work_check(name)

    created = []
    import clawrl.flows.serve as serve_module

    real_tick = serve_module.tick
    serve_module.tick = created.append  # what the ticker would create, without creating it
    try:
        stop = threading.Event()
        t = threading.Thread(target=ticker, args=({JUDGE_DEPLOYMENT: 0.05, TRAIN_DEPLOYMENT: 0.05}, stop, has_work))
        t.start()
        wait_until(lambda: min(asked.count(JUDGE_DEPLOYMENT), asked.count(TRAIN_DEPLOYMENT)) >= 20, "20 ticks each")
        assert created == []  # idle: 20 ticks each, not one run
        with DataStore(s.storage.data_root) as store:
            store.append([build_turn([{"role": "user", "content": "hi"}], turn_type="side")])
        wait_until(lambda: created, "a tick to create a judge run")
        n = len(asked)
        wait_until(lambda: len(asked) >= n + 4, "more ticks")  # ... and the train deployment's to create none
        assert set(created) == {JUDGE_DEPLOYMENT}
        write_samples(s, 2)
        wait_until(lambda: TRAIN_DEPLOYMENT in created, "a tick to create a train run")
        stop.set()
        join(t)
    finally:
        serve_module.tick = real_tick
    assert set(created) == {JUDGE_DEPLOYMENT, TRAIN_DEPLOYMENT}
    # a run that finds nothing anyway (started from the UI) is named and tagged idle, not like a real one
    from clawrl.flows.train import train_flow

    empty = make_settings({"prm.backend": "rule", "storage.data_root": str(tmp_path / "empty")})
    econf = tmp_path / "empty.toml"
    econf.write_text(dump_toml(empty))
    state = train_flow(config_path=str(econf), return_state=True)
    with get_client(sync_client=True) as pc:
        run = pc.read_flow_run(state.state_details.flow_run_id)
    assert run.name.startswith("train-idle-") and "idle" in run.tags, (run.name, run.tags)


def _backlog(store: DataStore, calls: int, sides_each: int) -> None:
    """``calls`` turns the judge is called for, each followed by ``sides_each`` side turns. Each call's next
    state is a neutral reply: the rule judge scores it 0, no sample, so no batch and no train run."""
    from dataclasses import replace
    from datetime import timedelta

    from tests.utils.turns import T0, build_next_state, build_turn

    at = iter(T0 + timedelta(seconds=i) for i in range(calls * (1 + sides_each)))
    ask = [{"role": "user", "content": "What is gravity?"}]
    records = []
    for c in range(calls):
        turn = replace(build_turn(ask, session_id=f"user{c:02d}"), created_at=next(at))
        records += [turn, build_next_state(turn, [{"role": "user", "content": "What about the moon?"}])]
        records += [replace(build_turn(ask, session_id=f"heartbeat{c:02d}-{i}", turn_type="side"), created_at=next(at))
                    for i in range(sides_each)]
    store.append(records)


def _judging_tasks(run_id) -> list[str]:
    """The judging tasks of a flow run, by name (``judge-<first>-<last>-of-<turns>``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return sorted(t.name for t in tasks if t.name.startswith("judge-"))


def test_a_backlog_larger_than_a_bite_is_judged_by_consecutive_runs_at_once(prefect_harness, make_settings, tmp_path,
                                                                           monkeypatch):
    """`clawrl up` judges a backlog in bites of judge calls, the side turns among them uncounted, and a run that
    took a full bite creates the next run as it ends instead of leaving it to the ticker's next look
    (`--judge-every`: there is no ticker here at all). 10 calls, each followed by 3 side turns, in bites of 4
    calls: 3 runs of 16, 16 and 8 turns, each started by the one before, executed in the flow server's
    runner as under `clawrl up`."""
    import clawrl.flows.judge as fj
    from clawrl.flows.inprocess import InProcessRunner
    from clawrl.flows.serve import JUDGE_DEPLOYMENT, build_deployments, tick

    monkeypatch.setattr(fj, "MIN_BITE", 1)  # bites of BITE_BATCHES (4) x rollout_batch_size (1) = 4 judge calls
    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 1})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    with DataStore(s.storage.data_root) as store:
        _backlog(store, calls=10, sides_each=3)
    judge, _, _ = build_deployments(str(conf), None, None, judge_every_s=3600)
    runner = InProcessRunner([(judge, fj.judge_flow)])
    runner.register()
    clear_runs(JUDGE_DEPLOYMENT)
    stop = threading.Event()
    server = threading.Thread(target=runner.serve, args=(stop, 3600.0), daemon=True)
    server.start()  # polls once an hour: only a tick's wake-up starts a run in time

    def judged() -> int:
        return run_query(s.storage.data_root, "select count(*) as n from turn_fate").to_pylist()[0]["n"]

    try:
        assert tick(JUDGE_DEPLOYMENT) is not None  # the ticker's first look: the one run it makes
        wait_until(lambda: judged() == 40 and all(r.state.is_final() for r in deployment_runs(JUDGE_DEPLOYMENT)),
                   "the backlog judged and the runs done", progress=judged)
    finally:
        stop.set()
        server.join(60)  # the runner wakes on its next poll (an hour): a daemon thread, left to end with the process
    runs = deployment_runs(JUDGE_DEPLOYMENT)
    assert [r.state.type.value for r in runs] == ["COMPLETED"] * 3
    # 4 calls and the 12 side turns among them, twice; then the last 2 calls and their 6 side turns
    assert [_judging_tasks(r.id) for r in runs] == [["judge-1-16-of-16"], ["judge-1-16-of-16"], ["judge-1-8-of-8"]]
    for before, after in zip(runs, runs[1:]):  # created by the run before it, as it ended
        assert before.start_time < after.created < before.end_time
    fates = run_query(s.storage.data_root, "select fate, count(*) as n from turn_fate group by fate order by fate")
    assert fates.to_pylist() == [{"fate": "score_zero", "n": 10}, {"fate": "side_turn", "n": 30}]
    clear_runs(JUDGE_DEPLOYMENT)


def _runs_by_name(names):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=list(names))))
        limit = client.read_global_concurrency_limit_by_name("judge")
    return {r.name: r.state.type.value for r in runs}, limit


def test_overlapping_exclusive_judge_runs_skip_completed_not_cancelled(prefect_harness, make_settings, tmp_path,
                                                                     monkeypatch):
    from prefect.context import FlowRunContext

    import clawrl.flows.judge as fj

    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo"})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    holding, release, first = threading.Event(), threading.Event(), {}

    def crash_point(name):  # the first run waits, slot held, until the others have come and gone
        if name == "found" and not holding.is_set():
            first["name"] = FlowRunContext.get().flow_run.name
            holding.set()
            wait_until(release.is_set, "the other runs to come and go")

    monkeypatch.setattr(fj, "_crash_point", crash_point)
    names = iter(f"judge-overlap-{i}" for i in range(10))
    flow = fj.judge_flow.with_options(flow_run_name=lambda: next(names))
    worker = threading.Thread(target=lambda: first.setdefault("out", flow(config_path=str(conf), exclusive=True)))
    worker.start()
    wait_until(holding.is_set, "the first run to hold the slot")
    states = [flow(config_path=str(conf), exclusive=True, return_state=True) for _ in range(2)]
    unguarded = flow(config_path=str(conf))  # not exclusive (`clawrl judge`, the demo): judges regardless
    release.set()
    join(worker)
    after = flow(config_path=str(conf), exclusive=True)  # the slot was given back

    for st in states:
        assert st.is_completed() and st.result() == {
            "judged": 0, "fates": {}, "skipped": f"judge run {first['name']} is still going"}
    assert first["name"] == "judge-overlap-0" and "skipped" not in first["out"] and first["out"]["judged"] == 0
    assert "skipped" not in unguarded and "skipped" not in after
    # each found nothing to judge, so each is named for it (judge-idle-...): none Cancelled
    by_name, limit = _runs_by_name([f"judge-idle-overlap-{i}" for i in range(5)])
    assert by_name == {f"judge-idle-overlap-{i}": "COMPLETED" for i in range(5)}
    assert limit.limit == 1 and limit.active and limit.active_slots == 0  # no slot left held


def test_a_train_run_that_finds_the_trainer_slot_taken_skips_completed(prefect_harness, make_settings, tmp_path):
    from clawrl.flows.slots import leased_slot
    from clawrl.flows.train import TRAINER_LIMIT, train_flow

    conf = tmp_path / "train.toml"
    conf.write_text(dump_toml(make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo"})))
    with leased_slot(TRAINER_LIMIT) as held:  # another trainer holds the slot (no train run of that name)
        assert held
        busy = train_flow(config_path=str(conf), exclusive=True, return_state=True)
    free = train_flow(config_path=str(conf), exclusive=True)  # given back: claims, finds no batch
    assert busy.is_completed() and busy.result() == {
        "steps": [], "skipped": "another train run holds the `trainer` slot (a killed run's lease lapses within 60 s)"}
    assert free == {"steps": []}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("trainer").active_slots == 0


@pytest.fixture
def judge_engine(make_settings, tmp_path):
    """`clawrl up`'s judge engine service (tiny model), started as `up` starts it: (settings, flows env)."""
    s = make_settings({"prm.backend": "engine", "server.api_port": free_api_port(), "engine.max_batch_size": 8,
                       "engine.max_context_len": 2048, "model.dtype": "float32", "model.device": "cpu"})
    conf = tmp_path / "up.toml"
    conf.write_text(dump_toml(s))
    services = _plan(s, conf)
    svc = services["judge-engine"]
    supervisor.start(svc, tmp_path / "logs", supervisor.child_env())
    try:
        wait_healthy(svc)
        yield s, services["flows"].env
    finally:
        supervisor.stop(svc)


def test_judge_runs_use_the_judge_engine_over_http_without_loading_weights(
        prefect_harness, judge_engine, make_settings, tiny_engine, tmp_path, monkeypatch):
    from clawrl.engine import embedded
    from clawrl.flows import common
    from clawrl.flows.judge import judge_flow
    from clawrl.judge.teacher import build_teacher_prompt_ids, compute_teacher_logprobs
    from clawrl.runtime import run

    base, env = judge_engine
    store = DataStore(base.storage.data_root)
    with running_gateway(create_app(make_settings({"server.open_mode": True}), engine=tiny_engine,
                                    tokenizer=tiny_engine.tokenizer, store=store)) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        two_turn_session(client, "corrected", "What is the capital of France?", "no, that's wrong, answer in one word")
        two_turn_session(client, "thanked", "Name a primary color.", "thanks, that's great!")
    store.close()

    def no_loading(*a, **k):
        raise AssertionError("a judge run loaded model weights")

    monkeypatch.setattr(embedded.EmbeddedEngine, "__init__", no_loading)
    for k, v in env.items():  # what the flows service of `clawrl up` runs with
        monkeypatch.setenv(k, v)
    common.close_all()  # no frozen engine or judge made earlier in this process
    outs = {}
    configs = {"engine": {"prm.backend": "engine", "prm.judge_samples": 2, "prm.max_new_tokens": 8,
                          "ppo.advantage_estimator": "grpo"},  # PRM votes from the judge engine
               "teacher": {"prm.backend": "rule", "ppo.advantage_estimator": "combine"}}  # its teacher log-probs
    for name, over in configs.items():
        s = make_settings({"server.api_port": base.server.api_port, "engine.max_context_len": 2048, **over})
        conf = tmp_path / f"{name}.toml"
        conf.write_text(dump_toml(s))  # without engine_url: it comes from the environment, as under `up`
        outs[name] = judge_flow(config_path=str(conf))
        assert outs[name]["judge_config_hash"] == build_judge_config_hash(s)  # the same judge as in process
        assert outs[name]["judged"] == 4

    rows = run_query(base.storage.data_root, "select judge_config_hash as h, judge_backend, raw_outputs, error "
                     "from verdicts").to_pylist()
    votes = [r for r in rows if r["h"] == outs["engine"]["judge_config_hash"]]
    assert len(votes) == 2 and all(r["judge_backend"] == "engine" and r["error"] is None for r in votes)
    assert all(len(json.loads(r["raw_outputs"])) == 2 and "[judge error]" not in r["raw_outputs"] for r in votes)
    assert outs["engine"]["fates"].get("judge_error", 0) == 0

    assert outs["teacher"]["fates"] == {"sample": 2, "no_next_state": 2}
    [sample] = run_query(base.storage.data_root, "select s.*, t.request_messages from samples s join turns t "
                         "using (turn_id) where s.has_teacher").to_pylist()
    assert len(sample["teacher_logprobs"]) == len(sample["output_ids"]) > 0
    # the judge engine holds the initial weights: the same log-probs as the in-process tiny engine's
    prompt = build_teacher_prompt_ids(tiny_engine.tokenizer, json.loads(sample["request_messages"]), None,
                                      "answer in one word")
    local = run(compute_teacher_logprobs(tiny_engine, prompt, sample["output_ids"]))
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(sample["teacher_logprobs"], local))
