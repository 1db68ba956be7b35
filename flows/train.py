"""Prefect flow `train`: a full batch of judged samples -> one PPO step -> checkpoint -> gate -> sync -> lineage.

Thin orchestration over clawrl.trainer_service, clawrl.lineage and clawrl.sync.
Exactly once, with a crash allowed between any two tasks:

1. ``claim_batch`` writes a ``batches`` row (the samples it consumes) before training. A re-run
   first resumes a claimed batch that has no checkpoint yet, so no sample is lost or taken twice.
2. ``run_step`` asks the long-lived trainer to train on the batch; the trainer is idempotent per
   batch id (it returns the stored result for a batch it already applied). It returns once the
   checkpoint's served weights are written; the trainer writes its own state (optimizer, master
   weights) meanwhile in the background (``clawrl.train.trainer``).
3. ``start_lineage`` creates the step's MLflow run, idempotent by batch id, tagged with its lineage
   and this flow run's id and URL (the records below name it).
4. ``record_checkpoint`` appends the ``checkpoints`` row once per weight version.
5. ``gate_checkpoint``: the new version is a candidate; the promotion gate (``clawrl.promotion``)
   scores it on the ``[gate]`` evaluation set in an evaluation engine (``[gate] engine_url``: the one
   `clawrl up` keeps, over HTTP; else one loaded in this process), paired with the champion,
   and promotes it only when it is not worse beyond the tolerance (and, with ``min_gain``, better by
   more than that). The decision is a ``promotions``
   row and points on the step's MLflow run. With ``[gate] enabled = false`` every candidate is
   promoted unevaluated.
6. ``sync_weights`` pushes the champion to the serving engine (``clawrl.sync``): the candidate when
   promoted, else the champion that served before (nothing to load when it already serves). Every
   attempt is a ``syncs`` row and a point on the MLflow run of the version pushed; after a failed
   one the next step's sync, or ``clawrl sync``, pushes again.
   With ``[gate] canary_share``, ``sync_canary`` then loads the new version, promoted or not, into the
   canary engine that serves that share of sessions (``clawrl.engine.canary``; not a ``syncs`` row).

After the sync, since nothing on the way to serving the new version needs them:

7. ``log_lineage`` completes the MLflow run (metrics, params, the batch manifest), registers the
   checkpoint as a version of ``clawrl-policy`` and points its ``candidate`` / ``champion`` aliases
   as the gate decided. A run stopped after its checkpoint row (which the re-run does not redo)
   leaves that lineage unfinished, and so does a ``log_lineage`` that fails (the checkpoint directory
   unreachable, say: the step is served, so the run goes on); the next run's ``log_lineage``
   completes it.
8. ``link_step`` links the MLflow run and model version back from this flow run (a markdown
   artifact). The flow run is named for the version it makes (``train-v16``) when it begins, from the
   batch waiting then; ``link_step`` renames it only when it made another.
9. ``log_doctor_report`` puts ``clawrl doctor``'s findings on the step's MLflow run and logs each
   problem it finds as a warning (a report: it never fails the step).

"One training step at a time" is Prefect's global concurrency limit ``trainer`` (limit 1), not a
lock in code. The trainer is the one in this process (``clawrl train``, ``clawrl demo``) or a
trainer service at ``trainer_url`` (``clawrl up``).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from clawrl import trainer_service
from clawrl.config import config_hash, dump_toml, mlflow_ui_url
from clawrl.flows.common import (data_store, eval_adapter, eval_engine, gate_version, load_flow_settings,
                                 prefect_tags, push_canary, push_weights, serve_target, train_step)
from clawrl.flows.adapters import train_adapters
from clawrl.flows.slots import TRAINER_LIMIT, ensure_limit, leased_slot, mark_idle, run_time_name, skipped_because
from clawrl.hooks import hook_params, load_hook
from clawrl.judge.runner import build_judge_config_hash
from clawrl.doctor import plot_learning_by_version, report, settings_checks
from clawrl.lineage import (client as mlflow_client, experiment_id, log_doctor, log_train_step, start_step_run,
                            ui_links, ui_page)
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import batch_manifest
from clawrl.sync import NO_ENGINE
from clawrl.train.base import PPOHyperParams


def _crash_point(name: str) -> None:
    """No-op; the crash tests replace it to kill the process between two tasks."""


_warming: dict[str | None, threading.Thread] = {}


def warm_up(config_path: str | None) -> None:
    """Open, while the batch is trained on, what the way from the checkpoint to serving needs:
    MLflow's store and the chat template of the gate's evaluation engine over HTTP (one in this process
    is loaded by the gate, never for a run without a batch): once per process, in a thread. The flow
    server of `clawrl up`, whose train runs are threads of its own, calls it at its start (opening
    MLflow's store on the way to serving cost the first train run 9.5 s on 2 cores); elsewhere a train
    run calls it once its batch is claimed. Errors are left to the tasks, which open the same things
    again and say what failed."""

    def work() -> None:
        s = load_flow_settings(config_path)
        with contextlib.suppress(Exception):
            experiment_id(mlflow_client(s.storage.data_root), s.storage.data_root)
            if s.gate.enabled and s.gate.engine_url:
                eval_adapter(s, eval_engine(s))

    if config_path not in _warming:
        _warming[config_path] = thread = threading.Thread(target=work, name="train-warm-up", daemon=True)
        thread.start()


def _warmed(config_path: str | None) -> None:
    """Wait for :func:`warm_up`: MLflow imported from two threads at once fails on its circular imports
    ("partially initialized module 'mlflow'"), and a second opening would load the same things twice."""
    if (thread := _warming.get(config_path)) is not None:
        thread.join()


@task(cache_policy=NO_CACHE)
def claim_batch(config_path: str | None) -> str | None:
    """The batch to train next: an unfinished claimed batch, else a new one of the oldest fresh samples."""
    s = load_flow_settings(config_path)
    batch_id, note = trainer_service.claim_batch(
        data_store(s), s.storage.data_root, judge_config_hash=build_judge_config_hash(s),
        batch_size=s.ppo.rollout_batch_size, max_staleness=s.ppo.max_staleness,
        method=s.ppo.advantage_estimator.value, config_hash=config_hash(s), config_toml=dump_toml(s),
        sample_source=load_hook("sample_source", s.hooks.sample_source))
    get_run_logger().info(note)
    return batch_id


@task(cache_policy=NO_CACHE)
def run_step(config_path: str | None, batch_id: str, trainer_url: str | None) -> dict[str, Any]:
    return train_step(load_flow_settings(config_path), batch_id, trainer_url)


@task(cache_policy=NO_CACHE)
def start_lineage(config_path: str | None, step: dict[str, Any]) -> str:
    """The step's MLflow run, tagged with its lineage and this flow run (idempotent by batch id)."""
    _warmed(config_path)
    s = load_flow_settings(config_path)
    tags = {"judge_config_hash": build_judge_config_hash(s), "method": s.ppo.advantage_estimator.value,
            **prefect_tags()}
    return start_step_run(s.storage.data_root, step=step, tags=tags)


@task(cache_policy=NO_CACHE)
def log_lineage(config_path: str | None, step: dict[str, Any], run_id: str, gate: dict[str, Any]) -> list[str]:
    """After the sync: the step's run completed (metrics, params, batch manifest) and its checkpoint
    registered as a model version, the ``candidate`` / ``champion`` aliases as the gate decided, and the
    same completion for any earlier recorded version whose train run stopped before it. Returns the
    weight versions whose lineage it completed."""
    from clawrl.checkpoint import read_step_result
    from clawrl.lineage import runs_without_model_version, set_policy_alias
    from clawrl.storage.queries import recorded_checkpoints

    s = load_flow_settings(config_path)
    root = s.storage.data_root
    data_store(s).flush()
    with open_catalog(root) as con:
        rows = [r for r in recorded_checkpoints(con) if r["mlflow_run_id"] and r["mlflow_run_id"] != run_id]
        unfinished = set(runs_without_model_version(root, [r["mlflow_run_id"] for r in rows]))
        todo = [({**asdict(read_step_result(Path(r["path"]))), "path": r["path"]}, r["mlflow_run_id"])
                for r in rows if r["mlflow_run_id"] in unfinished and Path(r["path"], "trainer.json").is_file()]
        todo.append((step, run_id))
        manifests = [batch_manifest(con, st["batch_id"]) for st, _ in todo]
    hp = PPOHyperParams.from_settings(s.ppo, s.model.seed)
    params = {**asdict(hp), "method": hp.advantage_estimator.value, "config_hash": config_hash(s),
              "batch_size": s.ppo.rollout_batch_size, "max_staleness": s.ppo.max_staleness, "backend": s.ppo.backend,
              "model": s.model.name, **hook_params(s.hooks)}
    tags = {"judge_config_hash": build_judge_config_hash(s), "method": hp.advantage_estimator.value}
    for (st, rid), manifest in zip(todo, manifests):
        log_train_step(root, step=st, params=params, manifest=manifest, tags=tags, run_id=rid)
    set_policy_alias(root, "candidate", step["weight_version"])
    set_policy_alias(root, "champion", gate["serve_version"])
    if len(todo) > 1:
        get_run_logger().info("completed the lineage of versions %s, left unfinished by a stopped train run",
                              ", ".join(st["weight_version"] for st, _ in todo[:-1]))
    return [st["weight_version"] for st, _ in todo]


@task(cache_policy=NO_CACHE)
def link_step(config_path: str | None, step: dict[str, Any], run_id: str, gate: dict[str, Any]) -> dict[str, str]:
    """From Prefect to MLflow: a markdown artifact on this flow run with the step's MLflow run and
    model version and the gate's decision, and the flow run named for the version it made (``train-v16``) where
    it was named otherwise when it began.
    `clawrl up` points the links at the MLflow UI it starts (``relink_artifacts``)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    s = load_flow_settings(config_path)
    links = ui_links(s.storage.data_root, run_id, mlflow_ui_url())
    version = step["weight_version"]
    create_markdown_artifact(
        key=f"train-v{version}", description=f"MLflow run and model version of weight version {version}",
        markdown=(f"## Weight version {version} (from {step['parent_version']}, batch `{step['batch_id']}`)\n\n"
                  f"- {gate_line(gate)}\n"
                  f"- [MLflow run]({links['mlflow_run']}) `{run_id}`\n"
                  + (f"- [model version]({links['model_version']}) of `clawrl-policy`\n" if "model_version" in links
                     else "")
                  + f"- checkpoint `{step['path']}`\n"))
    if flow_run.id and flow_run.name != f"train-v{version}":  # named otherwise when it began (_train_run_name)
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=f"train-v{version}")
    return links


_MLFLOW_LINK = re.compile(r"\]\([^)\s]*?/#/((?:experiments|models)/[^)\s?]*)[^)\s]*\)")  # ](base/#/page?query)


def relink_artifacts(mlflow_ui_url: str) -> int:
    """Point the MLflow links of every ``train-v*`` artifact at the MLflow UI at ``mlflow_ui_url`` (what
    `clawrl up` starts: the data brought up again on other ports links the UI that runs now), each page in
    the UI's model-training view. Returns the artifacts changed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    changed, offset, page = 0, 0, 200  # Prefect's largest page
    with get_client(sync_client=True) as client:
        while True:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="train-v%")),
                                          limit=page, offset=offset)
            for a in found:
                text = _MLFLOW_LINK.sub(lambda m: f"]({ui_page(mlflow_ui_url, m.group(1))})", a.data or "")
                if isinstance(a.data, str) and text != a.data:
                    client.update_artifact(a.id, ArtifactUpdate(data=text))
                    changed += 1
            if len(found) < page:
                return changed
            offset += page


