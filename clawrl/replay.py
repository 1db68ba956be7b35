"""Replay: re-run training steps from the logged samples, recorded config and seeds.

Three uses, one mechanism:

* **exact replay** - the same batches, the same config: every replayed checkpoint must have the
  same sha256 as the original (CPU, deterministic algorithms on).
* **unlearning** - ``exclude_sessions``: the same batches minus every sample of those sessions,
  each a (namespace, session id) pair, so the result is a model that never saw them. The replay's
  own batches, checkpoints and their ``trainer.json`` name only the sessions that trained them, so
  its lineage never names an excluded one; the MLflow replay run records which were excluded and why.
* **counterfactual** - ``overrides`` ("ppo.lr" -> 1e-5, any config key): the same data under
  another config, logged as a new MLflow run linked to the original.

Nondeterminism removed (each was a real difference between two runs of the same step):
the trainer seeds torch and switches on ``torch.use_deterministic_algorithms``; the model runs in
eval mode (no dropout); old log-probs come from the epoch-0 forward, not a separate pass; samples
are read back from Parquet with float64 log-probs (bit-exact); a batch is trained in its recorded
sample order; and the torch thread count of the original step is restored, because a CPU matmul's
reduction order - and so its last bits - depends on how many threads split it.

A namespace's LoRA adapter (``[ppo] adapters = "namespace"``, ``namespace=``) replays the same way: its
versions back to its fresh adapter, each from its own batch, into a replay data root of its own, each
adapter file's digest compared with the recorded one; only that namespace's sessions can be excluded.

A replay runs in one process. A version trained by several ranks (``[model] tensor_parallel x
data_parallel`` > 1 under torchrun) is replayed on one: where its sums were taken in another order
(tensor-parallel shards) the checkpoints differ in their last bits, so such a step is not held to
byte equality: the report's ``identical`` is None unless every checkpoint still came out identical,
and each differing step carries the largest weight difference (``max_abs_diff``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ReplayStep:
    step: int
    batch_id: str  # the recorded batch this step re-trains
    original_sha256: str
    replay_sha256: str | None
    samples: int
    excluded_samples: int
    identical: bool | None  # None when the replay changed data or config (no like-for-like comparison)
    original_run_id: str | None = None
    replay_batch_id: str | None = None  # the replay's own batch (None: every sample was excluded)
    replay_version: str | None = None  # the version it made in the replay's data root
    trained_ranks: int = 1  # processes that trained the original (the replay trains on one)
    max_abs_diff: float | None = None  # the largest weight difference, where the checkpoints differ


@dataclass
class ReplayReport:
    replay_id: str
    source_version: str
    exact: bool  # no exclusions and no overrides: hashes must match
    excluded_sessions: list[list[str]]  # [namespace, session_id] pairs
    reason: str
    overrides: dict[str, Any]
    steps: list[ReplayStep] = field(default_factory=list)
    final_path: str | None = None
    final_version: str | None = None  # `clawrl lineage VERSION --replay REPLAY_ID` walks it back
    seconds: float = 0.0
    namespace: str | None = None  # the namespace whose adapter was replayed; None: the shared policy

    @property
    def identical(self) -> bool | None:
        """Whether every checkpoint came out byte for byte; None when that is not to be expected (data,
        config or, for a step trained by several ranks, the number of ranks changed)."""
        if not self.exact:
            return None
        differ = [s for s in self.steps if not s.identical]
        if differ and all(s.trained_ranks != 1 for s in differ):
            return None
        return not differ

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "identical": self.identical}


SESSION_SEPARATOR = ":"  # NAMESPACE:SESSION_ID; namespaces ("open", "key-<hex>") never contain it


def parse_exclusion(spec: str, holders: dict[str, list[str]]) -> tuple[str, str]:
    """The (namespace, session_id) pair ``spec`` names: ``NAMESPACE:SESSION_ID`` when that namespace
    holds that session (split at the first ':', so a session id may contain ':'), else a bare
    session id that exactly one namespace holds. ``holders``: session id -> the namespaces holding it."""
    namespace, sep, session_id = spec.partition(SESSION_SEPARATOR)
    if sep and namespace in holders.get(session_id, ()):
        return namespace, session_id
    found = holders.get(spec, [])
    if len(found) == 1:
        return found[0], spec
    if found:
        raise ValueError(f"session id {spec!r} is used in {len(found)} namespaces ({', '.join(found)}); "
                         f"name one as NAMESPACE:SESSION_ID, e.g. --exclude-session {found[0]}:{spec}")
    if sep and session_id in holders:
        raise ValueError(f"namespace {namespace!r} has no session {session_id!r}; it is in "
                         f"{', '.join(holders[session_id])}")
    raise ValueError(f"no session {spec!r} in any namespace of the data (write NAMESPACE:SESSION_ID or a "
                     "session id)")


def resolve_exclusions(con, specs: tuple[str, ...]) -> list[tuple[str, str]]:
    """The sorted, distinct (namespace, session_id) pairs of ``--exclude-session`` values ``specs``."""
    from clawrl.storage.queries import session_namespaces

    candidates = {x for spec in specs for x in (spec, spec.partition(SESSION_SEPARATOR)[2]) if x}
    holders = session_namespaces(con, sorted(candidates)) if specs else {}
    return sorted({parse_exclusion(spec, holders) for spec in specs})


@dataclass(frozen=True)
class ReplayRequest:
    """What a replay will re-train, resolved and checked before any work."""

    weight_version: str
    excluded: list[tuple[str, str]]
    plan: list[dict[str, Any]]  # the recorded steps 1..weight_version (storage.queries.replay_plan)
    snapshot: Path  # the config they were trained with


def check_replay(settings, weight_version: str, exclude_sessions: tuple[str, ...] = (),
                 overrides: dict[str, Any] | None = None, namespace: str | None = None) -> ReplayRequest:
    """Resolve ``weight_version`` ("latest", a version, or an MLflow run id) and the sessions to exclude,
    and check that the steps, their one config and ``overrides`` can be replayed; raise ValueError,
    FileNotFoundError or ConfigError naming the bad value otherwise. Reads the catalog only.
    ``namespace``: a version of that namespace's adapter ("latest", N or its name)."""
    from clawrl.config import load_settings
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import config_snapshot_path, latest_version, replay_plan, version_for_run

    data_root = Path(settings.storage.data_root)
    with open_catalog(data_root) as con:
        if namespace is not None:
            weight_version, plan = _adapter_plan(con, namespace, weight_version)
            excluded = resolve_exclusions(con, tuple(exclude_sessions))
            if others := [":".join(p) for p in excluded if p[0] != namespace]:
                raise ValueError(f"{', '.join(others)} is not a session of {namespace}: an adapter replay leaves "
                                 "out sessions of its own namespace only")
        elif weight_version == "latest":
            weight_version = str(latest_version(con))
            if weight_version == "0":
                raise ValueError(f"nothing to replay: no training step is recorded in {data_root}")
        elif len(weight_version) == 32 and not weight_version.isdigit():  # an MLflow run id
            run_id, weight_version = weight_version, version_for_run(con, weight_version)
            if weight_version is None:
                raise ValueError(f"no checkpoint was trained by MLflow run {run_id!r}")
        if namespace is None and (not weight_version.isdigit() or int(weight_version) < 1):
            raise ValueError(f"version {weight_version!r}: expected a weight version (1, 2, ...), 'latest' or an "
                             "MLflow run id")
        if namespace is None:
            excluded = resolve_exclusions(con, tuple(exclude_sessions))
            plan = replay_plan(con, weight_version)
    config_hashes = {p["config_hash"] for p in plan}
    if len(config_hashes) != 1:
        raise ValueError(f"versions {plan[0]['step']}..{weight_version} were trained under several configs "
                         f"{sorted(config_hashes)}; replay one config segment at a time")
    snapshot = config_snapshot_path(data_root, plan[0]["config_hash"])
    if not snapshot.is_file():
        raise FileNotFoundError(f"the recorded config {snapshot} is missing; cannot replay")
    load_settings(snapshot, env={}, overrides=dict(overrides or {}), drop_removed=True)  # a bad --set fails here
    return ReplayRequest(weight_version, excluded, plan, snapshot)


