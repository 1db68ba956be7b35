"""The judge and train deployments' runs, executed in the flow server's own process.

Prefect's runner starts every run as a process of its own. A run of clawrl's flows then imports torch,
transformers, MLflow and scipy and opens the data store, MLflow's store and the gate's chat template
before its work: about 10 s of CPU a run, and under `clawrl up` on the GPU host ~10 s of each train
run's way from the claimed batch to serving. The judge and train runs are short and their long-lived
state lives in services (the trainer, the engines), so the flow server runs them itself, each in a
thread of its own, with all of that opened once. Replay (heavy, rare, started by hand) stays with
Prefect's runner, and ``clawrl up --work-pool`` still hands every run to the pool's workers.

A run is taken as Prefect's runner takes one: its Scheduled state moved to Pending, which the server
grants to one taker only, so a run started from the UI is executed once whoever else polls. The flow
engine then runs it as it would in a subprocess (states, task runs, logs and results in Prefect), and
the ``judge`` / ``trainer`` slots keep one run of each going. Config edits reach the runs after a
restart of the flow server (the settings are read once per process, as the trainer service does).
A thread cannot be killed: a run cancelled from the UI ends when its work does (a judge or train run
takes seconds), and a server stopped under a run gives it :data:`STOP_GRACE_S` before marking it
Crashed.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from clawrl.flows.slots import RUN_CREATED

STOP_GRACE_S = 10.0  # for the runs going when the server is stopped (`clawrl up` waits 15 s before SIGKILL)
POLL_S = 2.0  # runs created elsewhere (the UI, another process) are found within this; ticks here wake it at once
log = logging.getLogger(__name__)


def preload() -> None:
    """Import what the runs import lazily, once, before their threads start: MLflow imported from two
    threads at once fails on its circular imports ("partially initialized module 'mlflow'")."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - clawrl.lineage's store
    import mlflow.tracking  # noqa: F401
    import scipy.stats  # noqa: F401 - the promotion gate's t distribution


class InProcessRunner:
    """Execute the runs of the given deployments (each with its flow) in this process."""

    def __init__(self, deployments: list[tuple[Any, Any]]) -> None:
        self._deployments = deployments  # (RunnerDeployment, Flow)
        self._flows: dict[UUID, Any] = {}  # deployment id -> flow
        self._running: dict[UUID, threading.Thread] = {}
        self._lock = threading.Lock()

    def register(self) -> list[UUID]:
        """Register the deployments (no work pool, no runner of Prefect's serves them); their ids."""
        for deployment, flow in self._deployments:
            self._flows[deployment.apply()] = flow
        return list(self._flows)

    def running(self) -> list[UUID]:
        with self._lock:
            return list(self._running)

    def start_due(self) -> list[UUID]:
        """Take every due Scheduled run of the deployments and start it in a thread; the runs started."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import Abort
        from prefect.states import Pending
        from prefect.utilities.engine import propose_state_sync

        started = []
        with get_client(sync_client=True) as client:
            due = client.get_scheduled_flow_runs_for_deployments(list(self._flows),
                                                                 scheduled_before=datetime.now(timezone.utc))
            for run in due:
                if run.id in self.running():
                    continue
                try:
                    if not propose_state_sync(client, Pending(), flow_run_id=run.id).is_pending():
                        continue
                except Abort:  # another taker has it
                    continue
                thread = threading.Thread(target=self._execute, args=(self._flows[run.deployment_id], run),
                                          name=f"flow-run-{run.name}", daemon=True)
                with self._lock:
                    self._running[run.id] = thread
                thread.start()
                started.append(run.id)
        return started

    def _execute(self, flow, run) -> None:
        from prefect.flow_engine import run_flow

        try:
            run_flow(flow, flow_run=run, return_type="state")  # the engine records the run's end state itself
        except BaseException:  # noqa: BLE001 - a run's failure is its own, never the server's
            log.exception("flow run %s ended with an error outside the flow engine", run.name)
        finally:
            with self._lock:
                self._running.pop(run.id, None)

    def serve(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        """Start due runs until ``stop``, woken at once by a run this process creates
        (:func:`clawrl.flows.slots.tick`); a failed poll is logged and tried again."""
        while not stop.is_set():
            try:
                self.start_due()
            except Exception as e:  # noqa: BLE001 - the Prefect server restarting
                log.warning("looking for flow runs to start failed: %s", e)
            RUN_CREATED.wait(poll_s)
            RUN_CREATED.clear()

    def stop(self, grace_s: float = STOP_GRACE_S,
             message: str = "the flow server stopped while this run was going") -> list[UUID]:
        """Give the runs still going ``grace_s`` seconds to end, then mark the rest Crashed (the process
        is ending: their threads end with it, as a subprocess of Prefect's runner would be killed). The
        runs marked Crashed; what they wrote is as a kill -9 leaves it (exactly once, by the write-ahead
        logs and the claimed batches)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        deadline = time.monotonic() + grace_s
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        ids = self.running()
        if ids:
            with get_client(sync_client=True) as client:
                for run_id in ids:
                    try:
                        client.set_flow_run_state(run_id, Crashed(message=message), force=True)
                    except Exception as e:  # noqa: BLE001 - the server may be going down too
                        log.warning("marking flow run %s Crashed failed: %s", run_id, e)
        return ids
