"""The load benchmark's ``up`` mode: the whole system runs as `clawrl up` (Prefect server, MLflow,
trainer service, gateway, judge and evaluation engines, flow server) and the bench only drives the users.

What the in-process mode learns from the flow runs it starts, this mode reads afterwards: the train
steps from the data root's tables (``checkpoints``, ``syncs``, ``evaluations``, ``promotions``) and
each checkpoint's ``trainer.json``, the seconds of each train task from up's Prefect API, read while
it is still running (the Prefect server stops with `clawrl up`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawrl.bench.common import STOP_TIMEOUT_S, bench_env, clawrl_service, load_average
from clawrl.config import PORT_OFFSETS
from clawrl.ports import free_ports
from clawrl.supervisor import Service, start, stop, wait_healthy


@dataclass(frozen=True)
class UpPorts:
    """The ports of `clawrl up`'s options (its engines' follow the gateway's: [server] api_port + 21, 22)."""

    prefect: int
    mlflow: int
    trainer: int

    @classmethod
    def free(cls, avoid: tuple[int, ...] = ()) -> UpPorts:
        """Three distinct free ports, none of ``avoid`` (the gateway's and its engines', drawn before)."""
        return cls(*free_ports(3, avoid))

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.prefect}/api"


# The up mode's promotion gate evaluates 16 prompts (its default), two answers each within the bench's budget.
UP_OVERRIDES: dict[str, Any] = {"gate.size": 16}


def start_up(conf: str, root: Path, ports: UpPorts, gateway_url: str, *, judge_every_s: float,
             train_every_s: float) -> Service:
    """`clawrl up -c conf` (its log: ``root/up.log``), returned once the gateway answers and the flow
    server has registered the train deployment; stopped (and raised on) when either is not up in 600 s."""
    from clawrl.flows.slots import TRAIN_DEPLOYMENT

    up = clawrl_service("up", ["up", "-c", conf, "--prefect-port", str(ports.prefect), "--mlflow-port",
                               str(ports.mlflow), "--trainer-port", str(ports.trainer), "--judge-every",
                               f"{judge_every_s:g}", "--train-every", f"{train_every_s:g}"], f"{gateway_url}/healthz")
    start(up, root, bench_env())
    try:
        wait_healthy(up)
        up.health_url = f"{ports.prefect_api}/deployments/name/{TRAIN_DEPLOYMENT}"
        wait_healthy(up)
    except BaseException:
        stop(up, STOP_TIMEOUT_S)
        raise
    return up


def drive_up(write, root: Path, gw: str, new_run, start_users, *, max_tokens: int, judge_limit: int,
             judge_every_s: float, train_every_s: float, session_prefix: str) -> tuple[int, Any, tuple[float, ...]]:
    """`clawrl up` on the config ``write(extra=...)`` writes, and the users (``start_users(run)``: a
    started thread) for the window of ``new_run()``; here only a poll of the ``syncs`` table for the
    window's ``min_syncs``. After the window, the train tasks' seconds from up's Prefect API, then up
    stopped (the gateway flushes its store), then the steps from the data root (:func:`read_steps`).
    Returns the turns judged, the run, and (wall seconds, load average before, after)."""
    api_port = int(gw.rsplit(":", 1)[1])
    ports = UpPorts.free(avoid=(api_port, *(api_port + o for o in PORT_OFFSETS.values())))
    conf = write(extra=UP_OVERRIDES)
    up = start_up(conf, root, ports, gw, judge_every_s=judge_every_s, train_every_s=train_every_s)
    try:
        load_before, run = load_average(), new_run()
        thread = start_users(run)
        try:
            while thread.is_alive():
                thread.join(3.0)
                run.synced_versions = synced_versions(root)
                run.report()
                if up.proc.poll() is not None:
                    run.stopped = True
                    raise RuntimeError(f"clawrl up exited with code {up.proc.returncode}; see {up.log_path}")
        finally:
            thread.join()
        wall, load_after = time.monotonic() - run.t0, load_average()
        tasks = train_task_seconds(ports.prefect_api, root)  # before up stops: its Prefect server goes with it
    finally:
        stop(up, STOP_TIMEOUT_S)
    run.steps = read_steps(root, run.t0_wall, tasks)
    return turns_judged(root, session_prefix), run, (wall, load_before, load_after)


def synced_versions(root: Path) -> frozenset[str]:
    """Checkpoint versions (>= 1) an engine was synced to, as the ``syncs`` table has it now."""
    from clawrl.storage.catalog import run_query

    rows = run_query(root, "select distinct weight_version from syncs where ok and weight_version <> '0'")
    return frozenset(rows.column("weight_version").to_pylist())


def turns_judged(root: Path, session_prefix: str) -> int:
    """Turns of the bench's sessions that have a fate."""
    from clawrl.storage.catalog import run_query

    return run_query(root, f"select count(distinct turn_id) as n from turn_fate "
                           f"where session_id like '{session_prefix}%'").column("n")[0].as_py()


