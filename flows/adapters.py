"""The train flow with ``[ppo] adapters = "namespace"``: each namespace's LoRA adapter trained on its own full
batches, gated against that namespace's champion, and served to it as an adapter; and forgetting a namespace.

Per namespace, exactly once with a crash allowed between any two tasks, as the shared flow (flows/train.py):

1. ``claim_adapter_batch`` writes the namespace's batch (its own samples only) before training, or resumes
   its unfinished one.
2. ``run_adapter_step`` asks the trainer to train it: the NamespaceTrainer loads that namespace's adapter and
   optimizer state, steps, and writes the new version (idempotent per batch id).
3. ``start_adapter_lineage`` makes the step's MLflow run in the namespace's own experiment
   (``clawrl-<namespace>``), idempotent by batch id; ``record_adapter`` appends the ``adapters`` row once per
   name.
4. ``gate_adapter``: the new version is a candidate against the namespace's champion (its newest promoted
   version, or the base alone), both served by the evaluation engine as two adapters over the initial
   weights, on the ``[gate]`` validation set or on the namespace's own replayed turns
   (``clawrl.promotion.gate_candidate``); a ``promotions`` row of that namespace. ``[gate] enabled = false``
   promotes it unevaluated.
5. ``sync_adapter_task`` serves the namespace its champion: the candidate when promoted (loaded into every
   serving worker beside the old one, the namespace switched to it - ``serving.json``, which the gateway
   reads - and the old one unloaded; nothing pauses), else nothing changes. A refused version stays on
   disk, never served. Each change is an ``adapter_serving`` row. With no engine running, the namespace is
   switched anyway: the gateway that starts next loads it on the namespace's first request.
6. ``log_adapter_lineage`` completes the MLflow run (metrics, params, the batch manifest: that namespace's
   samples only) and registers the version in the namespace's model ``clawrl-adapter-<namespace>``, with
   the ``candidate`` / ``champion`` aliases as the gate decided.

"One step at a time" holds per namespace: the global concurrency limit ``trainer-<namespace>`` (1 slot), so
steps of different namespaces run at once, on the work pool's workers too (one run per namespace,
:func:`start_train_runs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from clawrl import runtime, trainer_service
from clawrl.adapters import ServedAdapter, read_served, remove_adapters, serving_file, write_served
from clawrl.config import Settings, config_hash, dump_toml, read_admin_key
from clawrl.flows.common import (data_store, engine_url_for, gate_version, load_flow_settings, policy_engine,
                                 prefect_tags, train_step)
from clawrl.flows.slots import (TRAIN_DEPLOYMENT, ensure_limit, leased_slot, mark_idle, tick, tick_namespaces,
                                trainer_limit)
from clawrl.judge.runner import build_judge_config_hash
from clawrl.records import AdapterServeRecord, parse_adapter_name
from clawrl.storage.catalog import open_catalog
from clawrl.sync import NO_ENGINE, SyncReport, sync_adapter, unload_adapter

BASE_VERSION = "0"  # the adapters train over the initial weights: the frozen base


def waiting_namespaces(config_path: str | None) -> list[str]:
    """The namespaces a train run would find a batch for now (a full one, or one claimed and not trained)."""
    from clawrl.storage.adapters import full_batch_namespaces

    s = load_flow_settings(config_path)
    data_store(s).flush()
    with open_catalog(s.storage.data_root) as con:
        return full_batch_namespaces(con, build_judge_config_hash(s), s.ppo.rollout_batch_size)


def start_train_runs(config_path: str | None) -> list[str]:
    """Runs of the train deployment for the work waiting: one per namespace with a batch (``adapters =
    "namespace"``: they run at once), else one. The ids of the runs created."""
    if load_flow_settings(config_path).ppo.adapters == "namespace":
        return tick_namespaces(TRAIN_DEPLOYMENT, waiting_namespaces(config_path))
    return [run for run in [tick(TRAIN_DEPLOYMENT)] if run]


@task(cache_policy=NO_CACHE)
def claim_adapter_batch(config_path: str | None, namespace: str) -> str | None:
    s = load_flow_settings(config_path)
    batch_id, note = trainer_service.claim_adapter_batch(
        data_store(s), s.storage.data_root, namespace, judge_config_hash=build_judge_config_hash(s),
        batch_size=s.ppo.rollout_batch_size, max_staleness=s.ppo.max_staleness,
        method=s.ppo.advantage_estimator.value, config_hash=config_hash(s), config_toml=dump_toml(s))
    get_run_logger().info(note)
    return batch_id


@task(cache_policy=NO_CACHE)
def run_adapter_step(config_path: str | None, batch_id: str, trainer_url: str | None) -> dict[str, Any]:
    return train_step(load_flow_settings(config_path), batch_id, trainer_url)


def _lineage_tags(s: Settings, namespace: str) -> dict[str, str]:
    return {"namespace": namespace, "judge_config_hash": build_judge_config_hash(s),
            "method": s.ppo.advantage_estimator.value}


@task(cache_policy=NO_CACHE)
def start_adapter_lineage(config_path: str | None, step: dict[str, Any]) -> str:
    """The step's MLflow run in its namespace's experiment (idempotent by batch id)."""
    from clawrl.lineage import namespace_experiment, start_step_run

    s = load_flow_settings(config_path)
    namespace = parse_adapter_name(step["weight_version"])[0]
    return start_step_run(s.storage.data_root, step=step, tags={**_lineage_tags(s, namespace), **prefect_tags()},
                          experiment=namespace_experiment(namespace))


@task(cache_policy=NO_CACHE)
def record_adapter(config_path: str | None, step: dict[str, Any], run_id: str | None = None) -> bool:
    s = load_flow_settings(config_path)
    return trainer_service.record_adapter(data_store(s), s.storage.data_root, step, BASE_VERSION, run_id)


@task(cache_policy=NO_CACHE)
def gate_adapter(config_path: str | None, step: dict[str, Any], run_id: str | None) -> dict[str, Any]:
    """The promotion gate on the step's adapter version against its namespace's champion: the decision, its
    evidence, and ``serve`` (``clawrl.promotion.adapter_target``: what the namespace is served now)."""
    from clawrl.promotion import adapter_target

    s = load_flow_settings(config_path)
    out = gate_version(s, step, run_id, namespace=parse_adapter_name(step["weight_version"])[0])
    return {**out, "serve": adapter_target(s.storage.data_root, out["serve_version"])}


def _targets(s: Settings, engine_url: str | None) -> dict[str, Any]:
    """Where adapters load: this process's engine, else ``engine_url`` or the one ``engine_url_for`` finds."""
    engine = None if engine_url else policy_engine()
    return {"engine": engine, "url": engine_url_for(s, engine_url) if engine is None else None,
            "admin_key": read_admin_key(s.server.admin_keys_env), "timeout_s": s.engine.stall_timeout_s}


