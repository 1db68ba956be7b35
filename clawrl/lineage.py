"""MLflow lineage: one run per train step, the batch manifest as a dataset input, the checkpoint as
a registered model version (version N of ``clawrl-policy`` is weight version N), and the walk back from a
weight version to the turns that trained it.

With ``[ppo] adapters = "namespace"`` each namespace has an experiment of its own,
``clawrl-<namespace>`` (:func:`namespace_experiment`), holding its steps, its ``policy`` run (curves over
its adapter versions) and its replays, and a registered model of its own, ``clawrl-adapter-<namespace>``:
no run holds two namespaces' samples or sessions, and forgetting a namespace deletes both for good
(:func:`forget_namespace_lineage`).

MLflow lives under the data root: ``sqlite:///<data_root>/mlflow/mlflow.db`` (tracking and
registry) with artifacts in ``<data_root>/mlflow/artifacts``. Model versions point at the
checkpoint directory itself (no copy of the weights into MLflow's artifact store).

Every write is idempotent by batch id: logging a step whose run already exists returns that run,
so a train flow re-run after a crash never creates a second run or model version for one batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXPERIMENT = "clawrl"
REGISTERED_MODEL = "clawrl-policy"
# MLflow numbers a model's versions 1, 2, ... in the order they are registered; registering each trained
# version in order, and nothing else, makes its number the weight version, so `models:/clawrl-policy/4` and
# MLflow's reserved alias `@v4` are weight version 4
POLICY_MODEL_DESCRIPTION = (
    "Policy versions trained by clawrl: model version N is weight version N (its tag weight_version says so). "
    "Weight version 0, the initial weights, is no model version (MLflow counts from 1): while it serves, no "
    "version carries @champion and the tag champion_weight_version is 0.")


def store_path(data_root: Path) -> Path:
    """The sqlite file of the data root's MLflow store (tracking and registry)."""
    return Path(data_root) / "mlflow" / "mlflow.db"


def store_uri(data_root: Path) -> str:
    return f"sqlite:///{store_path(data_root)}"