def train_task_seconds(prefect_api: str, root: Path, timeout_s: float = 180.0) -> dict[str, dict[str, float]]:
    """Checkpoint version -> seconds each task of its train flow run (``train-v<version>``) took, from
    the Prefect API at ``prefect_api``. The runs of the synced versions are waited for, up to
    ``timeout_s``, until they end (a run is named for its version after the sync, then logs its lineage);
    a version whose run is not named yet has none."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    versions, synced = _checkpoint_versions(root), synced_versions(root)
    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: prefect_api}):
        runs = _train_runs(versions)
        while not all(v in runs and runs[v].state and runs[v].state.is_final() for v in synced) \
                and time.monotonic() < deadline:
            time.sleep(1.0)
            runs = _train_runs(versions)
        return {v: task_seconds(r.id) for v, r in runs.items()}


def _checkpoint_versions(root: Path) -> list[str]:
    from clawrl.storage.catalog import run_query

    return run_query(root, "select distinct weight_version from checkpoints where step >= 1").column(
        "weight_version").to_pylist()


def _train_runs(versions: list[str]) -> dict[str, Any]:
    """Version -> its train flow run, by name (a finished run before an unfinished one of the same name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    if not versions:
        return {}
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-v{v}"
                                                                                           for v in versions])))
    runs.sort(key=lambda r: bool(r.state and r.state.is_final()))
    return {r.name.removeprefix("train-v"): r for r in runs}


def task_seconds(flow_run_id) -> dict[str, float]:
    """Seconds each task of a flow run took (Prefect's own start and end times), in the order they ran."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name.rsplit("-", 1)[0]: t.total_run_time.total_seconds()
            for t in sorted(runs, key=lambda t: t.start_time or t.expected_start_time)}


STEPS_SQL = """
    with c as (select weight_version, batch_id, path, epoch(created_at) as made, cast(weight_version as int) as v
               from checkpoints where step >= 1),
    y as (select weight_version, min(epoch(created_at)) as synced,
                 arg_min(seconds, created_at) as seconds from syncs where ok and not skipped group by all),
    f as (select weight_version, arg_max(error, created_at) as error from syncs where not ok group by all),
    own as (select weight_version, arg_min(seconds, created_at) as seconds from evaluations group by all),
    p as (select weight_version, arg_max(action, created_at) as action, arg_max(reason, created_at) as reason,
                 min(epoch(created_at)) as decided from promotions where source = 'gate' group by all),
    -- every evaluation the step's gate made (the candidate's, and the champion's when first measured)
    e as (select c.weight_version, sum(ev.seconds) as seconds from c join p using (weight_version)
          join evaluations ev on epoch(ev.created_at) between c.made and p.decided group by all)
    select c.weight_version, c.batch_id, c.path, c.made, y.synced, y.seconds as sync_s, f.error,
           coalesce(e.seconds, own.seconds, 0.0) as eval_s, p.action, p.reason
    from c left join y using (weight_version) left join f using (weight_version) left join e using (weight_version)
    left join own using (weight_version) left join p using (weight_version) order by c.v"""


def read_steps(root: Path, t0_wall: float, tasks: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One dict per checkpoint version >= 1, with the keys the in-process mode fills from its flow runs:
    ``at_s`` is when its sync ended (else when the checkpoint was recorded) from ``t0_wall``; the
    timings come from the trainer (``trainer.json``), the evaluation and sync rows and ``tasks``;
    ``eval_s`` is every evaluation its gate made (the champion's too, when measured for the first time),
    as the in-process mode's ``eval_seconds``."""
    from clawrl.checkpoint import read_step_result
    from clawrl.storage.catalog import run_query

    steps = []
    for row in run_query(root, STEPS_SQL).to_pylist():
        m = read_step_result(Path(row["path"])).metrics
        synced = row["synced"] is not None
        steps.append({
            "weight_version": row["weight_version"], "batch_id": row["batch_id"],
            "tasks_s": tasks.get(row["weight_version"], {}),
            "at_s": (row["synced"] if synced else row["made"]) - t0_wall,
            "train_s": m.get("step_time_s"), "checkpoint_s": m.get("checkpoint_write_s"),
            "read_s": m.get("batch_read_s") or 0.0, "state_s": (m.get("state_wait_s") or 0.0)
            + (m.get("state_copy_s") or 0.0), "eval_s": row["eval_s"], "synced": synced, "sync_s": row["sync_s"],
            "sync_message": "ok" if synced else _not_synced(row)})
    return steps


def _not_synced(row: dict[str, Any]) -> str:
    if row["error"]:
        return row["error"]
    if row["action"] and row["action"] != "promote":
        return f"the gate did not promote it ({row['action']}): {row['reason']}"
    return "no sync recorded before `clawrl up` stopped"
