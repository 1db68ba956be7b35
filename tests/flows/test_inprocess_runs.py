"""The flow server executes the judge and train deployments' runs in its own process
(clawrl.flows.inprocess): taken from Scheduled as Prefect's runner takes them, run by the flow engine in a
thread, each run once whoever else polls, and marked Crashed when the server stops under them."""

from __future__ import annotations

import threading

from prefect import flow

from clawrl.config import dump_toml
from clawrl.flows.slots import RUN_CREATED
from tests.utils.samples import write_samples
from tests.utils.waiting import wait_until

NEVER_S = 24 * 3600.0  # a flow server's poll interval that never comes in a test

_release = threading.Event()


@flow(name="inprocess-blocking")
def blocking_flow() -> str:
    """Holds its thread until the test releases it."""
    _release.wait(60)
    return "released"


def _states(run_id) -> list[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [s.type.value for s in sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)]


def _runs_of(dep_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])))


def _clear(dep_ids) -> None:
    """The session's Prefect server is shared: leave no run of these deployments waiting."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for dep_id in dep_ids:
            for r in _runs_of(dep_id):
                client.delete_flow_run(r.id)


def test_a_judge_run_and_the_train_run_it_starts_execute_in_the_flow_server(prefect_harness, make_settings,
                                                                            tmp_path):
    from clawrl.flows import train as train_module
    from clawrl.flows.inprocess import InProcessRunner
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.serve import JUDGE_DEPLOYMENT, build_deployments, tick
    from clawrl.flows.train import train_flow
    from clawrl.storage.catalog import run_query

    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    write_samples(s, 2)  # a full batch waits: the judge run judges nothing and starts a train run
    judge, train, _ = build_deployments(str(conf), None, None)
    runner = InProcessRunner([(judge, judge_flow), (train, train_flow)])
    judge_id, train_id = runner.register()
    _clear([judge_id, train_id])
    stop = threading.Event()
    server = threading.Thread(target=runner.serve, args=(stop, NEVER_S), daemon=True)
    server.start()  # it never polls: only the ticks' wake-ups can start these runs
    try:
        judge_run = tick(JUDGE_DEPLOYMENT)
        done = wait_until(lambda: [r for r in _runs_of(train_id) if r.state.is_final()], "the train run", poll_s=0.2)
    finally:
        stop.set()
        RUN_CREATED.set()  # wakes the server to see the stop
        wait_until(lambda: not server.is_alive(), "the flow server to stop")
    [train_run] = done
    [judge_run_read] = _runs_of(judge_id)
    assert str(judge_run_read.id) == judge_run
    for run in (judge_run_read, train_run):  # taken as Prefect's runner takes a run, then run by the engine
        assert _states(run.id) == ["SCHEDULED", "PENDING", "RUNNING", "COMPLETED"], run.name
    assert train_run.name == "train-v1" and str(conf) in train_module._warming  # its body ran in this process
    [ckpt] = run_query(s.storage.data_root, "select weight_version, parent_version from checkpoints").to_pylist()
    assert ckpt == {"weight_version": "1", "parent_version": "0"}
    # a run's thread ends just after its final state is reported
    wait_until(lambda: runner.running() == [], "the runs' threads to end", poll_s=0.2)
    assert not server.is_alive()
    _clear([judge_id, train_id])


def test_a_run_is_taken_once_and_given_a_grace_time_when_the_server_stops(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.states import Pending
    from prefect.types.entrypoint import EntrypointType

    from clawrl.flows.inprocess import InProcessRunner

    dep = blocking_flow.to_deployment(name="t", entrypoint_type=EntrypointType.MODULE_PATH)
    runner = InProcessRunner([(dep, blocking_flow)])
    [dep_id] = runner.register()
    _clear([dep_id])
    _release.clear()
    with get_client(sync_client=True) as client:
        taken = client.create_flow_run_from_deployment(dep_id).id
        client.set_flow_run_state(taken, Pending())  # another runner took this one first
        mine = client.create_flow_run_from_deployment(dep_id).id
    assert runner.start_due() == [mine]
    assert runner.start_due() == []  # going: not taken twice
    wait_until(lambda: _states(mine)[-1] == "RUNNING", "the run to start", poll_s=0.2)
    assert _states(taken) == ["SCHEDULED", "PENDING"]  # left to its taker
    threading.Timer(1.0, _release.set).start()
    assert runner.stop(grace_s=300) == []  # it ended within the grace time (reporting its end is slow when busy)
    assert _states(mine)[-1] == "COMPLETED" and runner.running() == []

    _release.clear()
    with get_client(sync_client=True) as client:
        held = client.create_flow_run_from_deployment(dep_id).id
    assert runner.start_due() == [held]
    wait_until(lambda: _states(held)[-1] == "RUNNING", "the run to start", poll_s=0.2)
    assert runner.stop(grace_s=0.5) == [held]  # still going after the grace time: marked Crashed
    assert _states(held)[-1] == "CRASHED"
    _release.set()
    wait_until(lambda: runner.running() == [], "the run's thread to end", poll_s=0.2)
    _clear([dep_id])