def push_adapter(s: Settings, target: dict[str, Any], engine_url: str | None, reason: str = "") -> dict[str, Any]:
    """Serve ``target`` (``clawrl.promotion.adapter_target``'s keys) to its namespace: an adapter version is
    loaded into every serving worker, the namespace switched to it and its previous version unloaded; the base alone
    (``<namespace>@v0``) switches the namespace off its adapter and unloads that. The change is recorded;
    nothing is loaded when the namespace is served ``target`` already."""
    name, namespace, checkpoints = target["weight_version"], target["namespace"], s.storage.data_root / "checkpoints"
    previous = read_served(checkpoints, namespace)
    if (previous.name if previous else f"{namespace}@v0") == name:
        return {"success": True, "skipped": True, "message": "already serving this version", "adapter": name,
                "target": None, "seconds": 0.0}
    where = _targets(s, engine_url)
    version = parse_adapter_name(name)[1]
    if version == 0:  # the base alone: nothing to load
        serving_file(checkpoints, namespace).unlink(missing_ok=True)
        rep = runtime.run(unload_adapter(previous.name, **where))
        rep = SyncReport(True, f"{namespace} is served the base alone", None, rep.seconds, target=rep.target)
        switched = True
    else:
        rep = runtime.run(sync_adapter(name, target["path"], target["sha256"], **where))
        switched = rep.success or rep.message == NO_ENGINE  # none running: the next gateway loads it on first use
        if switched:
            write_served(checkpoints, ServedAdapter(namespace, name, version, target["path"], target["sha256"]))
            if previous is not None and rep.success:
                runtime.run(unload_adapter(previous.name, **where))
    _record(s, namespace, "sync", name if version else None, previous, rep, reason=reason, ok=switched)
    return {"success": rep.success, "skipped": rep.skipped, "message": rep.message, "adapter": name,
            "target": rep.target, "seconds": rep.seconds}