def gate_line(gate: dict[str, Any]) -> str:
    """The promotion gate's decision on a version, as its Prefect artifact says it."""
    if gate["decision"] == "promote":
        return f"promoted: serves as the champion (before: version {gate['champion_version']}); {gate['reason']}"
    return f"**refused** by the promotion gate: version {gate['serve_version']} keeps serving; {gate['reason']}"


@task(cache_policy=NO_CACHE)
def record_checkpoint(config_path: str | None, step: dict[str, Any], run_id: str) -> bool:
    s = load_flow_settings(config_path)
    return trainer_service.record_checkpoint(data_store(s), s.storage.data_root, step, run_id)


@task(cache_policy=NO_CACHE)
def gate_checkpoint(config_path: str | None, step: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The promotion gate on the step's checkpoint: the decision, its evidence, and ``serve`` (the
    checkpoint to serve now: weight_version, path, sha256, mlflow_run_id)."""
    _warmed(config_path)
    s = load_flow_settings(config_path)
    out = gate_version(s, step, run_id)
    return {**out, "serve": serve_target(s, out["serve_version"])}


@task(cache_policy=NO_CACHE)
def sync_weights(config_path: str | None, step: dict[str, Any], engine_url: str | None) -> dict[str, Any]:
    """Serve ``step``'s checkpoint (weight_version, path, sha256, mlflow_run_id)."""
    synced = push_weights(load_flow_settings(config_path), step, engine_url)
    if synced["message"] == NO_ENGINE:
        get_run_logger().warning("checkpoint %s is waiting: %s; serve it with `clawrl sync %s --engine-url URL`",
                                 step["weight_version"], NO_ENGINE, step["weight_version"])
    elif not synced["success"]:
        get_run_logger().error("weight sync to version %s failed, still serving %s: %s",
                               step["weight_version"], synced["weight_version"], synced["message"])
    return synced


