"""The flows on a Prefect work pool: `python -m clawrl.flows.serve --work-pool` registers the deployments on
a process pool, `clawrl up`'s ticker schedules one judge run there at a time, and `clawrl up --work-pool`
plans its services for it (a worker of its own unless told not to, every address a remote worker needs)."""

from __future__ import annotations

import pytest

from clawrl.config import dump_toml

POOL = "clawrl-test-pool"


def test_the_flows_deploy_to_a_work_pool_and_its_ticker_schedules_one_run_at_a_time(prefect_harness, make_settings,
                                                                                     tmp_path):
    """A run of these deployments executed by a separate `prefect worker` process (judge and train runs,
    through the trainer at another address) is tests/e2e/test_up_torchrun.py's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from clawrl.flows.serve import (
        JUDGE_DEPLOYMENT,
        build_deployments,
        deploy_to_pool,
        tick,
    )

    s = make_settings({"server.open_mode": True, "ppo.advantage_estimator": "grpo", "prm.backend": "rule"})
    conf = tmp_path / "pool.toml"
    conf.write_text(dump_toml(s))
    ids = deploy_to_pool(build_deployments(str(conf), None, None), POOL, {"CLAWRL__PRM__JUDGE_SAMPLES": "1"})
    with get_client(sync_client=True) as pc:
        pool = pc.read_work_pool(POOL)
        deps = [pc.read_deployment(i) for i in ids]
    assert pool.type == "process" and pool.concurrency_limit == 3  # runs beyond it wait, not pile up as processes
    assert sorted(d.name for d in deps) == ["on-demand", "on-interval", "on-samples-ready"]
    assert all(d.work_pool_name == POOL and d.job_variables["env"] == {"CLAWRL__PRM__JUDGE_SAMPLES": "1"}
               for d in deps)

    def waiting():
        with get_client(sync_client=True) as pc:
            runs = pc.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)))
        return [fr for fr in runs if not fr.state.is_final()]

    with get_client(sync_client=True) as pc:  # runs another test on this session's server left waiting
        for fr in waiting():
            pc.delete_flow_run(fr.id)
    run_id = tick(JUDGE_DEPLOYMENT)  # what the ticker of `clawrl up --work-pool` does
    assert run_id is not None and tick(JUDGE_DEPLOYMENT) is None  # one at a time: the first is scheduled
    [scheduled] = waiting()
    assert str(scheduled.id) == str(run_id) and scheduled.state.is_scheduled() and scheduled.work_pool_name == POOL
    with get_client(sync_client=True) as pc:  # no worker here: leave nothing waiting for another test
        pc.delete_flow_run(run_id)


@pytest.mark.parametrize("local_worker", [True, False])
def test_up_with_a_work_pool_registers_the_flows_there_and_starts_a_worker_unless_told_not_to(make_settings,
                                                                                             local_worker):
    from pathlib import Path

    from clawrl import supervisor

    s = make_settings({"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "server.api_port": 30534})
    services = {sv.name: sv for sv in supervisor.plan(s, Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000,
                                                      trainer_port=30020, work_pool="gpu-pool",
                                                      local_worker=local_worker)}
    flows = services["flows"]
    assert flows.argv[-2:] == ["--work-pool", "gpu-pool"] and flows.url.endswith("on work pool gpu-pool")
    if not local_worker:
        assert "worker" not in services
        return
    worker = services["worker"]
    assert list(services)[-1] == "worker"  # after the flows service created the pool
    assert worker.argv[1:8] == ["-m", "prefect", "worker", "start", "--pool", "gpu-pool", "--type"]
    assert worker.health_url == "http://127.0.0.1:4200/api/work_pools/gpu-pool" and worker.ready_only_on_200
    # the runs reach the judge engine and the gate's evaluation engine
    assert worker.env == {"CLAWRL__PRM__ENGINE_URL": "http://127.0.0.1:30555",
                          "CLAWRL__GATE__ENGINE_URL": "http://127.0.0.1:30556"}


def test_up_with_a_host_binds_and_hands_the_flows_that_address(make_settings):
    """`clawrl up --host ADDR`: what remote workers must reach (Prefect, the trainer, the judge engine,
    the gateway's /engine) binds ADDR and the flows and workers get URLs with it, not 127.0.0.1."""
    from pathlib import Path

    from clawrl import supervisor

    s = make_settings({"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "server.host": "0.0.0.0",
                       "server.api_port": 8111})
    services = {sv.name: sv for sv in supervisor.plan(s, Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000,
                                                      trainer_port=30020, work_pool="gpu-pool", host="10.1.2.3")}
    for name in ("prefect", "mlflow", "trainer", "judge-engine", "eval-engine"):
        argv = services[name].argv
        assert argv[argv.index("--host") + 1] == "10.1.2.3", name
        assert services[name].health_url.startswith("http://10.1.2.3:"), name
    flows = services["flows"].argv
    assert flows[flows.index("--trainer-url") + 1] == "http://10.1.2.3:30020"
    assert flows[flows.index("--engine-url") + 1] == "http://10.1.2.3:8111/engine"  # the gateway binds every address
    assert services["worker"].env == services["flows"].env == {"CLAWRL__PRM__ENGINE_URL": "http://10.1.2.3:8132",
                                                               "CLAWRL__GATE__ENGINE_URL": "http://10.1.2.3:8133"}
    assert services["worker"].health_url == "http://10.1.2.3:4200/api/work_pools/gpu-pool"

    assert supervisor.host_problem(s, "10.1.2.3") is None
    assert "names none" in supervisor.host_problem(s, "0.0.0.0")
    local_gateway = make_settings({"server.host": "127.0.0.1"})
    assert "[server] host = 127.0.0.1" in supervisor.host_problem(local_gateway, "10.1.2.3")
    assert supervisor.host_problem(local_gateway, "127.0.0.1") is None


def test_up_refuses_a_wildcard_host_before_starting_anything(make_settings, tmp_path):
    from typer.testing import CliRunner

    from clawrl.cli import app

    conf = tmp_path / "up.toml"
    conf.write_text(dump_toml(make_settings({})))
    r = CliRunner().invoke(app, ["up", "-c", str(conf), "--host", "0.0.0.0"])
    assert r.exit_code != 0 and "names none" in r.output
    assert not (make_settings({}).storage.data_root / "up.pids.json").exists()


def test_up_with_several_engines_puts_sglangs_router_in_front_of_them(make_settings):
    """`clawrl up --engines 2 --judge-engines 2`: two policy engines (each restarting on the version synced
    last) and two judge engines, each pair behind SGLang's router on the port a single engine would use; the
    gateway starts once its router answers and calls it, the flows reach the judge engines' router."""
    from pathlib import Path

    from clawrl import supervisor

    s = make_settings({"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "server.api_port": 30500})
    plan = supervisor.plan(s, Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000, trainer_port=30020,
                           engines=2, judge_engines=2)
    services = {sv.name: sv for sv in plan}
    names = list(services)
    assert names.index("engine-router") < names.index("gateway") and services["gateway"].after_others
    router, judges = services["engine-router"], services["judge-engine-router"]
    assert router.url == "http://127.0.0.1:30510" and judges.url == "http://127.0.0.1:30521"
    assert router.health_url == "http://127.0.0.1:30510/readiness" and router.ready_only_on_200
    workers = [services["engine-0"], services["engine-1"]]
    assert all(w.argv[-1] == "--resume" for w in workers)
    assert all("--resume" not in services[f"judge-engine-{i}"].argv for i in range(2))
    argv = router.argv
    assert argv[1:3] == ["-m", "sglang_router.launch_router"] and argv[argv.index("--port") + 1] == "30510"
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == [w.url for w in workers]
    assert argv[argv.index("--policy") + 1] == "manual"
    assert services["gateway"].env == {"CLAWRL__ENGINE__URL": "http://127.0.0.1:30510"}
    assert services["flows"].env["CLAWRL__PRM__ENGINE_URL"] == "http://127.0.0.1:30521"
    one = {sv.name: sv for sv in supervisor.plan(s, Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000,
                                                 trainer_port=30020, engines=1)}
    assert one["engine"].url == "http://127.0.0.1:30510" and "engine-router" not in one
    assert one["gateway"].env["CLAWRL__ENGINE__URL"] == "http://127.0.0.1:30510"
