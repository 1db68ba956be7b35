"""The flows served as Prefect deployments (started by ``clawrl up``; also ``python -m clawrl.flows.serve``).

Runs are created only when they have work and none of their deployment's runs is scheduled, pending
or running (``clawrl.flows.slots.tick``), never by a Prefect schedule or event trigger: those create a
run whatever happens, and runs that find another one going would only start, find the slot taken and
skip (on a busy machine, or pile up).

* ``judge/on-interval``: judges ready turns; :func:`ticker` in this process looks every
  ``--judge-every`` seconds and ticks it when turns are ready to judge (``work_waiting``): an idle
  `clawrl up` creates no runs. A run judges a bite of the ready turns, and one that took a full bite
  ticks it itself as it ends: a backlog is judged in consecutive runs. The runs are also ``exclusive``
  (the global limit ``judge``), so one started from the UI while another judges ends Completed with
  ``skipped``.
* ``train/on-samples-ready``: one PPO step; ticked by a judge run that leaves a full batch waiting
  (it also emits the event ``clawrl.samples.ready``), and by :func:`ticker` every ``--train-every``
  seconds when a full batch waits, as a safety net. Exclusive too, on the global limit ``trainer``: one
  started from the UI while another trains ends Completed with ``skipped``. A run that finds nothing
  to do is named ``<flow>-idle-<time>`` and tagged ``idle`` (``clawrl.flows.slots.mark_idle``).
* ``replay/on-demand``: run it from the UI with a version, sessions to exclude, or ``--set`` style
  overrides.

The judge and train runs execute in this process, each in a thread (``clawrl.flows.inprocess``: what
a run opens - MLflow's store, the gate's chat template, the data store - is opened once, not per
run); replay runs in a subprocess of Prefect's runner here. With ``--work-pool NAME`` every run
executes wherever a Prefect worker polls that process work pool (``prefect worker start --pool
NAME``, on this machine or others), each as a process of its own: the deployments are registered on
the pool (created if missing) instead of being served here, and this process only keeps the ticker.
A worker on another machine needs clawrl installed, the data root and config at the same paths (a
shared file system), and the trainer, engine and Prefect URLs reachable from there. The long-lived
state lives elsewhere: the trainer service (model + optimizer) at ``--trainer-url``, the serving
engine behind ``--engine-url``, the judge engine (the frozen initial weights) at ``[prm] engine_url``
when `clawrl up` starts one. Each deployment names its flow by module path
(``clawrl.flows.train.train_flow``), which a worker's subprocesses import wherever clawrl is
installed, whatever their working directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import serve
from prefect.types.entrypoint import EntrypointType

from clawrl.config import mlflow_ui_url
from clawrl.flows.adapters import start_train_runs
from clawrl.flows.inprocess import InProcessRunner, preload
from clawrl.flows.judge import ensure_judge_limit, judge_flow
from clawrl.flows.replay import replay_flow
from clawrl.flows.slots import JUDGE_DEPLOYMENT, TRAIN_DEPLOYMENT, tick
from clawrl.flows.train import train_flow, warm_up

RUN_ENV = ("CLAWRL__", "MLFLOW_")  # this process's settings that the flow runs on a work pool get too
log = logging.getLogger("clawrl.flows.serve")


def build_deployments(config_path: str, trainer_url: str | None, engine_url: str | None,
                      judge_every_s: float = 20.0, train_every_s: float = 120.0):
    # no deployment limits (their collisions would end Cancelled): each flow takes its own slot
    # (`judge`, `trainer`) without waiting, and a run that finds it taken skips, Completed
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "parameters": {"config_path": config_path}}
    judge = judge_flow.to_deployment(
        name="on-interval", **{**common, "parameters": {"config_path": config_path, "exclusive": True}},
        description=f"Judge turns whose next state arrived (PRM votes, hints, teacher): a run every "
                    f"{judge_every_s:g} s while none is going and turns are ready (`clawrl up --judge-every`), and at "
                    "once after a run that took a full bite; one started while another judges skips, Completed, "
                    "named and tagged idle.")
    train = train_flow.to_deployment(
        name="on-samples-ready",
        **{**common, "parameters": {"config_path": config_path, "max_steps": 1, "trainer_url": trainer_url,
                                    "engine_url": engine_url, "exclusive": True}},
        description=f"One PPO step per full batch of trainable samples, then checkpoint, lineage, gate, sync: a run "
                    f"when a judge run leaves a full batch, and every {train_every_s:g} s while one waits (`clawrl "
                    "up --train-every`), while none is going; one that finds no batch or another training ends "
                    "Completed, named and tagged idle.")
    replay = replay_flow.to_deployment(name="on-demand", **common,
                                       description="Re-train from logged samples: exact, unlearning or counterfactual.")
    return [judge, train, replay]


POOL_CONCURRENCY = 3  # runs of a pool clawrl creates at once: the judge, a train run and a replay


def deploy_to_pool(deployments: list, pool: str, env: dict[str, str] | None = None) -> list[str]:
    """Register ``deployments`` on the process work pool ``pool`` (created when missing, with a
    concurrency limit of ``POOL_CONCURRENCY``: each run is a process importing torch, and runs
    started from the UI while others go wait Scheduled instead of piling up as processes), their runs getting ``env`` on top of the worker's environment; the deployment ids.
    Their entrypoints are module paths, so a worker needs clawrl installed, not this file."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import deploy
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template(),
                concurrency_limit=POOL_CONCURRENCY,
                description="clawrl's judge, train and replay flows, run by `prefect worker start --pool` processes"))
    for d in deployments:
        d.job_variables = {**(d.job_variables or {}), "env": dict(env or {})}
    ids = deploy(*deployments, work_pool_name=pool, build=False, push=False, print_next_steps_message=False,
                 ignore_warnings=True)
    return [str(i) for i in ids]