@task(cache_policy=NO_CACHE)
def sync_canary(config_path: str | None, step: dict[str, Any]) -> dict[str, Any]:
    """With ``[gate] canary_share``, load the step's version into the canary engine whatever the gate
    decided, so canary sessions get the newest trained version."""
    s = load_flow_settings(config_path)
    out = push_canary(s, serve_target(s, step["weight_version"]))
    if out["success"]:
        get_run_logger().info("canary engine serves version %s to %.0f%% of sessions", out["weight_version"],
                              100 * s.gate.canary_share)
    else:  # its sessions get the champion meanwhile (clawrl.engine.canary)
        get_run_logger().error("canary engine: loading version %s failed (%s); its sessions get the champion",
                               out["version"], out["message"])
    return out


@task(cache_policy=NO_CACHE)
def log_doctor_report(config_path: str | None, step: dict[str, Any], run_id: str) -> int:
    """``clawrl doctor`` after the step, on the step's MLflow run (the problems found; never fails the step)."""
    s = load_flow_settings(config_path)
    chash = build_judge_config_hash(s)
    try:
        with open_catalog(s.storage.data_root) as con:
            found = report(con, chash, method=s.ppo.advantage_estimator.value,
                           checkpoints=s.storage.data_root / "checkpoints", **settings_checks(s))
        versions = found["learning_by_version"]
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_learning_by_version(versions, Path(tmp) / "learning_by_version.png") if versions else None
            log_doctor(s.storage.data_root, run_id, step=int(step["step"]), report=found, png=png)
    except Exception as e:  # a report, not part of training: say so and go on
        get_run_logger().warning("clawrl doctor after step %s failed: %s: %s", step["step"], type(e).__name__, e)
        return -1
    problems = [f for f in found["findings"] if not f["ok"]]
    for f in problems:
        get_run_logger().warning("doctor: %s: %s; cause: %s; fix: %s", f["name"], f["summary"], f["cause"], f["fix"])
    return len(problems)