def client(data_root: Path):
    from mlflow.tracking import MlflowClient

    db = store_path(data_root)
    db.parent.mkdir(parents=True, exist_ok=True)
    if not db.exists():
        _create_store(db)
    uri = store_uri(data_root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _create_store(db: Path) -> None:
    """Make a new store under a temporary name and link it into place whole. MLflow creates its tables
    and runs its migrations for seconds; a process killed meanwhile (a train run's warm-up opens the
    store while the step trains) would otherwise leave a half-migrated ``mlflow.db`` that every later
    open fails on ("table ... already exists"). When two processes race, the first link wins and the
    other's copy is dropped. MLflow's "Default" experiment keeps its artifacts here, not in the cwd."""
    from mlflow.entities import ExperimentTag
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    artifacts = db.parent / "artifacts"
    artifacts.mkdir(exist_ok=True)
    for stale in db.parent.glob(f".{db.name}.*.tmp*"):  # left by a killed process (and its journal)
        with contextlib.suppress(ValueError, OSError):
            if not pid_alive(int(stale.name.split(".")[-2].split("-")[0])):
                stale.unlink()
    tmp = db.with_name(f".{db.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", artifacts.as_uri())
        store.set_experiment_tag("0", ExperimentTag(*EXPERIMENT_KIND))
        store.engine.dispose()
        try:
            os.link(tmp, db)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a rename, which a racing process may overwrite
            if not db.exists():
                os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


# what the experiment is: model training (runs, metrics, models), not GenAI development (traces, evaluations)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# MLflow 3.17's UI ignores that kind for its navigation: a switch of its own in the sidebar (GenAI | Model
# training, remembered by the browser, GenAI until changed) decides, and under GenAI the training runs sit
# under "Evaluation" with no model registry in sight. A page opened with this query shows the model-training
# view, whatever the switch says.
ML_VIEW = "workflowType=machine_learning"


def ui_page(base_url: str, page: str) -> str:
    """The page ``page`` (``experiments/1/runs/<id>``, ``models/...``) of the MLflow UI at ``base_url``, in its
    model-training view."""
    return f"{base_url}/#/{page}?{ML_VIEW}"


def experiment_id(c, data_root: Path, name: str = EXPERIMENT) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is None:
        artifacts = Path(data_root) / "mlflow" / "artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        try:
            c.create_experiment(name, artifact_location=artifacts.as_uri(), tags=dict([EXPERIMENT_KIND]))
        except Exception:  # created concurrently by another process
            pass
        exp = c.get_experiment_by_name(name)
    if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # made before the tag was set
        c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def ui_links(data_root: Path, run_id: str, base_url: str) -> dict[str, str]:
    """URLs of a train step's MLflow run and of its model version in the MLflow UI at ``base_url``."""
    c = client(data_root)
    run = c.get_run(run_id)
    links = {"mlflow_run": ui_page(base_url, f"experiments/{run.info.experiment_id}/runs/{run_id}")}
    for mv in c.search_model_versions(f"name = '{REGISTERED_MODEL}' and run_id = '{run_id}'"):
        links["model_version"] = ui_page(base_url, f"models/{REGISTERED_MODEL}/versions/{mv.version}")
    return links


PREFECT_RUN_ID_TAG = "prefect.flow_run_id"  # on a run a flow made: its Prefect flow run
PREFECT_RUN_TAG = "prefect.flow_run_url"  # ... and that flow run's page in the Prefect UI
NOTE_TAG = "mlflow.note.content"  # the run's description, which the MLflow UI renders as Markdown


def prefect_link_tags(flow_run_id: str, url: str) -> dict[str, str]:
    """The tags that link a run to its Prefect flow run at ``url``: its id, the URL, and the run's
    description with the link to click (the MLflow UI shows tags as text, cut short)."""
    return {PREFECT_RUN_ID_TAG: flow_run_id, PREFECT_RUN_TAG: url,
            NOTE_TAG: f"Made by the Prefect flow run [{flow_run_id}]({url})."}


def relink_to_prefect(data_root: Path, flow_run_url: Callable[[str], str]) -> int:
    """Point every run's link to its Prefect flow run (:func:`prefect_link_tags`) at ``flow_run_url(id)``,
    the flow run's page in the Prefect UI running now: the data brought up again by `clawrl up`, on
    other ports than the run that wrote it, links the UI that runs now. Returns the runs changed."""
    from mlflow.entities import RunTag

    c = client(data_root)
    changed = 0
    for exp in c.search_experiments():
        token = None
        while True:
            page = c.search_runs([exp.experiment_id], max_results=1000, page_token=token)
            for run in page:
                if not (flow_run_id := run.data.tags.get(PREFECT_RUN_ID_TAG)):
                    continue
                tags = prefect_link_tags(flow_run_id, flow_run_url(flow_run_id))
                if any(run.data.tags.get(k) != v for k, v in tags.items()):
                    c.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                    changed += 1
            token = page.token
            if not token:
                break
    return changed


def _ensure_registered_model(c, name: str, description: str) -> None:
    with contextlib.suppress(Exception):  # it exists already (made before, or just now by another process)
        c.create_registered_model(name, description=description)


def _metric(key: str, value: float, step: int):
    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), int(step))


def _new_run(c, exp_id: str, name: str, *, tags: dict[str, str], metrics: list, params: dict[str, Any],
             record: dict[str, Any], record_file: str) -> str:
    """A run with its tags, metrics, params (enum members as their value) and a JSON record."""
    from mlflow.entities import Param

    run_id = c.create_run(exp_id, run_name=name, tags=tags).info.run_id
    c.log_batch(run_id, metrics=metrics,
                params=[Param(k, str(getattr(v, "value", v))) for k, v in sorted(params.items())])
    c.log_dict(run_id, record, record_file)
    return run_id


POLICY_RUN = "policy"  # the run whose metrics are curves over weight versions (step = version)


def policy_run(c, exp_id: str) -> str:
    """The experiment's ``policy`` run (made on first use): every train step's metrics, and the
    evaluations of the versions served, logged at step = weight version, so the MLflow UI draws
    loss, reward, KL and held-out scores as curves over versions. The step runs are its children."""
    runs = c.search_runs([exp_id], filter_string=f"tags.kind = '{POLICY_RUN}'", max_results=1,
                         order_by=["attributes.start_time ASC"])
    if runs:
        return runs[0].info.run_id
    return c.create_run(exp_id, run_name=POLICY_RUN, tags={"kind": POLICY_RUN}).info.run_id