def _adapter_plan(con, namespace: str, version: str) -> tuple[str, list[dict[str, Any]]]:
    """(the adapter name, the versions that trained it, oldest first, each as a plan row: step = its version)
    of ``version`` ("latest", N, or ``<namespace>@v<N>``) of ``namespace``'s adapter."""
    from clawrl.records import adapter_name, adapter_number
    from clawrl.storage.adapters import adapter_chain, latest_adapter_version

    number = 0
    if version == "latest":
        number = latest_adapter_version(con, namespace)
    else:
        with contextlib.suppress(ValueError):  # told below, in the replay's words
            number = adapter_number(namespace, version)
    if number < 1:
        raise ValueError(f"version {version!r}: expected a version of {namespace}'s adapter (1, 2, ..., or 'latest')")
    chain = adapter_chain(con, namespace, number)
    if not chain:
        raise ValueError(f"no version {adapter_name(namespace, number)} is recorded (`clawrl lineage latest "
                         f"--namespace {namespace}` shows its newest)")
    if chain[-1]["parent"] != adapter_name(namespace, 0):
        raise ValueError(f"cannot replay {chain[0]['name']}: {chain[-1]['name']} was trained from "
                         f"{chain[-1]['parent']}, which is no longer recorded")
    return chain[0]["name"], [{**r, "step": r["version"]} for r in reversed(chain)]


