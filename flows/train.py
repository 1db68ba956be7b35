"""Prefect flow `train`: a full batch of judged samples -> one PPO step -> checkpoint -> lineage -> sync.

Thin orchestration over clawrl.train, clawrl.lineage, clawrl.sync and storage/. Exactly once, with a
crash allowed between any two tasks:

1. ``claim_batch`` writes a ``batches`` row (the samples it consumes) before training. A re-run
   first resumes a claimed batch that has no checkpoint yet, so no sample is lost or taken twice.
2. ``run_step`` asks the long-lived trainer to train on the batch; the trainer is idempotent per
   batch id (it returns the stored result for a batch it already applied).
3. ``log_lineage`` creates the MLflow run and model version, idempotent by batch id.
4. ``record_checkpoint`` appends the ``checkpoints`` row once per weight version.
5. ``sync_weights`` pushes the version to the serving engine; an engine already on it is skipped.
   Every attempt is a ``syncs`` row and a point on the step's MLflow run; a failed one (corrupt
   checkpoint, engine refusing or dying mid-update) leaves the previous version serving, and the
   next step's sync, or ``clawrl sync``, pushes the newest checkpoint again.

"One training step at a time" is Prefect's global concurrency limit ``trainer`` (limit 1), not a
lock in code. The trainer is the one in this process (``clawrl train``, ``clawrl demo``) or a
trainer service at ``trainer_url`` (``clawrl up``).
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from clawrl import runtime
from clawrl.config import Settings, config_hash, dump_toml
from clawrl.hooks import hook_params, load_hook
from clawrl.judge.runner import build_judge_config_hash
from clawrl.lineage import log_train_step
from clawrl.records import BatchRecord, CheckpointRecord, Fate, FateRecord
from clawrl.storage.selection import select_batch
from clawrl.train.trainer import samples_from_rows
from clawrl.flows.common import (data_store, load_flow_settings, local_trainer, policy_engine, record_sync,
                                 trainer_in_process)
from clawrl.train.service import request_step
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import (
    batch_manifest,
    batch_samples,
    checkpoint_exists,
    custom_samples,
    latest_version,
    open_batch,
    trainable_samples,
    write_config_snapshot,
)

TRAINER_LIMIT = "trainer"


def _crash_point(name: str) -> None:
    """No-op; the crash tests replace it to kill the process between two tasks."""


def _catalog(s: Settings):
    data_store(s).flush()  # what this process wrote is visible to the query
    return open_catalog(s.storage.data_root)


@task(cache_policy=NO_CACHE)
def claim_batch(config_path: str | None) -> str | None:
    """The batch to train next: an unfinished claimed batch, else a new one of the oldest fresh samples."""
    s = load_flow_settings(config_path)
    log = get_run_logger()
    chash = build_judge_config_hash(s)
    with _catalog(s) as con:
        pending = open_batch(con)
        if pending is not None:
            log.info("resuming batch %s (claimed, not yet checkpointed)", pending["batch_id"])
            return pending["batch_id"]
        current = latest_version(con)
        source = load_hook("sample_source", s.hooks.sample_source)
        if source is None:
            rows = trainable_samples(con, chash).to_pylist()
        else:  # custom samples are stored first, so batches and lineage reach them like any other
            rows = custom_samples(con, source(data_root=s.storage.data_root, judge_config_hash=chash,
                                              limit=s.ppo.rollout_batch_size), data_store(s))
    chosen, stale = select_batch(rows, current_version=current, batch_size=s.ppo.rollout_batch_size,
                                 max_staleness=s.ppo.max_staleness)
    store = data_store(s)
    if stale:
        store.append([FateRecord(r["turn_id"], r["session_id"], chash, Fate.TOO_STALE.value,
                                 f"sampled by version {r['weight_version']}, policy is at {current} "
                                 f"(max_staleness {s.ppo.max_staleness})") for r in stale])
        log.info("%d samples too stale for version %d", len(stale), current)
    if chosen is None:
        log.info("%d fresh samples wait; rollout_batch_size is %d", len(rows) - len(stale), s.ppo.rollout_batch_size)
        return None
    write_config_snapshot(s.storage.data_root, config_hash(s), dump_toml(s))  # replay re-reads it by hash
    batch = BatchRecord(batch_id=uuid.uuid4().hex[:16], step=current + 1, sample_ids=[r["sample_id"] for r in chosen],
                        session_ids=sorted({r["session_id"] for r in chosen}), method=s.ppo.advantage_estimator.value,
                        config_hash=config_hash(s), parent_version=str(current))
    store.append(batch)
    store.flush()
    return batch.batch_id


@task(cache_policy=NO_CACHE)
def run_step(config_path: str | None, batch_id: str, trainer_url: str | None) -> dict[str, Any]:
    s = load_flow_settings(config_path)
    if trainer_url:
        return request_step(trainer_url, batch_id)
    with _catalog(s) as con:
        rows = batch_samples(con, batch_id).to_pylist()
    return asdict(local_trainer(s).run(batch_id, samples_from_rows(rows)))


@task(cache_policy=NO_CACHE)
def log_lineage(config_path: str | None, step: dict[str, Any]) -> str:
    s = load_flow_settings(config_path)
    with _catalog(s) as con:
        manifest = batch_manifest(con, step["batch_id"])
    ppo = s.ppo
    params = {"config_hash": config_hash(s), "method": ppo.advantage_estimator.value, "lr": ppo.lr,
              "clip_range": ppo.clip_range, "clip_range_high": ppo.clip_range_high, "kl_coef": ppo.kl_coef,
              "kl_type": ppo.kl_type, "entropy_coef": ppo.entropy_coef, "batch_size": ppo.rollout_batch_size,
              "seed": s.model.seed, "backend": ppo.backend, "model": s.model.name, "w_rl": ppo.w_rl,
              "w_opd": ppo.w_opd, "tis_cap": ppo.tis_cap, "max_staleness": ppo.max_staleness,
              **hook_params(s.hooks)}
    tags = {"judge_config_hash": build_judge_config_hash(s), "method": ppo.advantage_estimator.value}
    return log_train_step(s.storage.data_root, step=step, params=params, manifest=manifest, tags=tags)


@task(cache_policy=NO_CACHE)
def record_checkpoint(config_path: str | None, step: dict[str, Any], run_id: str) -> bool:
    s = load_flow_settings(config_path)
    with _catalog(s) as con:
        exists = checkpoint_exists(con, step["weight_version"])
    if not exists:
        data_store(s).append(CheckpointRecord(
            weight_version=step["weight_version"], step=step["step"], batch_id=step["batch_id"],
            parent_version=step["parent_version"], path=step["path"], sha256=step["sha256"], mlflow_run_id=run_id))
        data_store(s).flush()
    return not exists


@task(cache_policy=NO_CACHE)
def sync_weights(config_path: str | None, step: dict[str, Any], engine_url: str | None,
                 run_id: str | None = None) -> dict[str, Any]:
    from clawrl.records import utcnow
    from clawrl.sync import sync_from_disk, sync_state_dict

    s = load_flow_settings(config_path)
    started_at = utcnow()
    local_engine = policy_engine()
    if engine_url is None and local_engine is not None:
        trainer = trainer_in_process(s)
        target, path = "in-process", None
        if trainer is not None and trainer.weight_version == step["weight_version"]:
            rep = runtime.run(sync_state_dict(local_engine, trainer.state_dict(), step["weight_version"]))
        else:  # the trainer moved on or lives elsewhere: load the checkpoint from disk
            path = step["path"]
            rep = runtime.run(sync_from_disk(local_engine, path, step["weight_version"],
                                             expected_sha256=step["sha256"]))
    else:
        url = engine_url or (s.engine.url if s.engine.kind == "http" else None)
        if url is None:
            return {"success": False, "skipped": True, "message": "no serving engine to sync (in-process "
                    "engine not running here and engine.kind is not 'http')", "weight_version": None}
        from clawrl.config import read_admin_key
        from clawrl.engine.sglang_client import SGLangClient

        async def go():  # the gateway's /engine (and a keyed SGLang) take only an admin key
            client = SGLangClient(url, timeout_s=s.engine.request_timeout_s,
                                  api_key=read_admin_key(s.server.admin_keys_env))
            try:
                return await sync_from_disk(client, step["path"], step["weight_version"],
                                            expected_sha256=step["sha256"])
            finally:
                await client.close()

        target, path = url, step["path"]
        rep = runtime.run(go())
    record_sync(s, rep, weight_version=step["weight_version"], target=target, checkpoint_path=path, run_id=run_id,
                started_at=started_at)
    if not rep.success:
        get_run_logger().error("weight sync to version %s failed, still serving %s: %s",
                               step["weight_version"], rep.weight_version, rep.message)
    return {"success": rep.success, "skipped": rep.skipped, "message": rep.message,
            "weight_version": rep.weight_version, "seconds": rep.seconds}


def ensure_trainer_limit() -> None:
    """Create the global concurrency limit `trainer` (1 slot) if this Prefect server lacks it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(TRAINER_LIMIT)
        except Exception:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=TRAINER_LIMIT, limit=1))
            except Exception:
                pass  # created concurrently


