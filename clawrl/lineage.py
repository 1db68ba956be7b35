"""MLflow lineage: one run per train step, the batch manifest as a dataset input, the checkpoint as
a registered model version, and the walk back from a weight version to the turns that trained it.

MLflow lives under the data root: ``sqlite:///<data_root>/mlflow/mlflow.db`` (tracking and
registry) with artifacts in ``<data_root>/mlflow/artifacts``. Model versions point at the
checkpoint directory itself (no copy of the weights into MLflow's artifact store).

Every write is idempotent by batch id: logging a step whose run already exists returns that run,
so a train flow re-run after a crash never creates a second run or model version for one batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

EXPERIMENT = "clawrl"
REGISTERED_MODEL = "clawrl-policy"


def tracking_uri(data_root: Path) -> str:
    return f"sqlite:///{Path(data_root) / 'mlflow' / 'mlflow.db'}"


def artifact_root(data_root: Path) -> Path:
    return Path(data_root) / "mlflow" / "artifacts"


def client(data_root: Path):
    from mlflow.tracking import MlflowClient

    (Path(data_root) / "mlflow").mkdir(parents=True, exist_ok=True)
    uri = tracking_uri(data_root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(c, data_root: Path, name: str = EXPERIMENT) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = artifact_root(data_root)
    artifacts.mkdir(parents=True, exist_ok=True)
    try:
        return c.create_experiment(name, artifact_location=artifacts.as_uri())
    except Exception:  # created concurrently by another process
        return c.get_experiment_by_name(name).experiment_id


def find_run(c, exp_id: str, batch_id: str):
    runs = c.search_runs([exp_id], filter_string=f"tags.batch_id = '{batch_id}'", max_results=1)
    return runs[0] if runs else None


def log_train_step(data_root: Path, *, step: dict[str, Any], params: dict[str, Any],
                   manifest: list[dict[str, Any]], tags: dict[str, str], experiment: str = EXPERIMENT,
                   register: bool = True, parent_run_id: str | None = None) -> str:
    """Log one PPO step; returns the run id (the existing one when this batch was logged before).

    ``step``: the trainer's StepResult as a dict; ``manifest``: one row per sample (sample_id,
    session_id, turn_id, reward, has_teacher, weight_version); ``params``: hyper-parameters and
    config hash; ``tags``: judge-config hash, method and anything else worth filtering on.
    """
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag, Metric, Param

    c = client(data_root)
    exp_id = experiment_id(c, data_root, experiment)
    existing = find_run(c, exp_id, step["batch_id"])
    if existing is not None:
        run_id = existing.info.run_id
    else:
        all_tags = {"batch_id": step["batch_id"], "weight_version": step["weight_version"],
                    "parent_version": step["parent_version"], "checkpoint_sha256": step["sha256"],
                    "sample_count": str(len(manifest)), **tags}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = c.create_run(exp_id, run_name=f"step-{step['step']:04d}", tags=all_tags)
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step["step"])) for k, v in step["metrics"].items()]
        c.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in sorted(params.items())])
        df = pd.DataFrame(manifest)
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]
        ds = mlflow.data.from_pandas(df, source=str(Path(data_root) / "tables" / "batches"),
                                     name=f"batch-{step['batch_id']}", digest=digest)
        c.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(),
                                                    tags=[InputTag("mlflow.data.context", "training")])])
        c.log_dict(run_id, {"batch_id": step["batch_id"], "samples": manifest}, "batch_manifest.json")
        c.set_terminated(run_id)
    if register:
        register_checkpoint(c, step=step, run_id=run_id, tags=tags, sample_count=len(manifest))
    return run_id


def register_checkpoint(c, *, step: dict[str, Any], run_id: str, tags: dict[str, str], sample_count: int):
    """The checkpoint as a version of the registered model, tagged with its lineage (idempotent)."""
    try:
        c.get_registered_model(REGISTERED_MODEL)
    except Exception:
        try:
            c.create_registered_model(REGISTERED_MODEL, description="Policy versions trained by clawrl.")
        except Exception:
            pass  # created concurrently
    for mv in c.search_model_versions(f"name = '{REGISTERED_MODEL}' and run_id = '{run_id}'"):
        return mv
    mv_tags = {"weight_version": step["weight_version"], "batch_id": step["batch_id"],
               "parent_version": step["parent_version"], "sample_count": str(sample_count),
               "checkpoint_sha256": step["sha256"], **{k: v for k, v in tags.items() if k == "judge_config_hash"}}
    mv = c.create_model_version(REGISTERED_MODEL, source=Path(step["path"]).as_uri(), run_id=run_id, tags=mv_tags)
    c.set_registered_model_alias(REGISTERED_MODEL, "newest", str(mv.version))
    return mv


def log_sync(data_root: Path, run_id: str, *, ok: bool, error: str | None, serving_version: str | None,
             seconds: float, target: str) -> None:
    """One weight-sync attempt on the run of the step that made the version: tags ``sync_status``
    (ok | failed), ``sync_error`` (the reason; removed again by a later success),
    ``sync_serving_version`` and ``sync_target``, and the metrics ``sync_ok`` (1/0) and
    ``sync_seconds`` with one point per attempt, so retries stay visible."""
    from mlflow.entities import Metric, RunTag

    c = client(data_root)
    attempt = len(c.get_metric_history(run_id, "sync_ok"))
    now = int(time.time() * 1000)
    tags = [RunTag("sync_status", "ok" if ok else "failed"), RunTag("sync_target", target),
            RunTag("sync_serving_version", "unknown" if serving_version is None else str(serving_version))]
    if not ok:
        tags.append(RunTag("sync_error", (error or "unknown error")[:4000]))
    c.log_batch(run_id, metrics=[Metric("sync_ok", float(ok), now, attempt),
                                 Metric("sync_seconds", float(seconds), now, attempt)], tags=tags)
    if ok and "sync_error" in c.get_run(run_id).data.tags:
        c.delete_tag(run_id, "sync_error")


def model_version_for(data_root: Path, weight_version: str):
    """The registered model version whose weight_version tag matches, or None."""
    c = client(data_root)
    for mv in c.search_model_versions(f"name = '{REGISTERED_MODEL}'"):
        if mv.tags.get("weight_version") == str(weight_version):
            return mv
    return None


def log_image(data_root: Path, run_id: str, png: Path, artifact_path: str = "plots") -> None:
    client(data_root).log_artifact(run_id, str(png), artifact_path)


def log_learning_curve(data_root: Path, *, rows: list[dict[str, Any]], png: Path, params: dict[str, Any],
                       experiment: str = EXPERIMENT) -> str:
    """One run for a whole learning loop: the held-out metrics per step, the curve PNG, the rows."""
    from mlflow.entities import Metric, Param

    c = client(data_root)
    exp_id = experiment_id(c, data_root, experiment)
    run = c.create_run(exp_id, run_name="learning-loop", tags={"kind": "learning-loop"})
    run_id = run.info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(r[k]), now, int(r["step"])) for r in rows
               for k in ("score", "on_topic_rate", "persona_rate", "kl", "mean_words") if r.get(k) is not None]
    c.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in sorted(params.items())])
    c.log_artifact(run_id, str(png), "plots")
    c.log_dict(run_id, {"rows": rows}, "learning_curve.json")
    c.set_terminated(run_id)
    return run_id


REPLAY_EXPERIMENT = "clawrl-replays"
REPLAY_MODEL = "clawrl-policy-replays"


def log_replay(data_root: Path, report: dict[str, Any]) -> str:
    """A replay as one MLflow run linked to the run that trained the original version; its final
    checkpoint as a version of the ``clawrl-policy-replays`` model, tagged with what was excluded."""
    from mlflow.entities import Metric, Param

    c = client(data_root)
    exp_id = experiment_id(c, data_root, REPLAY_EXPERIMENT)
    steps = report["steps"]
    original = next((s["original_run_id"] for s in reversed(steps) if s.get("original_run_id")), None)
    kind = "exact" if report["exact"] else ("unlearning" if report["excluded_sessions"] else "counterfactual")
    tags = {"kind": kind, "replay_id": report["replay_id"], "replay_of_version": str(report["source_version"]),
            "replay_of_run": original or "", "excluded_sessions": ",".join(report["excluded_sessions"]),
            "exclusion_reason": report["reason"], "identical": str(report["identical"])}
    run = c.create_run(exp_id, run_name=f"replay-{kind}-v{report['source_version']}", tags=tags)
    run_id = run.info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric("identical", float(bool(s["identical"])), now, s["step"]) for s in steps if s["identical"] is not None]
    metrics += [Metric("excluded_samples", float(s["excluded_samples"]), now, s["step"]) for s in steps]
    c.log_batch(run_id, metrics=metrics, params=[Param(f"set.{k}", str(v)) for k, v in sorted(report["overrides"].items())])
    c.log_dict(run_id, report, "replay.json")
    c.set_terminated(run_id)
    if report.get("final_path"):
        try:
            c.get_registered_model(REPLAY_MODEL)
        except Exception:
            try:
                c.create_registered_model(REPLAY_MODEL, description="Policies re-trained by clawrl replay.")
            except Exception:
                pass
        last = next(s for s in reversed(steps) if s["replay_sha256"])
        c.create_model_version(REPLAY_MODEL, source=Path(report["final_path"]).as_uri(), run_id=run_id, tags={
            **{k: v for k, v in tags.items() if v}, "checkpoint_sha256": last["replay_sha256"]})
    return run_id
