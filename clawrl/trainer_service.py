"""The trainer fed from storage, above both ``clawrl.train`` (which never reads storage) and
``clawrl.storage``: claiming the next batch, training on its samples (here, or in the trainer
service) and recording the checkpoint it made. A batch is written to ``batches`` before its step
trains, and an unfinished one (no checkpoint row yet) is resumed rather than re-taken, so a crash
between any two steps of the train flow loses no sample and trains none twice.

The trainer service (``clawrl trainer``) keeps model and optimizer in memory while Prefect flow
runs, each in its own process, come and go: ``POST /step {"batch_id"}`` returns the StepResult
(idempotent per batch id), ``GET /state`` the current version; steps run one at a time in a worker
thread so ``/state`` keeps answering.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import httpx
from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from clawrl.checkpoint import StepResult
from clawrl.ports import SERVER_KEEPALIVE_S
from clawrl.records import (OPEN_NAMESPACE, AdapterRecord, BatchRecord, CheckpointRecord, Fate, FateRecord, SampleRecord,
                            adapter_name, parse_adapter_name)
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import (
    batch_samples,
    checkpoint_exists,
    custom_samples,
    latest_version,
    open_batch,
    trainable_samples,
    write_config_snapshot,
)
from clawrl.storage.promotions import current_champion
from clawrl.storage.selection import parse_version, select_batch
from clawrl.train.adapters import NamespaceTrainer
from clawrl.train.trainer import Trainer


def claim_batch(store, data_root: Path, *, judge_config_hash: str, batch_size: int, max_staleness: int,
                method: str, config_hash: str, config_toml: str,
                sample_source: Callable[..., list] | None = None) -> tuple[str | None, str]:
    """(the batch to train next, a line saying why): the unfinished claimed batch, else a new batch
    of ``batch_size`` fresh samples (``select_batch``; from ``sample_source`` when given, a ``[hooks]``
    hook), else None. Samples staler than ``max_staleness`` versions get the fate ``too_stale``.
    The config this batch trains under is snapshotted by ``config_hash`` for replay."""
    store.flush()  # what this process wrote is visible to the query
    with open_catalog(data_root) as con:
        pending = open_batch(con)
        if pending is not None:
            return pending["batch_id"], f"resuming batch {pending['batch_id']} (claimed, not yet checkpointed)"
        current, serving = latest_version(con), parse_version(current_champion(con))
        if sample_source is None:
            rows = trainable_samples(con, judge_config_hash).to_pylist()
        else:  # custom samples are stored first, so batches and lineage reach them like any other
            rows = custom_samples(con, sample_source(data_root=data_root, judge_config_hash=judge_config_hash,
                                                     limit=batch_size), store)
    chosen, stale = select_batch(rows, current_version=current, batch_size=batch_size, max_staleness=max_staleness,
                                 serving_version=serving)
    note = f"{len(stale)} samples too stale for version {current}; " if stale else ""
    if stale:
        store.append([FateRecord(r["turn_id"], r["session_id"], judge_config_hash, Fate.TOO_STALE.value,
                                 f"sampled by version {r['weight_version']}, policy is at {current} "
                                 f"(max_staleness {max_staleness})") for r in stale])
    if chosen is None:
        return None, note + f"{len(rows) - len(stale)} fresh samples wait; rollout_batch_size is {batch_size}"
    write_config_snapshot(data_root, config_hash, config_toml)  # replay re-reads it by hash
    sessions = session_pairs(chosen)
    batch = BatchRecord(batch_id=uuid.uuid4().hex[:16], step=current + 1, sample_ids=[r["sample_id"] for r in chosen],
                        session_ids=[sid for _, sid in sessions], session_namespaces=[ns for ns, _ in sessions],
                        method=method, config_hash=config_hash, parent_version=str(current))
    store.append(batch)
    store.flush()
    return batch.batch_id, note + f"claimed batch {batch.batch_id} ({len(chosen)} samples) for step {current + 1}"


def claim_adapter_batch(store, data_root: Path, namespace: str, *, judge_config_hash: str, batch_size: int,
                        max_staleness: int, method: str, config_hash: str,
                        config_toml: str) -> tuple[str | None, str]:
    """``claim_batch`` for the adapter of ``namespace`` (``[ppo] adapters = "namespace"``): its unfinished
    batch, else a new one of ``batch_size`` of its own fresh samples, else None. Staleness is against that
    namespace's adapter: a sample's version is the adapter version that served its turn, and the version
    serving the namespace now is never too stale (``select_batch``). The batch's step is the adapter version
    it makes: one past every version the namespace ever had, so a name is never used twice."""
    from clawrl.adapters import complete_adapters, read_served
    from clawrl.storage.adapters import latest_adapter_version, namespace_samples, open_adapter_batch

    store.flush()
    with open_catalog(data_root) as con:
        pending = open_adapter_batch(con, namespace)
        if pending is not None:
            return pending["batch_id"], f"resuming {namespace}'s batch {pending['batch_id']} (claimed, not trained)"
        current = latest_adapter_version(con, namespace)
        rows = [{**r, "weight_version": str(r["adapter_version"])}
                for r in namespace_samples(con, judge_config_hash, namespace)]
    checkpoints = data_root / "checkpoints"
    served = read_served(checkpoints, namespace)
    chosen, stale = select_batch(rows, current_version=current, batch_size=batch_size, max_staleness=max_staleness,
                                 serving_version=served.version if served else 0)
    if stale:
        store.append([FateRecord(r["turn_id"], r["session_id"], judge_config_hash, Fate.TOO_STALE.value,
                                 f"sampled by {adapter_name(namespace, int(r['weight_version']))}, its adapter is at "
                                 f"v{current} (max_staleness {max_staleness})") for r in stale])
    note = f"{len(stale)} of {namespace}'s samples too stale for its adapter v{current}; " if stale else ""
    if chosen is None:
        fresh = len(rows) - len(stale)
        return None, note + f"{fresh} fresh samples of {namespace} wait; rollout_batch_size is {batch_size}"
    write_config_snapshot(data_root, config_hash, config_toml)
    found = complete_adapters(checkpoints, namespace)
    batch = BatchRecord(batch_id=uuid.uuid4().hex[:16], step=current + 1, sample_ids=[r["sample_id"] for r in chosen],
                        session_ids=[sid for _, sid in session_pairs(chosen)],
                        session_namespaces=[namespace] * len(session_pairs(chosen)), method=method,
                        config_hash=config_hash, parent_version=adapter_name(namespace, found[0][0] if found else 0),
                        namespace=namespace)
    store.append(batch)
    store.flush()
    return batch.batch_id, note + (f"claimed {namespace}'s batch {batch.batch_id} ({len(chosen)} samples) for "
                                   f"{adapter_name(namespace, batch.step)}")


def record_adapter(store, data_root: Path, step: dict[str, Any], base_version: str, run_id: str | None = None) -> bool:
    """The ``adapters`` row of the trainer's StepResult ``step`` for a namespace's adapter (``run_id``: its
    MLflow run), once per name: False when a re-run finds it already recorded."""
    from clawrl.storage.adapters import adapter_recorded

    namespace, version = parse_adapter_name(step["weight_version"])
    return _append_once(store, data_root, lambda con: adapter_recorded(con, step["weight_version"]), AdapterRecord(
        namespace=namespace, version=version, name=step["weight_version"], batch_id=step["batch_id"],
        parent=step["parent_version"], base_version=base_version, path=step["path"], sha256=step["sha256"],
        mlflow_run_id=run_id))


def _append_once(store, data_root: Path, recorded: Callable[[Any], bool], record: Any) -> bool:
    """Append ``record`` unless ``recorded(catalog connection)`` finds it written by an earlier run; whether
    it appended."""
    store.flush()
    with open_catalog(data_root) as con:
        if recorded(con):
            return False
    store.append(record)
    store.flush()
    return True


def session_pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The sorted (namespace, session_id) pairs of sample ``rows`` ("open" where a row has no namespace)."""
    return sorted({(r.get("namespace") or OPEN_NAMESPACE, r["session_id"]) for r in rows})