def ensure_trainer_limit() -> None:
    """The global concurrency limit `trainer` (1 slot), created if this Prefect server lacks it."""
    ensure_limit(TRAINER_LIMIT)


def _train_run_name() -> str:
    """A train run is named when it begins for what it will do, so every log line carries that name from
    "Beginning flow run" on: ``train-v<N>`` for the version its first step makes when a batch waits, else
    ``train-idle-<time>``. A run that does otherwise after all (its batch's samples too stale, more steps)
    is renamed by ``link_step`` or ``mark_idle``; with a ``[hooks] sample_source``, whose samples are not
    known before the claim, it is ``train-<time>`` until then."""
    from prefect.runtime import flow_run

    from clawrl.storage.queries import waiting_step

    try:
        s = load_flow_settings(flow_run.parameters.get("config_path"))
        if s.hooks.sample_source:
            return run_time_name("train")
        data_store(s).flush()  # the samples this process's judge run just wrote
        with open_catalog(s.storage.data_root) as con:
            step = waiting_step(con, build_judge_config_hash(s), s.ppo.rollout_batch_size)
    except Exception:  # noqa: BLE001 - a name; the run itself says what is wrong with its config or data
        return run_time_name("train")
    return run_time_name("train-idle") if step is None else f"train-v{step}"