def namespace_experiment(namespace: str) -> str:
    """The MLflow experiment of one namespace's adapter: its steps, its curves, its replays."""
    return f"{EXPERIMENT}-{namespace}"


def namespace_model(namespace: str) -> str:
    """The registered model of one namespace's adapter versions (tag ``weight_version``: the adapter's name)."""
    return f"clawrl-adapter-{namespace}"


def log_policy_point(data_root: Path, version: int, metrics: dict[str, float], experiment: str = EXPERIMENT) -> str:
    """``metrics`` at step ``version`` of the policy run, once: keys already logged at that step are
    left alone (a re-run after a crash, a replayed evaluation). Returns the policy run's id."""
    c = client(data_root)
    run_id = policy_run(c, experiment_id(c, data_root, experiment))
    fresh = [_metric(k, v, version) for k, v in metrics.items()
             if v is not None and all(m.step != version for m in c.get_metric_history(run_id, k))]
    if fresh:
        c.log_batch(run_id, metrics=fresh)
        c.set_terminated(run_id)  # finished between points (MLflow takes points on finished runs)
    return run_id


def write_mlmodel(ckpt_dir: Path, step: dict[str, Any]) -> None:
    """An ``MLmodel`` file in the checkpoint directory (atomically, once): what the MLflow UI reads
    for a model version's page - the flavor (an HF safetensors checkpoint served by clawrl, not a
    copy of the weights) and the signature (chat messages in, the answer's text out). The
    checkpoint's sha256 covers ``model.safetensors`` only, so this file changes no recorded hash."""
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    target = Path(ckpt_dir) / "MLmodel"
    if target.exists():
        return
    flavor = {"format": "huggingface-safetensors", "weights": "model.safetensors", "sha256": step["sha256"],
              "weight_version": str(step["weight_version"]), "parent_version": str(step["parent_version"])}
    signature = ModelSignature(inputs=Schema([ColSpec("string", "messages")]),
                               outputs=Schema([ColSpec("string", "content")]))
    tmp = target.with_name(".MLmodel.tmp")
    Model(flavors={"clawrl": flavor}, signature=signature).save(str(tmp))
    tmp.replace(target)


def _lineage_tags(step: dict[str, Any]) -> dict[str, str]:
    return {"batch_id": step["batch_id"], "weight_version": step["weight_version"],
            "parent_version": step["parent_version"], "checkpoint_sha256": step["sha256"]}


def start_step_run(data_root: Path, *, step: dict[str, Any], tags: dict[str, str], experiment: str = EXPERIMENT) -> str:
    """The MLflow run of one PPO step (``step``: the trainer's StepResult as a dict), made with its
    lineage tags and ``tags`` before anything else is logged on it, since the checkpoint record, the
    gate and the sync name it; the existing run when this batch has one. :func:`log_train_step`
    completes it."""
    c = client(data_root)
    exp_id = experiment_id(c, data_root, experiment)
    runs = c.search_runs([exp_id], filter_string=f"tags.batch_id = '{step['batch_id']}'", max_results=1)
    if runs:
        return runs[0].info.run_id
    parent = {"mlflow.parentRunId": policy_run(c, exp_id)}  # nested under the policy run in the UI
    return c.create_run(exp_id, run_name=f"step-{step['step']:04d}",
                        tags={**_lineage_tags(step), **tags, **parent}).info.run_id