def record_checkpoint(store, data_root: Path, step: dict[str, Any], run_id: str) -> bool:
    """The ``checkpoints`` row of the trainer's StepResult ``step`` (as a dict), once per weight
    version: False when a re-run finds it already recorded."""
    keys = ("weight_version", "step", "batch_id", "parent_version", "path", "sha256")
    return _append_once(store, data_root, lambda con: checkpoint_exists(con, step["weight_version"]),
                        CheckpointRecord(**{k: step[k] for k in keys}, mlflow_run_id=run_id))


def batch_records(con, batch_id: str) -> list[SampleRecord]:
    """The samples batch ``batch_id`` lists, in its order, as records."""
    keys = [f.name for f in fields(SampleRecord)]  # a column newer than every stored file keeps its default
    return [SampleRecord(**{k: r[k] for k in keys if k in r}) for r in batch_samples(con, batch_id).to_pylist()]


def samples_reader(data_root: Path) -> Callable[[str], list[SampleRecord]]:
    """``batch_id -> its samples`` over the catalog of ``data_root`` (a trainer recomputing a step)."""
    def samples_of(batch_id: str) -> list[SampleRecord]:
        with open_catalog(data_root) as con:
            return batch_records(con, batch_id)

    return samples_of


def train_batch(trainer: Trainer | NamespaceTrainer, data_root: Path, batch_id: str) -> StepResult:
    """One step of ``trainer`` on the batch's samples (the stored result if it already trained on it): the
    shared policy's, or the adapter of the namespace whose batch it is (``[ppo] adapters``)."""
    from clawrl.storage.adapters import batch_namespace

    t0 = time.perf_counter()
    with open_catalog(data_root) as con:
        samples = batch_records(con, batch_id)
        adapter = batch_namespace(con, batch_id)
    metrics = {"batch_read_s": time.perf_counter() - t0}
    if isinstance(trainer, NamespaceTrainer) != (adapter is not None):
        whose = f"namespace {adapter[0]}'s adapter" if adapter else "the shared policy"
        mine = "per-namespace adapters" if isinstance(trainer, NamespaceTrainer) else "the shared policy"
        raise ValueError(f"batch {batch_id} trains {whose}, and this trainer trains {mine} ([ppo] adapters)")
    if adapter is not None:
        return trainer.run(batch_id, samples, metrics, version=adapter[1])
    return trainer.run(batch_id, samples, metrics)


