"""The train flow with ``[ppo] adapters = "namespace"``: each namespace's LoRA adapter trained on its own full
batches and synced into the serving engine as an adapter; and forgetting a namespace.

Per namespace, exactly once with a crash allowed between any two tasks, as the shared flow (flows/train.py):

1. ``claim_adapter_batch`` writes the namespace's batch (its own samples only) before training, or resumes
   its unfinished one.
2. ``run_step`` asks the trainer to train it: the NamespaceTrainer loads that namespace's adapter and
   optimizer state, steps, and writes the new version (idempotent per batch id).
3. ``record_adapter`` appends the ``adapters`` row once per name.
4. ``sync_adapter`` loads the new version into every serving worker beside the old one (nothing pauses),
   switches the namespace to it (``serving.json``, which the gateway reads) and unloads the old one; each
   attempt is an ``adapter_serving`` row. With no engine running, the namespace is switched anyway: the
   gateway that starts next loads it on the namespace's first request.

The promotion gate does not evaluate adapters yet: every version serves once trained. MLflow lineage per
namespace is not written yet either.

"One step at a time" holds per namespace: the global concurrency limit ``trainer-<namespace>`` (1 slot), so
steps of different namespaces run at once, on the work pool's workers too (one run per namespace,
:func:`start_train_runs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from clawrl import runtime, trainer_service
from clawrl.adapters import ServedAdapter, parse_adapter_name, read_served, remove_adapters, write_served
from clawrl.config import Settings, config_hash, dump_toml, read_admin_key
from clawrl.flows.common import data_store, engine_url_for, load_flow_settings, policy_engine, train_step
from clawrl.flows.slots import (TRAIN_DEPLOYMENT, ensure_limit, leased_slot, mark_idle, tick, tick_namespaces,
                                trainer_limit)
from clawrl.judge.runner import build_judge_config_hash
from clawrl.records import AdapterServeRecord
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


@task(cache_policy=NO_CACHE)
def record_adapter(config_path: str | None, step: dict[str, Any]) -> bool:
    s = load_flow_settings(config_path)
    return trainer_service.record_adapter(data_store(s), s.storage.data_root, step, BASE_VERSION)


def _targets(s: Settings, engine_url: str | None) -> dict[str, Any]:
    """Where adapters load: this process's engine, else ``engine_url`` or the one ``engine_url_for`` finds."""
    engine = None if engine_url else policy_engine()
    return {"engine": engine, "url": engine_url_for(s, engine_url) if engine is None else None,
            "admin_key": read_admin_key(s.server.admin_keys_env), "timeout_s": s.engine.stall_timeout_s}


def push_adapter(s: Settings, step: dict[str, Any], engine_url: str | None) -> dict[str, Any]:
    """Serve the adapter version ``step`` made (its name, path, sha256) to its namespace: loaded into every
    serving worker, the namespace switched to it, the previous version unloaded; the attempt recorded."""
    name, checkpoints = step["weight_version"], s.storage.data_root / "checkpoints"
    namespace, version = parse_adapter_name(name)
    previous = read_served(checkpoints, namespace)
    if previous is not None and previous.name == name:
        return {"success": True, "skipped": True, "message": "already serving this version", "adapter": name,
                "target": None, "seconds": 0.0}
    where = _targets(s, engine_url)
    rep = runtime.run(sync_adapter(name, step["path"], step["sha256"], **where))
    switched = rep.success or rep.message == NO_ENGINE  # none running: the next gateway loads it on first use
    if switched:
        write_served(checkpoints, ServedAdapter(namespace, name, version, step["path"], step["sha256"]))
        if previous is not None and rep.success:
            runtime.run(unload_adapter(previous.name, **where))
    _record(s, namespace, "sync", name, previous, rep, ok=switched)
    return {"success": rep.success, "skipped": rep.skipped, "message": rep.message, "adapter": name,
            "target": rep.target, "seconds": rep.seconds}


def _record(s: Settings, namespace: str, action: str, adapter: str | None, previous: ServedAdapter | None,
            rep: SyncReport, reason: str = "", ok: bool | None = None) -> None:
    store = data_store(s)
    store.append(AdapterServeRecord(namespace=namespace, action=action, adapter=adapter,
                                    previous=previous.name if previous else None,
                                    ok=rep.success if ok is None else ok, error=None if rep.success else rep.message,
                                    target=rep.target, seconds=float(rep.seconds), reason=reason))
    store.flush()


@task(cache_policy=NO_CACHE)
def sync_adapter_task(config_path: str | None, step: dict[str, Any], engine_url: str | None) -> dict[str, Any]:
    synced = push_adapter(load_flow_settings(config_path), step, engine_url)
    if synced["message"] == NO_ENGINE:
        get_run_logger().warning("adapter %s serves once a gateway starts: %s", step["weight_version"], NO_ENGINE)
    elif not synced["success"]:
        get_run_logger().error("adapter %s not served (its namespace keeps its previous one): %s",
                               step["weight_version"], synced["message"])
    return synced


def forget_namespace(s: Settings, namespace: str, reason: str, engine_url: str | None = None) -> dict[str, Any]:
    """Forget ``namespace``'s learning: every version of its adapter deleted (what it is served first, so
    the gateway serves it the base from its next request), the served one unloaded from the engine, and
    none of its samples from before now ever trained again (an ``adapter_serving`` row, action ``forget``).
    The base never saw its data. Returns the versions removed and whether the engine unloaded its adapter."""
    checkpoints = s.storage.data_root / "checkpoints"
    served = read_served(checkpoints, namespace)
    removed = remove_adapters(checkpoints, namespace)
    rep = SyncReport(True, "no adapter was served", None, 0.0)
    if served is not None:
        rep = runtime.run(unload_adapter(served.name, **_targets(s, engine_url)))
    _record(s, namespace, "forget", None, served, rep, reason=reason, ok=True)
    return {"namespace": namespace, "removed": removed, "unloaded": served.name if served and rep.success else None,
            "message": rep.message}


def train_adapters(config_path: str | None, namespace: str | None, max_steps: int, trainer_url: str | None,
                   engine_url: str | None, exclusive: bool) -> dict[str, Any]:
    """Up to ``max_steps`` steps of each namespace with a batch waiting (only ``namespace`` when given), each
    holding that namespace's ``trainer-<namespace>`` slot: waiting for it, or with ``exclusive`` skipping a
    namespace whose slot another run holds."""
    log = get_run_logger()
    if load_flow_settings(config_path).gate.enabled:
        log.info("the promotion gate does not evaluate adapters yet: each adapter version serves once trained")
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
            record_adapter(config_path, step)
            synced = sync_adapter_task(config_path, step, engine_url)
        m = step["metrics"]
        log.info("%s (batch %s): loss %.4f, reward %.3f, kl %.5f; sync: %s", step["weight_version"], batch_id,
                 m.get("loss", float("nan")), m.get("reward_mean", float("nan")), m.get("kl", 0.0),
                 "ok" if synced["success"] else synced["message"])
        steps.append({**step, "namespace": namespace, "sync": synced})
    return steps