def replay(settings, weight_version: str, *, exclude_sessions: tuple[str, ...] = (), reason: str = "",
           overrides: dict[str, Any] | None = None, progress=None, namespace: str | None = None) -> ReplayReport:
    """Re-train versions 1..``weight_version`` (the newest for "latest"; an MLflow run id: the version
    that run trained) of ``settings.storage.data_root`` into a new data root, ``replays/<replay id>``:
    its checkpoints, and the batches, samples and checkpoint rows that made them (its own batch ids).
    ``exclude_sessions``: ``NAMESPACE:SESSION_ID`` or an unambiguous session id each. ``namespace``: the
    versions of that namespace's adapter up to ``weight_version`` instead."""
    import torch

    from clawrl.config import load_settings
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.writer import DataStore
    from clawrl.train.trainer import trainer_from_settings
    from clawrl.trainer_service import batch_records, samples_reader

    data_root = Path(settings.storage.data_root)
    overrides = dict(overrides or {})
    request = check_replay(settings, weight_version, tuple(exclude_sessions), overrides, namespace)
    weight_version, excluded, plan, snapshot = (request.weight_version, request.excluded, request.plan,
                                                request.snapshot)
    with open_catalog(data_root) as con:
        batches = [batch_records(con, p["batch_id"]) for p in plan]
    exact = not excluded and not overrides
    replay_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    out = data_root / "replays" / replay_id
    report = ReplayReport(replay_id, weight_version, exact, [list(p) for p in excluded], reason, overrides,
                          namespace=namespace)
    t0 = time.perf_counter()
    replay_settings = load_settings(snapshot, env={}, drop_removed=True, overrides={
        **overrides, "storage.data_root": str(out), "storage.model_cache": str(settings.storage.models_dir),
        "model.tensor_parallel": 1, "model.data_parallel": 1})  # one process, whatever trained the original
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(snapshot.read_text())
    trainer = trainer_from_settings(replay_settings, samples_reader(out))
    with DataStore(out, background=False) as store:
        for p, samples in zip(plan, batches):
            recorded = _recorded_metrics(p)
            if threads := int(recorded.get("torch_threads") or 0):
                torch.set_num_threads(threads)
            step = _replay_step(trainer, store, replay_id, p, samples, set(excluded), exact,
                                trained_ranks=int(recorded.get("trainer_ranks") or 1))
            if step.replay_version is not None:
                report.final_path, report.final_version = trainer.last.path, step.replay_version
            report.steps.append(step)
            if progress:
                progress(step)
    report.seconds = time.perf_counter() - t0
    (out / "replay.json").write_text(json.dumps(report.to_dict(), indent=1))
    return report


