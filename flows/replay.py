"""Prefect flow `replay`: re-train a run's versions from its logged samples (exact, unlearning or
counterfactual), compare checkpoint hashes, and record the replay in MLflow linked to the original.
Runnable from the Prefect UI (``clawrl up`` serves it as a deployment) and by ``clawrl replay``."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawrl.config import parse_override
from clawrl.lineage import log_replay
from clawrl.replay import replay
from clawrl.flows.common import load_flow_settings


@task(cache_policy=NO_CACHE)
def run_replay(config_path: str | None, version: str, exclude_sessions: list[str], reason: str,
               overrides: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    s = load_flow_settings(config_path)
    log = get_run_logger()

    def progress(step) -> None:
        verdict = {True: "identical", False: "DIFFERENT", None: "replayed"}[step.identical]
        if step.trained_ranks > 1 and step.max_abs_diff is not None:
            verdict += f" on 1 rank (trained on {step.trained_ranks}): max |dw| {step.max_abs_diff:.3g}"
        log.info("step %d (batch %s -> %s): %d samples (%d excluded) -> %s", step.step, step.batch_id,
                 step.replay_batch_id or "-", step.samples, step.excluded_samples, verdict)

    return replay(s, version, exclude_sessions=tuple(exclude_sessions), reason=reason, overrides=overrides,
                  progress=progress, namespace=namespace).to_dict()


@task(cache_policy=NO_CACHE)
def record_replay(config_path: str | None, report: dict[str, Any]) -> str:
    s = load_flow_settings(config_path)
    return log_replay(s.storage.data_root, report)


@flow(name="replay", flow_run_name="replay-v{version}", log_prints=True)
def replay_flow(config_path: str | None = None, version: str = "latest", exclude_sessions: list[str] | None = None,
                reason: str = "", set_overrides: list[str] | None = None, namespace: str | None = None) -> dict[str, Any]:
    """``version``: a weight version or 'latest'; ``exclude_sessions``: ["NAMESPACE:SESSION_ID", ...] (a bare
    session id where only one API-key namespace uses it); ``set_overrides``: ["ppo.lr=1e-5", ...];
    ``namespace``: a version of that namespace's adapter ([ppo] adapters = "namespace")."""
    overrides = dict(parse_override(x) for x in (set_overrides or []))
    report = run_replay(config_path, version, list(exclude_sessions or []), reason, overrides, namespace)
    report["mlflow_run_id"] = record_replay(config_path, report)
    verdict = report["identical"]
    diffs = [st["max_abs_diff"] for st in report["steps"] if st["max_abs_diff"] is not None]
    print(f"replay {report['replay_id']} of version {report['source_version']}: "
          + ("checkpoints byte-identical" if verdict else "CHECKPOINTS DIFFER" if verdict is False
             else f"{len(report['excluded_sessions'])} sessions excluded, overrides {report['overrides']}"
             if not report["exact"] else f"replayed on 1 rank, largest weight difference {max(diffs, default=0):.3g}"))
    return report