def log_train_step(data_root: Path, *, step: dict[str, Any], params: dict[str, Any],
                   manifest: list[dict[str, Any]], tags: dict[str, str], run_id: str | None = None,
                   experiment: str = EXPERIMENT, model: str = REGISTERED_MODEL) -> str:
    """Log one PPO step: its run (``run_id``, else :func:`start_step_run`'s) with the step's metrics,
    ``params``, the batch manifest (a JSON record and a dataset input), finished; and the checkpoint
    as a version of the registered model, tagged with its lineage. Returns the run id. Idempotent:
    a finished run and a registered version are left as they are (a re-run after a crash).

    ``manifest``: one row per sample (sample_id, session_id, turn_id, reward, has_teacher,
    weight_version); ``params``: hyper-parameters and config hash; ``tags``: judge-config hash,
    method and anything else worth filtering on.
    """
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag, Param, RunStatus

    c = client(data_root)
    run_id = run_id or start_step_run(data_root, step=step, tags=tags, experiment=experiment)
    if c.get_run(run_id).info.status != RunStatus.to_string(RunStatus.FINISHED):
        c.log_batch(run_id, metrics=[_metric(k, v, step["step"]) for k, v in step["metrics"].items()],
                    params=[Param(k, str(getattr(v, "value", v))) for k, v in sorted(params.items())])
        c.log_dict(run_id, {"batch_id": step["batch_id"], "samples": manifest}, "batch_manifest.json")
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]
        ds = mlflow.data.from_pandas(pd.DataFrame(manifest), name=f"batch-{step['batch_id']}", digest=digest,
                                     source=_local_source(Path(data_root) / "tables" / "batches"))
        c.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(),
                                                    tags=[InputTag("mlflow.data.context", "training")])])
        c.set_tag(run_id, "sample_count", str(len(manifest)))
        c.set_terminated(run_id)
    _ensure_registered_model(c, model, POLICY_MODEL_DESCRIPTION if model == REGISTERED_MODEL else
                             "LoRA adapter versions of one namespace: tag weight_version is the adapter's name.")
    if not c.search_model_versions(f"name = '{model}' and run_id = '{run_id}'"):  # once per run
        if model == REGISTERED_MODEL:  # an adapter directory holds what PEFT, SGLang and vLLM load, nothing else
            write_mlmodel(Path(step["path"]), step)
        mv_tags = {**_lineage_tags(step), "sample_count": str(len(manifest)),
                   **{k: v for k, v in tags.items() if k in ("judge_config_hash", "namespace")}}
        mv = c.create_model_version(model, source=Path(step["path"]).as_uri(), run_id=run_id, tags=mv_tags,
                                    description=f"Weight version {step['weight_version']}, trained from version "
                                                f"{step['parent_version']} on batch {step['batch_id']}.")
        c.set_registered_model_alias(model, "newest", str(mv.version))
    log_policy_point(data_root, int(step["step"]), step["metrics"], experiment)
    return run_id


def _local_source(path: Path):
    """The MLflow dataset source of a local directory, made as the ``local`` source it is: given a path,
    MLflow finds two registered local sources (schemes "" and "file") that resolve it and warns that it
    "can be interpreted in multiple ways" on every step."""
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json

    return get_dataset_source_from_json(json.dumps({"uri": str(path)}), source_type="local")


def runs_without_model_version(data_root: Path, run_ids: Sequence[str]) -> list[str]:
    """Those of ``run_ids`` that no version of the registered model names (a step whose lineage a
    stopped train run left unfinished)."""
    c = client(data_root)
    try:
        registered = {mv.run_id for mv in c.search_model_versions(f"name = '{REGISTERED_MODEL}'")}
    except Exception:  # no registered model yet
        registered = set()
    return [r for r in run_ids if r not in registered]


def log_sync(data_root: Path, run_id: str, *, ok: bool, error: str | None, serving_version: str | None,
             seconds: float, target: str, weight_version: str) -> None:
    """One weight-sync attempt on the run of the step that made ``weight_version``: tags ``sync_status``
    (ok | failed), ``sync_error`` (the reason; removed again by a later success),
    ``sync_serving_version`` and ``sync_target``, and the metrics ``sync_ok`` (1/0) and
    ``sync_seconds`` at step = the weight version, like the step's other metrics: one point per
    attempt, so retries stay visible."""
    from mlflow.entities import RunTag

    c = client(data_root)
    step = int(weight_version) if str(weight_version).isdigit() else 0
    tags = [RunTag("sync_status", "ok" if ok else "failed"), RunTag("sync_target", target),
            RunTag("sync_serving_version", "unknown" if serving_version is None else str(serving_version))]
    if not ok:
        tags.append(RunTag("sync_error", (error or "unknown error")[:4000]))
    c.log_batch(run_id, metrics=[_metric("sync_ok", ok, step), _metric("sync_seconds", seconds, step)], tags=tags)
    if ok and "sync_error" in c.get_run(run_id).data.tags:
        c.delete_tag(run_id, "sync_error")