def _replay_step(trainer, store, replay_id: str, plan_row: dict[str, Any], samples: list,
                 excluded: set[tuple[str, str]], exact: bool, trained_ranks: int = 1) -> ReplayStep:
    """One recorded batch re-trained without the ``excluded`` (namespace, session_id) pairs: the
    replay's batch row (with the samples it lists) before the step, its checkpoint (or, for a
    namespace's adapter, ``adapters``) row after. ``trained_ranks``: the processes that trained the
    original step."""
    from clawrl.adapters import ADAPTER_FILE
    from clawrl.checkpoint import TREE_PREFIX, WEIGHTS_FILE, digest_as_recorded
    from clawrl.records import AdapterRecord, BatchRecord, CheckpointRecord, adapter_name

    kept = [r for r in samples if (r.namespace, r.session_id) not in excluded]
    step = ReplayStep(plan_row["step"], plan_row["batch_id"], plan_row["sha256"], None, len(kept),
                      len(samples) - len(kept), None, plan_row.get("mlflow_run_id"),
                      trained_ranks=trained_ranks)
    if not kept:
        return step
    namespace = plan_row.get("namespace")  # set: a version of that namespace's adapter
    if namespace is None:
        version, parent = trainer.version + 1, trainer.weight_version
    else:
        version = int(plan_row["step"])
        parent = trainer.last.weight_version if trainer.last is not None else adapter_name(namespace, 0)
    step.replay_batch_id = hashlib.sha256(f"{replay_id}\x00{plan_row['batch_id']}".encode()).hexdigest()[:16]
    sessions = sorted({(r.namespace, r.session_id) for r in kept})
    store.append(kept)
    store.append(BatchRecord(
        batch_id=step.replay_batch_id, step=version, sample_ids=[r.sample_id for r in kept],
        session_ids=[sid for _, sid in sessions], session_namespaces=[ns for ns, _ in sessions],
        method=plan_row["method"], config_hash=plan_row["config_hash"], parent_version=parent,
        source_batch_id=plan_row["batch_id"], namespace=namespace))
    store.flush()
    if namespace is None:
        result = trainer.run(step.replay_batch_id, kept)
        store.append(CheckpointRecord(weight_version=result.weight_version, step=result.step, batch_id=result.batch_id,
                                      parent_version=result.parent_version, path=result.path, sha256=result.sha256,
                                      mlflow_run_id=None))
    else:
        result = trainer.run(step.replay_batch_id, kept, version=version)
        store.append(AdapterRecord(namespace=namespace, version=version, name=result.weight_version,
                                   batch_id=result.batch_id, parent=result.parent_version,
                                   base_version=plan_row["base_version"], path=result.path, sha256=result.sha256))
    store.flush()
    weights = WEIGHTS_FILE if namespace is None else ADAPTER_FILE
    step.replay_sha256, step.replay_version = result.sha256, result.weight_version
    same = result.sha256 == plan_row["sha256"]
    if not same and not plan_row["sha256"].startswith(TREE_PREFIX):  # recorded as the whole file's sha256
        same = digest_as_recorded(Path(result.path) / weights, plan_row["sha256"]) == plan_row["sha256"]
    if not same and plan_row.get("path"):
        step.max_abs_diff = max_weight_difference(Path(plan_row["path"]), Path(result.path), weights)
    if exact:
        step.identical = same
    return step


def max_weight_difference(a: Path, b: Path, weights: str = "model.safetensors") -> float | None:
    """The largest absolute difference between two checkpoints' (adapters') ``weights`` files (None: a file
    is missing or they do not hold the same tensors)."""
    from safetensors import safe_open

    fa, fb = a / weights, b / weights
    if not (fa.is_file() and fb.is_file()):
        return None
    with safe_open(str(fa), "pt") as x, safe_open(str(fb), "pt") as y:
        if set(x.keys()) != set(y.keys()):
            return None
        worst = 0.0
        for k in x.keys():
            ta, tb = x.get_tensor(k).float(), y.get_tensor(k).float()
            if ta.shape != tb.shape:
                return None
            worst = max(worst, float((ta - tb).abs().max()) if ta.numel() else 0.0)
    return worst


def _recorded_metrics(plan_row: dict[str, Any]) -> dict[str, Any]:
    """The original step's metrics (thread count, ranks) from its checkpoint's trainer.json."""
    from clawrl.checkpoint import TRAINER_FILE, read_step_result

    path = plan_row.get("path")
    if path and (Path(path) / TRAINER_FILE).is_file():
        return read_step_result(path).metrics
    return {}