@flow(name="train", log_prints=True)
def train_flow(config_path: str | None = None, max_steps: int = 1, trainer_url: str | None = None,
               engine_url: str | None = None) -> dict[str, Any]:
    """Train up to ``max_steps`` PPO steps, one per full batch of waiting samples."""
    log = get_run_logger()
    ensure_trainer_limit()
    steps: list[dict[str, Any]] = []
    for _ in range(max_steps):
        # a killed run stops renewing its lease: its slot frees itself after lease_duration
        with concurrency(TRAINER_LIMIT, occupy=1, strict=True, lease_duration=60):
            batch_id = claim_batch(config_path)
            if batch_id is None:
                break
            _crash_point("claimed")
            step = run_step(config_path, batch_id, trainer_url)
            _crash_point("trained")
            run_id = log_lineage(config_path, step)
            _crash_point("logged")
            record_checkpoint(config_path, step, run_id)
            _crash_point("recorded")
            synced = sync_weights(config_path, step, engine_url, run_id)
            _crash_point("synced")
        m = step["metrics"]
        log.info("step %d (batch %s): loss %.4f, reward %.3f, kl %.5f -> version %s (sync: %s)", step["step"],
                 batch_id, m.get("loss", float("nan")), m.get("reward_mean", float("nan")), m.get("kl", 0.0),
                 step["weight_version"], "ok" if synced["success"] else synced["message"])
        steps.append({**step, "mlflow_run_id": run_id, "sync": synced})
    return {"steps": steps}