def _record(s: Settings, namespace: str, action: str, adapter: str | None, previous: ServedAdapter | None,
            rep: SyncReport, reason: str = "", ok: bool | None = None, last_version: int | None = None) -> None:
    store = data_store(s)
    store.append(AdapterServeRecord(namespace=namespace, action=action, adapter=adapter,
                                    previous=previous.name if previous else None,
                                    ok=rep.success if ok is None else ok, error=None if rep.success else rep.message,
                                    target=rep.target, seconds=float(rep.seconds), reason=reason,
                                    last_version=last_version))
    store.flush()


@task(cache_policy=NO_CACHE)
def sync_adapter_task(config_path: str | None, target: dict[str, Any], engine_url: str | None) -> dict[str, Any]:
    synced = push_adapter(load_flow_settings(config_path), target, engine_url)
    if synced["message"] == NO_ENGINE:
        get_run_logger().warning("adapter %s serves once a gateway starts: %s", target["weight_version"], NO_ENGINE)
    elif not synced["success"]:
        get_run_logger().error("adapter %s not served (its namespace keeps its previous one): %s",
                               target["weight_version"], synced["message"])
    return synced


@task(cache_policy=NO_CACHE)
def log_adapter_lineage(config_path: str | None, step: dict[str, Any], run_id: str, gate: dict[str, Any]) -> None:
    """After the sync: the step's run completed with that namespace's batch manifest, the version registered
    in the namespace's model, its ``candidate`` and ``champion`` aliases as the gate decided."""
    from clawrl.lineage import log_train_step, namespace_experiment, namespace_model, set_policy_alias
    from clawrl.storage.queries import batch_manifest
    from clawrl.train.base import PPOHyperParams

    s = load_flow_settings(config_path)
    root, namespace = s.storage.data_root, parse_adapter_name(step["weight_version"])[0]
    data_store(s).flush()
    with open_catalog(root) as con:
        manifest = batch_manifest(con, step["batch_id"])
    hp = PPOHyperParams.from_settings(s.ppo, s.model.seed)
    params = {**asdict(hp), "method": hp.advantage_estimator.value, "config_hash": config_hash(s),
              "batch_size": s.ppo.rollout_batch_size, "adapter_rank": s.ppo.adapter_rank, "model": s.model.name}
    model = namespace_model(namespace)
    log_train_step(root, step=step, params=params, manifest=manifest, tags=_lineage_tags(s, namespace), run_id=run_id,
                   experiment=namespace_experiment(namespace), model=model)
    set_policy_alias(root, "candidate", step["weight_version"], model)
    set_policy_alias(root, "champion", gate["serve_version"], model)


