"""The flows served as Prefect deployments (started by ``clawrl up``; also ``python -m clawrl.flows.serve``).

* ``judge/on-interval``: judges ready turns on an interval schedule (editable in the Prefect UI).
  Its runs are ``exclusive``: one that starts while another judge run is going ends Completed at
  once with ``skipped`` (each run judges everything ready, so it has nothing to add), never
  Cancelled; the slot is Prefect's global concurrency limit ``judge``, leased, created here.
* ``train/on-samples-ready``: runs when the judge flow emits ``clawrl.samples.ready`` (a full batch
  waits), and on an interval as a safety net. Its runs are ``exclusive`` too, on the global limit
  ``trainer``: one triggered while another trains ends Completed with ``skipped`` (the next judge
  run emits the event again while a full batch waits).
* ``replay/on-demand``: no schedule; run it from the UI with a version, sessions to exclude, or
  ``--set`` style overrides.

Flow runs execute in subprocesses of this server; the long-lived state lives elsewhere: the trainer
service (model + optimizer) at ``--trainer-url``, the serving engine behind ``--engine-url``, the
judge engine (the frozen initial weights) at ``[prm] engine_url`` when `clawrl up` starts one. Each
deployment names its flow by module path (``clawrl.flows.train.train_flow``), which those subprocesses
import wherever clawrl is installed, whatever their working directory.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from prefect import serve
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from clawrl.flows.judge import SAMPLES_READY_EVENT, ensure_judge_limit, judge_flow
from clawrl.flows.replay import replay_flow
from clawrl.flows.train import train_flow


def build_deployments(config_path: str, trainer_url: str | None, engine_url: str | None,
                      judge_every_s: float = 20.0, train_every_s: float = 120.0):
    # no deployment limits (their collisions would end Cancelled): each flow takes its own slot
    # (`judge`, `trainer`) without waiting, and a run that finds it taken skips, Completed
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "parameters": {"config_path": config_path}}
    judge = judge_flow.to_deployment(
        name="on-interval", interval=timedelta(seconds=judge_every_s),
        **{**common, "parameters": {"config_path": config_path, "exclusive": True}},
        description="Judge turns whose next state arrived (PRM votes, hints, teacher); a run that finds another "
                    "judge run going skips, Completed.")
    train = train_flow.to_deployment(
        name="on-samples-ready", interval=timedelta(seconds=train_every_s),
        **{**common, "parameters": {"config_path": config_path, "max_steps": 1, "trainer_url": trainer_url,
                                    "engine_url": engine_url, "exclusive": True}},
        triggers=[DeploymentEventTrigger(expect={SAMPLES_READY_EVENT},
                                         match={"prefect.resource.id": "clawrl.samples.*"})],
        description="One PPO step per full batch of trainable samples, then checkpoint, lineage, gate, sync; a run "
                    "that finds another training skips, Completed.")
    replay = replay_flow.to_deployment(name="on-demand", **common,
                                       description="Re-train from logged samples: exact, unlearning or counterfactual.")
    return [judge, train, replay]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--trainer-url", default=None)
    p.add_argument("--engine-url", default=None)
    p.add_argument("--judge-every", type=float, default=20.0)
    p.add_argument("--train-every", type=float, default=120.0)
    a = p.parse_args(argv)
    ensure_judge_limit()
    serve(*build_deployments(a.config, a.trainer_url, a.engine_url, a.judge_every, a.train_every))


if __name__ == "__main__":
    main()