def set_policy_alias(data_root: Path, alias: str, weight_version: str, model: str = REGISTERED_MODEL) -> str | None:
    """Point the ``clawrl-policy`` (``model``) alias ``alias`` (``champion``, ``candidate``) at the model
    version of ``weight_version`` and set the registered model's tag ``<alias>_weight_version`` to it;
    returns that model version, or None when the version has none, as the initial weights (then the alias
    is removed and only the tag says which version it is)."""
    c = client(data_root)
    with contextlib.suppress(Exception):  # no registered model yet: nothing trained, nothing to point at
        c.set_registered_model_tag(model, f"{alias}_weight_version", str(weight_version))
    found = c.search_model_versions(f"name = '{model}' and tags.weight_version = '{weight_version}'")
    if not found:
        with contextlib.suppress(Exception):  # no registered model or no such alias yet
            c.delete_registered_model_alias(model, alias)
        return None
    mv = min(found, key=lambda m: int(m.version))  # the first registered for this weight version
    c.set_registered_model_alias(model, alias, str(mv.version))
    return str(mv.version)


def log_gate(data_root: Path, run_id: str, *, step: int, evidence: dict[str, Any], decision: str, reason: str,
             champion_version: str) -> None:
    """The promotion gate's decision on the run of the step that made the candidate: metrics
    ``gate_promoted`` (1/0), ``gate_candidate_mean``, ``gate_champion_mean``, ``gate_mean_diff``,
    ``gate_ci_low``, ``gate_ci_high``, ``gate_p_value``, ``gate_eval_seconds`` at ``step`` (those known),
    and the tags ``gate_decision``, ``gate_reason``, ``gate_champion_version``, ``gate_eval_set``
    (validation or replay)."""
    from mlflow.entities import RunTag

    keys = ("candidate_mean", "champion_mean", "mean_diff", "ci_low", "ci_high", "p_value", "eval_seconds")
    metrics = [_metric("gate_promoted", decision == "promote", step)]
    metrics += [_metric(f"gate_{k}", evidence[k], step) for k in keys
                if isinstance(evidence.get(k), (int, float)) and evidence[k] == evidence[k]]  # not None, not NaN
    tags = [RunTag("gate_decision", decision), RunTag("gate_reason", reason[:4000]),
            RunTag("gate_champion_version", str(champion_version))]
    if evidence.get("eval_set"):
        tags.append(RunTag("gate_eval_set", str(evidence["eval_set"])))
    client(data_root).log_batch(run_id, metrics=metrics, tags=tags)


def log_doctor(data_root: Path, run_id: str, *, step: int, report: dict[str, Any], png: Path | None = None) -> None:
    """``clawrl doctor``'s report on the run of the step it was made after: metrics
    ``doctor_problems`` and ``doctor_ok_<finding>`` (1/0) at ``step``, ``doctor.json``, and the
    per-version plot ``png``."""
    c = client(data_root)
    findings = report["findings"]
    metrics = [_metric("doctor_problems", sum(not f["ok"] for f in findings), step)]
    metrics += [_metric(f"doctor_ok_{f['name']}", f["ok"], step) for f in findings]
    c.log_batch(run_id, metrics=metrics)
    c.log_dict(run_id, report, "doctor.json")
    if png is not None:
        c.log_artifact(run_id, str(png))


def log_learning_curve(data_root: Path, *, rows: list[dict[str, Any]], png: Path, params: dict[str, Any],
                       keys: Sequence[str], tags: dict[str, str] | None = None) -> str:
    """One run for a whole learning loop: the held-out metrics ``keys`` per step, the curve PNG, the rows;
    ``tags`` on top of ``kind = learning-loop`` (the link to the loop's Prefect flow run)."""
    c = client(data_root)
    metrics = [_metric(k, r[k], r["step"]) for r in rows for k in dict.fromkeys(keys) if r.get(k) is not None]
    run_id = _new_run(c, experiment_id(c, data_root), "learning-loop", tags={"kind": "learning-loop", **(tags or {})},
                      metrics=metrics, params=params, record={"rows": rows}, record_file="learning_curve.json")
    c.log_artifact(run_id, str(png), "plots")
    c.set_terminated(run_id)
    return run_id