def create_trainer_app(trainer: Trainer, data_root: Path, announce: Callable[[str], None] | None = None) -> FastAPI:
    """The trainer's HTTP API; ``announce(batch_id)`` runs before each step (under torchrun: the other
    ranks are told to take part, :func:`follow_rank0`)."""
    app = FastAPI(title="clawrl trainer")
    lock = asyncio.Lock()  # the HTTP server's own guard; cross-process exclusivity is Prefect's `trainer` limit

    @app.get("/state")
    async def state() -> dict[str, Any]:
        last = None if trainer.last is None else asdict(trainer.last)
        return {"weight_version": trainer.weight_version, "last": last}

    @app.post("/step")
    async def step(batch_id: str = Body(embed=True)):
        def run() -> StepResult:
            if announce is not None:
                announce(batch_id)
            return train_batch(trainer, data_root, batch_id)

        async with lock:
            try:
                result = await asyncio.to_thread(run)
            except ValueError as e:
                return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        return asdict(result)

    return app


def serve_trainer(settings, host: str, port: int, echo: Callable[[str], None] = print) -> None:
    """``clawrl trainer``: the trainer of ``settings`` behind its HTTP API until interrupted. Under
    torchrun (``[model] tensor_parallel x data_parallel`` processes) every rank builds the trainer,
    rank 0 serves the API and announces each step, and the other ranks follow (:func:`follow_rank0`)."""
    import torch
    import torch.distributed as dist
    import uvicorn

    from clawrl.train.trainer import trainer_from_settings

    control = None
    if dist.is_torchelastic_launched():
        m, world = settings.model, int(os.environ["WORLD_SIZE"])
        if world != m.tensor_parallel * m.data_parallel or settings.ppo.backend != "megatron":
            raise ValueError(f"torchrun world of {world} processes: the trainer needs "
                             f"ppo.backend = 'megatron' and model.tensor_parallel x data_parallel = that many "
                             f"(now {settings.ppo.backend!r}, {m.tensor_parallel} x {m.data_parallel})")
        from clawrl.models import resolve_model_dir

        # the model cache first: once torch.distributed is up, transformers writes a model on rank 0 only
        resolve_model_dir(m.name, settings.storage.models_dir, m.seed)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        control = dist.new_group(backend="gloo")  # batch ids travel as Python objects, off the GPU
    trainer = trainer_from_settings(settings, samples_reader(settings.storage.data_root))
    if control is not None and dist.get_rank() != 0:
        follow_rank0(trainer, settings.storage.data_root, control)
        return

    def announce(batch_id: str) -> None:
        dist.broadcast_object_list([("step", batch_id)], src=0, group=control)

    echo(f"trainer at http://{host}:{port} (weight_version {trainer.weight_version}, backend {settings.ppo.backend}, "
         f"{trainer.world_size} process{'es' if trainer.world_size > 1 else ''})")
    try:
        uvicorn.run(create_trainer_app(trainer, settings.storage.data_root, announce if control else None),
                    host=host, port=port, log_level="warning", timeout_keep_alive=SERVER_KEEPALIVE_S)
    finally:
        if control is not None:
            dist.broadcast_object_list([("stop", None)], src=0, group=control)


def follow_rank0(trainer: Trainer, data_root: Path, group) -> None:
    """Ranks other than 0 of a torchrun trainer: take part in each step rank 0 announces (reading the
    batch's samples from the shared data root), until it says stop."""
    import torch.distributed as dist

    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        kind, batch_id = message[0]
        if kind == "stop":
            return
        try:
            train_batch(trainer, data_root, batch_id)
        except ValueError:
            pass  # the same refusal rank 0 sends its caller


def request_step(trainer_url: str, batch_id: str, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Ask the trainer service to train on ``batch_id``; its StepResult as a dict."""
    try:
        r = httpx.post(trainer_url.rstrip("/") + "/step", json={"batch_id": batch_id}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RuntimeError(f"trainer at {trainer_url} unreachable: {e!r}") from None
    if r.status_code != 200:
        raise RuntimeError(f"trainer at {trainer_url} failed batch {batch_id}: HTTP {r.status_code} {r.text[:500]}")
    return r.json()
