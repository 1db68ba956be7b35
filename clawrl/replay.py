"""Replay: re-run training steps from the logged samples, recorded config and seeds.

Three uses, one mechanism:

* **exact replay** - the same batches, the same config: every replayed checkpoint must have the
  same sha256 as the original (CPU, deterministic algorithms on).
* **unlearning** - ``exclude_sessions``: the same batches minus every sample of those sessions, so
  the result is a model that never saw them; the lineage records which sessions and why.
* **counterfactual** - ``overrides`` ("ppo.lr" -> 1e-5, any config key): the same data under
  another config, logged as a new MLflow run linked to the original.

Nondeterminism removed (each was a real difference between two runs of the same step):
the trainer seeds torch and switches on ``torch.use_deterministic_algorithms``; the model runs in
eval mode (no dropout); old log-probs come from the epoch-0 forward, not a separate pass; samples
are read back from Parquet with float64 log-probs (bit-exact); a batch is trained in its recorded
sample order; and the torch thread count of the original step is restored, because a CPU matmul's
reduction order - and so its last bits - depends on how many threads split it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ReplayStep:
    step: int
    batch_id: str
    original_sha256: str
    replay_sha256: str | None
    samples: int
    excluded_samples: int
    identical: bool | None  # None when the replay changed data or config (no like-for-like comparison)
    original_run_id: str | None = None


@dataclass
class ReplayReport:
    replay_id: str
    source_version: str
    exact: bool  # no exclusions and no overrides: hashes must match
    excluded_sessions: list[str]
    reason: str
    overrides: dict[str, Any]
    steps: list[ReplayStep] = field(default_factory=list)
    final_path: str | None = None
    seconds: float = 0.0

    @property
    def identical(self) -> bool | None:
        if not self.exact:
            return None
        return all(s.identical for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "identical": self.identical}


def replay(settings, weight_version: str, *, exclude_sessions: tuple[str, ...] = (), reason: str = "",
           overrides: dict[str, Any] | None = None, progress=None) -> ReplayReport:
    """Re-train versions 1..``weight_version`` (the newest for "latest"; an MLflow run id: the version
    that run trained) of ``settings.storage.data_root`` into a new directory."""
    import torch

    from clawrl.config import load_settings
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import config_snapshot_path, latest_version, replay_plan, version_for_run
    from clawrl.train.trainer import trainer_from_settings
    from clawrl.trainer_service import batch_records

    data_root = Path(settings.storage.data_root)
    with open_catalog(data_root) as con:
        if weight_version == "latest":
            weight_version = str(latest_version(con))
        elif len(weight_version) == 32 and not weight_version.isdigit():  # an MLflow run id
            run_id, weight_version = weight_version, version_for_run(con, weight_version)
            if weight_version is None:
                raise ValueError(f"no checkpoint was trained by MLflow run {run_id!r}")
        plan = replay_plan(con, weight_version)
        batches = [batch_records(con, p["batch_id"]) for p in plan]
    overrides = dict(overrides or {})
    excluded = set(exclude_sessions)
    exact = not excluded and not overrides
    replay_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    out = data_root / "replays" / replay_id
    report = ReplayReport(replay_id, weight_version, exact, sorted(excluded), reason, overrides)
    t0 = time.perf_counter()
    config_hashes = {p["config_hash"] for p in plan}
    if len(config_hashes) != 1:
        raise ValueError(f"versions 1..{weight_version} were trained under several configs {sorted(config_hashes)}; "
                         "replay one config segment at a time")
    snapshot = config_snapshot_path(data_root, plan[0]["config_hash"])
    if not snapshot.is_file():
        raise FileNotFoundError(f"the recorded config {snapshot} is missing; cannot replay")
    replay_settings = load_settings(snapshot, env={}, overrides={
        **overrides, "storage.data_root": str(out), "storage.model_cache": str(settings.storage.models_dir)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(snapshot.read_text())
    trainer = trainer_from_settings(replay_settings)
    for p, samples in zip(plan, batches):
        if threads := _recorded_threads(p):
            torch.set_num_threads(threads)
        kept = [r for r in samples if r.session_id not in excluded]
        step = ReplayStep(p["step"], p["batch_id"], p["sha256"], None, len(kept), len(samples) - len(kept), None,
                          p.get("mlflow_run_id"))
        if kept:
            result = trainer.run(p["batch_id"], kept)
            step.replay_sha256 = result.sha256
            report.final_path = result.path
            if exact:
                step.identical = result.sha256 == p["sha256"]
        report.steps.append(step)
        if progress:
            progress(step)
    report.seconds = time.perf_counter() - t0
    (out / "replay.json").write_text(json.dumps(report.to_dict(), indent=1))
    return report


def _recorded_threads(plan_row: dict[str, Any]) -> int:
    """The torch thread count the original step ran with (from its checkpoint's trainer.json)."""
    from clawrl.checkpoint import TRAINER_FILE, read_step_result

    path = plan_row.get("path")
    if path and (Path(path) / TRAINER_FILE).is_file():
        return int(read_step_result(path).metrics.get("torch_threads") or 0)
    return 0