REPLAY_EXPERIMENT = "clawrl-replays"
REPLAY_MODEL = "clawrl-policy-replays"


def log_replay(data_root: Path, report: dict[str, Any]) -> str:
    """A replay as one MLflow run linked to the run that trained the original version; its final
    checkpoint as a version of the ``clawrl-policy-replays`` model, tagged with what was excluded
    (``excluded_sessions``: comma-separated ``NAMESPACE:SESSION_ID`` pairs). A replay of a namespace's
    adapter is a run of that namespace's experiment, and registers nothing."""
    namespace = report.get("namespace")
    experiment = REPLAY_EXPERIMENT if namespace is None else namespace_experiment(namespace)
    c = client(data_root)
    steps = report["steps"]
    original = next((s["original_run_id"] for s in reversed(steps) if s.get("original_run_id")), None)
    kind = "exact" if report["exact"] else ("unlearning" if report["excluded_sessions"] else "counterfactual")
    excluded = ",".join(":".join(pair) for pair in report["excluded_sessions"])
    tags = {"kind": kind, "replay_id": report["replay_id"], "replay_of_version": str(report["source_version"]),
            "replay_of_run": original or "", "excluded_sessions": excluded, "exclusion_reason": report["reason"],
            "identical": str(report["identical"]), "replay_version": str(report.get("final_version") or "")}
    metrics = [_metric("identical", bool(s["identical"]), s["step"]) for s in steps if s["identical"] is not None]
    metrics += [_metric("excluded_samples", s["excluded_samples"], s["step"]) for s in steps]
    metrics += [_metric("max_abs_diff", s["max_abs_diff"], s["step"]) for s in steps if s.get("max_abs_diff") is not None]
    run_id = _new_run(c, experiment_id(c, data_root, experiment), f"replay-{kind}-v{report['source_version']}",
                      tags=tags, metrics=metrics, params={f"set.{k}": v for k, v in report["overrides"].items()},
                      record=report, record_file="replay.json")
    c.set_terminated(run_id)
    if report.get("final_path") and namespace is None:
        _ensure_registered_model(c, REPLAY_MODEL, "Policies re-trained by clawrl replay.")
        last = next(s for s in reversed(steps) if s["replay_sha256"])
        c.create_model_version(REPLAY_MODEL, source=Path(report["final_path"]).as_uri(), run_id=run_id, tags={
            **{k: v for k, v in tags.items() if v}, "checkpoint_sha256": last["replay_sha256"]})
    return run_id


def forget_namespace_lineage(data_root: Path, namespace: str) -> int:
    """Delete ``namespace``'s experiment and registered model (:func:`namespace_experiment`,
    :func:`namespace_model`) for good: its runs with their metrics, params, tags, dataset inputs and
    artifacts. MLflow's own deletion only marks an experiment deleted; ``mlflow gc`` then removes it from
    the store (in a process of its own: it sets MLflow's global tracking URI), and the store is vacuumed so
    that none of its bytes stay behind in freed pages. Returns the runs removed."""
    import shutil
    import sqlite3
    import subprocess
    import sys

    from mlflow.entities import ViewType

    c = client(data_root)
    with contextlib.suppress(Exception):  # none registered yet
        c.delete_registered_model(namespace_model(namespace))  # versions and aliases with it: no soft delete here
    exp = c.get_experiment_by_name(namespace_experiment(namespace))
    runs = 0
    if exp is not None:
        runs = len(c.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=50_000))
        if exp.lifecycle_stage != "deleted":
            c.delete_experiment(exp.experiment_id)
        uri = store_uri(data_root)
        subprocess.run([sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", uri, "--tracking-uri", uri,
                        "--experiment-ids", exp.experiment_id], check=True, capture_output=True, timeout=600)
        location = exp.artifact_location.removeprefix("file://")
        if location.startswith(str(Path(data_root))):  # what gc leaves: the experiment's empty folders
            shutil.rmtree(location, ignore_errors=True)
    with contextlib.closing(sqlite3.connect(store_path(data_root))) as db:
        db.execute("VACUUM")
    return runs