@flow(name="train", flow_run_name=_train_run_name, log_prints=True)
def train_flow(config_path: str | None = None, max_steps: int = 1, trainer_url: str | None = None,
               engine_url: str | None = None, exclusive: bool = False, namespace: str | None = None) -> dict[str, Any]:
    """Train up to ``max_steps`` PPO steps, one per full batch of waiting samples. Each step holds the
    `trainer` slot, waiting for it; with ``exclusive`` (the deployment's triggered and scheduled runs)
    the run takes it for all its steps at once or not at all: a run that finds another training ends
    Completed at once, returning ``skipped``. With ``[ppo] adapters = "namespace"`` each namespace's adapter
    instead (only ``namespace``'s when given), up to ``max_steps`` each, on its own slot (flows/adapters.py)."""
    if load_flow_settings(config_path).ppo.adapters == "namespace":
        return train_adapters(config_path, namespace, max_steps, trainer_url, engine_url, exclusive)
    ensure_trainer_limit()
    if not exclusive:
        # a killed run stops renewing its lease: its slot frees itself after lease_duration
        return _train_steps(config_path, max_steps, trainer_url, engine_url,
                            lambda: concurrency(TRAINER_LIMIT, occupy=1, strict=True, lease_duration=60))
    with leased_slot(TRAINER_LIMIT) as held:
        if held:
            return _train_steps(config_path, max_steps, trainer_url, engine_url, contextlib.nullcontext)
    skipped = skipped_because("train", TRAINER_LIMIT)
    get_run_logger().info("skipped: %s", skipped)
    mark_idle()
    return {"steps": [], "skipped": skipped}


def _train_steps(config_path: str | None, max_steps: int, trainer_url: str | None, engine_url: str | None,
                 slot) -> dict[str, Any]:
    log = get_run_logger()
    with_canary = load_flow_settings(config_path).gate.canary
    steps: list[dict[str, Any]] = []
    for _ in range(max_steps):
        with slot():
            batch_id = claim_batch(config_path)
            if batch_id is None:
                break
            _crash_point("claimed")
            warm_up(config_path)
            step = run_step(config_path, batch_id, trainer_url)
            _crash_point("trained")
            run_id = start_lineage(config_path, step)
            _crash_point("logged")
            record_checkpoint(config_path, step, run_id)
            _crash_point("recorded")
            gate = gate_checkpoint(config_path, step, run_id)
            _crash_point("gated")
            synced = sync_weights(config_path, gate["serve"], engine_url)
            _crash_point("synced")
            canary = sync_canary(config_path, step) if with_canary else None
            # after the sync: nothing on the path to serving the new version waits for these
            if log_lineage(config_path, step, run_id, gate, return_state=True).is_failed():
                log.warning("the MLflow lineage of version %s is not complete; the next train run completes it",
                            step["weight_version"])
            link_step(config_path, step, run_id, gate)
            log_doctor_report(config_path, step, run_id)
        m = step["metrics"]
        log.info("step %d (batch %s): loss %.4f, reward %.3f, kl %.5f -> version %s, %s; serving %s (sync: %s)",
                 step["step"], batch_id, m.get("loss", float("nan")), m.get("reward_mean", float("nan")),
                 m.get("kl", 0.0), step["weight_version"], "promoted" if gate["decision"] == "promote" else "refused",
                 gate["serve_version"], "ok" if synced["success"] else synced["message"])
        steps.append({**step, "mlflow_run_id": run_id, "gate": gate, "sync": synced, "canary": canary})
    if not steps:  # no full batch: not a step
        mark_idle()
    return {"steps": steps}