def forget_namespace(s: Settings, namespace: str, reason: str, engine_url: str | None = None) -> dict[str, Any]:
    """Forget ``namespace``: every version of its adapter deleted (what it is served first, so the gateway
    serves it the base from its next request), the served one unloaded from the engine, its rows rewritten
    out of every table (``clawrl.storage.forget``), its MLflow experiment and model deleted for good, its
    replays removed; an ``adapter_serving`` row (action ``forget``) says when and why. The base never saw
    its data. Returns what was removed."""
    from clawrl.lineage import forget_namespace_lineage
    from clawrl.storage.adapters import latest_adapter_version
    from clawrl.storage.forget import forget_rows

    checkpoints = s.storage.data_root / "checkpoints"
    data_store(s).flush()
    with open_catalog(s.storage.data_root) as con:
        last = latest_adapter_version(con, namespace)  # before its rows go: its next version is numbered after
    served = read_served(checkpoints, namespace)
    removed = remove_adapters(checkpoints, namespace)
    rep = SyncReport(True, "no adapter was served", None, 0.0)
    if served is not None:
        rep = runtime.run(unload_adapter(served.name, **_targets(s, engine_url)))
    # recorded before the rows are rewritten (which keep it): a forget cut short is finished by running it again
    _record(s, namespace, "forget", None, served, rep, reason=reason, ok=True, last_version=last)
    rows = forget_rows(s.storage.data_root, namespace)
    runs = forget_namespace_lineage(s.storage.data_root, namespace)
    return {"namespace": namespace, "removed": removed, "unloaded": served.name if served and rep.success else None,
            "message": rep.message, "rows": rows, "mlflow_runs": runs}


def train_adapters(config_path: str | None, namespace: str | None, max_steps: int, trainer_url: str | None,
                   engine_url: str | None, exclusive: bool) -> dict[str, Any]:
    """Up to ``max_steps`` steps of each namespace with a batch waiting (only ``namespace`` when given), each
    holding that namespace's ``trainer-<namespace>`` slot: waiting for it, or with ``exclusive`` skipping a
    namespace whose slot another run holds."""
    log = get_run_logger()
    steps: list[dict[str, Any]] = []
    skipped: list[str] = []
    for ns in [namespace] if namespace else waiting_namespaces(config_path):
        limit = trainer_limit(ns)
        ensure_limit(limit)
        if not exclusive:  # a killed run stops renewing its lease: the slot frees itself after lease_duration
            steps += _adapter_steps(config_path, ns, max_steps, trainer_url, engine_url,
                                    lambda: concurrency(limit, occupy=1, strict=True, lease_duration=60))
            continue
        with leased_slot(limit) as held:
            if held:
                steps += _adapter_steps(config_path, ns, max_steps, trainer_url, engine_url, contextlib.nullcontext)
            else:
                skipped.append(ns)
    if skipped:
        log.info("skipped namespaces another run trains now: %s", ", ".join(skipped))
    if not steps:
        mark_idle()
    return {"steps": steps, **({"skipped": f"other runs train {', '.join(skipped)}"} if skipped else {})}


def _adapter_steps(config_path: str | None, namespace: str, max_steps: int, trainer_url: str | None,
                   engine_url: str | None, slot: Callable[[], Any]) -> list[dict[str, Any]]:
    log, steps = get_run_logger(), []
    for _ in range(max_steps):
        with slot():
            batch_id = claim_adapter_batch(config_path, namespace)
            if batch_id is None:
                break
            step = run_adapter_step(config_path, batch_id, trainer_url)
            run_id = start_adapter_lineage(config_path, step)
            record_adapter(config_path, step, run_id)
            gate = gate_adapter(config_path, step, run_id)
            synced = sync_adapter_task(config_path, gate["serve"], engine_url)
            if log_adapter_lineage(config_path, step, run_id, gate, return_state=True).is_failed():
                log.warning("the MLflow lineage of %s is not complete", step["weight_version"])
        m = step["metrics"]
        log.info("%s (batch %s): loss %.4f, reward %.3f, kl %.5f; %s, serving %s (sync: %s)", step["weight_version"],
                 batch_id, m.get("loss", float("nan")), m.get("reward_mean", float("nan")), m.get("kl", 0.0),
                 "promoted" if gate["decision"] == "promote" else "refused", gate["serve_version"],
                 "ok" if synced["success"] else synced["message"])
        steps.append({**step, "namespace": namespace, "mlflow_run_id": run_id, "gate": gate, "sync": synced})
    return steps