def ticker(every_s: dict[str, float], stop: threading.Event,
           has_work: Callable[[str], bool] = lambda name: True, start: Callable[[str], Any] | None = None) -> None:
    """At each deployment's interval (``every_s``: name -> seconds) until ``stop``, ``start`` it (default:
    :func:`tick`) when ``has_work(name)``: an idle `clawrl up` creates no runs that find nothing. A failed check
    or tick is logged and tried again at the next."""
    due = {name: time.monotonic() + s for name, s in every_s.items()}
    while not stop.wait(max(0.0, min(due.values()) - time.monotonic())):
        for name in [n for n, t in due.items() if t <= time.monotonic()]:
            due[name] = time.monotonic() + every_s[name]
            try:
                if has_work(name):
                    (start or tick)(name)
            except Exception as e:  # noqa: BLE001 - the deployment not registered yet, the server restarting
                log.warning("%s tick failed: %s", name, e)


def work_waiting(config_path: str) -> Callable[[str], bool]:
    """Whether a run of a deployment would find work now: turns ready to judge (a next state arrived, or a
    turn was told none will come) for the judge, a full batch of trainable samples for the train run."""
    from clawrl.flows.common import load_flow_settings
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.adapters import full_batch_namespaces
    from clawrl.storage.queries import pending_counts, turns_to_judge

    def check(deployment: str) -> bool:
        s = load_flow_settings(config_path)
        with open_catalog(s.storage.data_root) as con:
            if deployment == JUDGE_DEPLOYMENT:
                return turns_to_judge(con, build_judge_config_hash(s), limit=1).num_rows > 0
            if s.ppo.adapters == "namespace":
                return bool(full_batch_namespaces(con, build_judge_config_hash(s), s.ppo.rollout_batch_size))
            return pending_counts(con, build_judge_config_hash(s), s.ppo.rollout_batch_size)["full_batches"] > 0

    return check


def relink_uis(config_path: str) -> None:
    """Point the links between the two UIs - each train run's artifact to its MLflow run and model version,
    each MLflow run to its Prefect flow run - at the UIs this `clawrl up` serves: the data may have been
    written by a demo or an earlier `clawrl up` on other ports."""
    from prefect.settings import PREFECT_UI_URL

    from clawrl.flows.common import flow_run_ui_url, load_flow_settings
    from clawrl.flows.train import relink_artifacts
    from clawrl.lineage import relink_to_prefect

    s = load_flow_settings(config_path)
    try:
        runs = relink_to_prefect(s.storage.data_root, flow_run_ui_url)
        artifacts = relink_artifacts(mlflow_ui_url())
    except Exception as e:  # noqa: BLE001 - links, not the flows: serve anyway and say so
        log.warning("the links between the Prefect and MLflow UIs were not updated: %s: %s", type(e).__name__, e)
        return
    if runs or artifacts:  # routine: every `clawrl up` on data written elsewhere does this
        log.info("links updated to the UIs now running: %d MLflow runs -> Prefect %s, %d Prefect artifacts -> "
                 "MLflow %s", runs, PREFECT_UI_URL.value(), artifacts, mlflow_ui_url())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--trainer-url", default=None)
    p.add_argument("--engine-url", default=None)
    p.add_argument("--judge-every", type=float, default=20.0)
    p.add_argument("--train-every", type=float, default=120.0)
    p.add_argument("--work-pool", default=None, help="Register the deployments on this process work pool (its "
                   "workers run the flows) instead of serving them from this process.")
    a = p.parse_args(argv)
    log.setLevel(logging.INFO)  # this server's own routine lines reach its log (the root logger passes WARNING up)
    ensure_judge_limit()
    relink_uis(a.config)
    stop = threading.Event()
    judge, train, replay = build_deployments(a.config, a.trainer_url, a.engine_url, a.judge_every, a.train_every)
    runner = None
    if a.work_pool:  # before the ticker: it creates runs of the registered deployments
        deploy_to_pool([judge, train, replay], a.work_pool,
                       {k: v for k, v in os.environ.items() if k.startswith(RUN_ENV)})
        log.info("deployments registered on work pool %r: `prefect worker start --pool %s` runs them",
                 a.work_pool, a.work_pool)
    else:
        preload()  # before any run's thread imports them: MLflow imported by two threads at once fails
        warm_up(a.config)  # MLflow's store and the gate's chat template, opened for the first train run
        runner = InProcessRunner([(judge, judge_flow), (train, train_flow)])
        runner.register()
        threading.Thread(target=runner.serve, args=(stop,), name="in-process-runs", daemon=True).start()
    every = {JUDGE_DEPLOYMENT: a.judge_every, TRAIN_DEPLOYMENT: a.train_every}
    def start(name: str) -> Any:  # with [ppo] adapters = "namespace", a train run per namespace with a batch
        return start_train_runs(a.config) if name == TRAIN_DEPLOYMENT else tick(name)

    threading.Thread(target=ticker, args=(every, stop, work_waiting(a.config), start), name="ticker",
                     daemon=True).start()
    try:
        if runner is None:
            stop.wait()  # the ticker's process, until SIGTERM or Ctrl-C
        else:
            serve(replay)
    finally:
        stop.set()
        if runner is not None and runner.stop():
            # runs still going in their threads: end now, as their processes would be killed, rather
            # than have them log into a shutting-down interpreter
            logging.shutdown()
            os._exit(1)

if __name__ == "__main__":
    main()
