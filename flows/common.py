"""Per-process helpers shared by the flows (and `clawrl sync`): settings loaded once, one DataStore
per data root, the record of a weight-sync attempt."""

from __future__ import annotations

from clawrl import runtime
from clawrl.config import Settings, load_settings


def load_flow_settings(config_path: str | None) -> Settings:
    return runtime.get_or_create(f"settings:{config_path}", lambda: load_settings(config_path))


def data_store(settings: Settings):
    from clawrl.storage.writer import DataStore

    return runtime.get_or_create(f"store:{settings.storage.data_root}", lambda: DataStore(settings.storage.data_root))


def record_sync(s: Settings, rep, *, weight_version: str, target: str, checkpoint_path: str | None,
                run_id: str | None, started_at) -> None:
    """One ``syncs`` row per attempt (what `clawrl status` shows), and the attempt on the MLflow run
    of the step that made the version (``clawrl.lineage.log_sync``)."""
    import uuid

    from clawrl.lineage import log_sync
    from clawrl.records import SyncRecord

    store = data_store(s)
    store.append(SyncRecord(sync_id=uuid.uuid4().hex[:16], weight_version=str(weight_version), target=target,
                            ok=rep.success, skipped=rep.skipped, error=None if rep.success else rep.message,
                            serving_version=rep.weight_version, checkpoint_path=checkpoint_path,
                            mlflow_run_id=run_id, started_at=started_at, seconds=float(rep.seconds)))
    store.flush()
    if run_id:
        log_sync(s.storage.data_root, run_id, ok=rep.success, error=rep.message, serving_version=rep.weight_version,
                 seconds=rep.seconds, target=target)
