"""The promotion gate at work, above the gate's rule (``clawrl.gate``), the evaluation (``clawrl.evaluation``),
the weight loading (``clawrl.sync``) and storage.

Every new checkpoint is a candidate. :func:`gate_candidate` loads it into an evaluation engine (its
own weights, never the serving engine's: users keep getting the champion meanwhile), scores it on
the evaluation set (``[gate] eval_set``: validation or replay; the row names it, and for replay the
turn ids whose requests were the prompts), and compares it paired with the champion's scores on
the same prompts and seeds: stored when the champion was evaluated, or measured now (the champion's
checkpoint, or the initial weights for version "0", loaded into the same engine). The scores are an
``evaluations`` row per version, the decision a ``promotions`` row with its evidence; the caller then
serves the champion after the decision (the candidate when promoted, else the same champion as before).

By hand, :func:`record_manual` writes the row of a `clawrl promote` or `clawrl rollback`. The
champion and the ``ROLLBACK_DEPTH`` champions before it on the line keep their weights on disk
(``clawrl.checkpoint.keep_weights_of``): the trainer's pruning of old checkpoints must not take away
what serves or what the next rollbacks serve. A version whose weights were pruned is refused before
anything is loaded (:class:`WeightsPruned`, with the versions that can still be served).

Per namespace (``[ppo] adapters = "namespace"``, ``namespace=`` given) the same, on that namespace's
line: the candidate is an adapter version (``<namespace>@v<N>``), the champion another or the base alone
(``<namespace>@v0``). The evaluation engine keeps the initial weights and loads both adapters beside
them under their names, and every answer names its adapter (``lora_path``): no weight swap. The
guard groups compare with the base alone. Rows and evaluations carry the namespace.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from clawrl import runtime
from clawrl.adapters import ADAPTER_FILE, complete_adapters, namespace_dir, verify_adapter
from clawrl.chat import ChatAdapter
from clawrl.checkpoint import WEIGHTS_FILE, CheckpointError, complete_checkpoints, keep_weights_of
from clawrl.engine.types import Engine
from clawrl.evaluation import EvalSet, evaluate_version
from clawrl.gate import GateDecision, Guard, decide_live_rollback, decide_promotion
from clawrl.records import EvaluationRecord, PromotionAction, PromotionRecord, adapter_name, parse_adapter_name
from clawrl.storage.adapters import find_adapter
from clawrl.storage.catalog import open_catalog
from clawrl.storage.promotions import (
    BASE_VERSION,
    base_of,
    best_promoted_mean,
    champion_stack,
    current_champion,
    live_scores,
    stored_evaluation,
)
from clawrl.storage.queries import find_checkpoint
from clawrl.sync import sync_from_disk, sync_state_dict


# Champions before the current one whose weights stay on disk: `clawrl rollback` (and the live check)
# can go back this many times in a row; the initial weights, read from the model directory, always
# serve. Each kept version costs a checkpoint's weights on disk (540 MB for SmolLM2-135M in float32)
# beyond the trainer's newest three, so the line is not kept whole.
ROLLBACK_DEPTH = 3


class GateError(RuntimeError):
    """The gate could not measure a version (its checkpoint is gone or does not load)."""


class WeightsPruned(GateError):
    """The version's checkpoint is recorded but its weights were pruned: it can no longer be served."""


def weights_of(con, version: str, base_dir: Path) -> tuple[str, str, str | None]:
    """(version, weights directory, sha256 or None) of ``version``: its checkpoint, or the initial
    weights ``base_dir`` for version "0"; for an adapter name, the adapter's directory (the base alone,
    ``base_dir``, for ``<namespace>@v0``). Raises GateError for a version with no checkpoint, and
    WeightsPruned for one whose weights file is gone."""
    if str(version) == BASE_VERSION:
        return BASE_VERSION, str(base_dir), None
    if "@" in str(version):
        return _adapter_weights(con, str(version), base_dir)
    ck = find_checkpoint(con, str(version))
    if ck is None:
        raise GateError(f"no checkpoint of weight version {version!r}")
    if not (Path(ck["path"]) / WEIGHTS_FILE).is_file():
        raise WeightsPruned(f"the weights of version {ck['weight_version']} were pruned ({ck['path']} keeps its "
                            f"record, not its {WEIGHTS_FILE})")
    return str(ck["weight_version"]), ck["path"], ck["sha256"]


def _adapter_weights(con, name: str, base_dir: Path | None) -> tuple[str, str, str | None]:
    namespace, version = parse_adapter_name(name)
    if version == 0:  # the base alone
        return name, str(base_dir), None
    row = find_adapter(con, name)
    if row is None:
        raise GateError(f"no adapter version {name!r} of namespace {namespace} is recorded")
    if not (Path(row["path"]) / ADAPTER_FILE).is_file():
        raise WeightsPruned(f"the weights of adapter {name} were pruned ({row['path']} keeps its record, not its "
                            f"{ADAPTER_FILE})")
    return name, row["path"], row["sha256"]


def adapter_target(data_root: Path, name: str) -> dict[str, Any]:
    """What serving adapter ``name`` loads (namespace, weight_version, path, sha256); path and sha256 are None
    for ``<namespace>@v0``, the base alone. Raises WeightsPruned for a version whose weights were pruned,
    GateError for one never recorded."""
    namespace, version = parse_adapter_name(name)
    if version == 0:
        return {"namespace": namespace, "weight_version": name, "path": None, "sha256": None}
    with open_catalog(data_root) as con:
        _, path, sha = _adapter_weights(con, name, None)
    return {"namespace": namespace, "weight_version": name, "path": path, "sha256": sha}


def servable_versions(data_root: Path, namespace: str | None = None) -> list[str]:
    """The versions that can still be served, newest first: every checkpoint (of ``namespace``'s adapter)
    that keeps its weights, then "0" (the initial weights; the namespace's base alone)."""
    checkpoints = Path(data_root) / "checkpoints"
    if namespace is not None:
        return [adapter_name(namespace, v) for v, d in complete_adapters(checkpoints, namespace)
                if (d / ADAPTER_FILE).is_file()] + [base_of(namespace)]
    found = complete_checkpoints(checkpoints)
    return [str(v) for v, d in found if (d / WEIGHTS_FILE).is_file()] + [BASE_VERSION]


def keep_rollback_reach(data_root: Path, namespace: str | None = None) -> list[str]:
    """Mark the champion and the ``ROLLBACK_DEPTH`` before it on the line (of ``namespace``'s adapter) as
    weights the trainer's pruning must keep (the promotions written so far); returns them, oldest first."""
    with open_catalog(data_root) as con:
        reach = champion_stack(con, namespace)[-(ROLLBACK_DEPTH + 1):]
    if namespace is None:
        keep_weights_of(Path(data_root) / "checkpoints", reach)
    else:  # by version number, in the namespace's own directory
        keep_weights_of(namespace_dir(Path(data_root) / "checkpoints", namespace),
                        [str(parse_adapter_name(v)[1]) for v in reach])
    return reach


async def _score(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet, version: str, path: str,
                 sha256: str | None, state_dict: Any = None, base_dir: Path | None = None) -> tuple[list[float], float]:
    if "@" in version:  # an adapter (or a namespace's base alone) over the initial weights
        return await _score_adapter(engine, adapter, eval_set, version, path, sha256, base_dir)
    if state_dict is not None:
        rep = await sync_state_dict(engine, state_dict, version)
    else:
        rep = await sync_from_disk(engine, path, version, expected_sha256=sha256, check_beside=True)  # serves nobody
    if not rep.success:
        raise GateError(f"could not load weight version {version} into the evaluation engine: {rep.message}")
    return await evaluate_version(engine, adapter, eval_set)


async def _score_adapter(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet, name: str, path: str,
                         sha256: str | None, base_dir: Path | None) -> tuple[list[float], float]:
    """Scores of adapter ``name`` (at ``path``, digest ``sha256``) served beside the initial weights, which the
    engine is brought back to first when it holds others; ``<namespace>@v0``: the base alone. The adapter is
    unloaded again afterwards: the engine keeps no name for longer than one measurement."""
    rep = await sync_from_disk(engine, str(base_dir), BASE_VERSION, check_beside=True)  # a no-op when it holds them
    if not rep.success:
        raise GateError(f"could not load the initial weights into the evaluation engine: {rep.message}")
    if parse_adapter_name(name)[1] == 0:
        return await evaluate_version(engine, adapter, eval_set)
    load = getattr(engine, "load_lora_adapter", None)
    if load is None:
        raise GateError(f"the evaluation engine ({type(engine).__name__}) does not serve LoRA adapters")
    try:
        await asyncio.to_thread(verify_adapter, path, sha256 or "")
    except CheckpointError as e:
        raise GateError(f"adapter {name}: {e}") from None
    res = await load(name, path)
    if not res.success and "already exists" not in res.message:  # left by a measurement that was cut short
        raise GateError(f"could not load adapter {name} into the evaluation engine: {res.message}")
    try:
        return await evaluate_version(engine, adapter, eval_set, lora_path=name)
    finally:
        await engine.unload_lora_adapter(name)


def score_version(data_root: Path, engine: Engine, adapter: ChatAdapter, eval_set: EvalSet, version: str,
                  base_dir: Path) -> list[float]:
    """Per-prompt scores of ``version`` on any evaluation set, stored nowhere (the demo's held-out
    score of a refused candidate); the engine keeps the weights it holds when it holds ``version``."""
    with open_catalog(data_root) as con:
        v, path, sha = weights_of(con, version, base_dir)
    return runtime.run(_score(engine, adapter, eval_set, v, path, sha, base_dir=base_dir))[0]


def _evaluation(version: str, eval_set: EvalSet, scores: list[float], seconds: float,
                namespace: str | None) -> EvaluationRecord:
    return EvaluationRecord(evaluation_id=uuid.uuid4().hex[:16], weight_version=str(version), eval_key=eval_set.key,
                            scores=scores, mean=sum(scores) / len(scores), n=len(scores), samples=eval_set.samples,
                            seconds=float(seconds), namespace=namespace)


def measure(store, con, engine: Engine, adapter: ChatAdapter, eval_set: EvalSet, version: str, base_dir: Path,
            state_dict: Any = None) -> tuple[EvaluationRecord, bool]:
    """(the evaluation of ``version`` under this set, whether it was measured now): a stored one is
    reused; a new one is appended to ``store``. An adapter's (``<namespace>@v<N>``) row names its
    namespace."""
    found = stored_evaluation(con, version, eval_set.key)
    if found is not None:
        return EvaluationRecord(**{k: v for k, v in found.items() if k != "date"}), False
    v, path, sha = weights_of(con, version, base_dir)
    scores, seconds = runtime.run(_score(engine, adapter, eval_set, v, path, sha, state_dict, base_dir))
    rec = _evaluation(v, eval_set, scores, seconds, parse_adapter_name(v)[0] if "@" in v else None)
    store.append(rec)
    return rec, True


def gate_candidate(store, data_root: Path, *, candidate: str, engine: Engine, adapter: ChatAdapter,
                   eval_set: EvalSet, base_dir: Path, tolerance: float, alpha: float, min_gain: float | None = None,
                   guard: Sequence[str] = (), guard_tolerance: float = 0.0, state_dict: Any = None,
                   mlflow_run_id: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    """Decide on weight version ``candidate`` (``state_dict``: its weights in memory, else its
    checkpoint is loaded); with ``namespace``, on that namespace's adapter version ``candidate`` against
    its champion. Returns the decision with its evidence (``clawrl.gate.GateDecision``'s
    fields), ``champion_version`` (before), ``serve_version`` (after), ``eval_seconds`` (engine time
    spent measuring now) and ``promotion_id``. ``guard``: groups of the set's prompts that must not get
    worse (``clawrl.gate``); a group the set lacks raises ValueError before anything is measured."""
    guarded = {group: eval_set.group_indices(group) for group in guard}
    store.flush()
    with open_catalog(data_root) as con:
        champion = current_champion(con, namespace)
        d, seconds = _decide(store, con, engine, adapter, eval_set, champion, str(candidate), base_dir,
                             partial(decide_promotion, tolerance=tolerance, alpha=alpha, min_gain=min_gain,
                                     guard_tolerance=guard_tolerance), state_dict, guarded, namespace)
    action = PromotionAction.PROMOTE if d.promoted else PromotionAction.REFUSE
    row = PromotionRecord(
        promotion_id=uuid.uuid4().hex[:16], action=action.value, weight_version=str(candidate),
        champion_version=champion, source="gate", reason=d.reason, eval_key=eval_set.key, n=d.n,
        **{k: _finite(getattr(d, k)) for k in ("candidate_mean", "champion_mean", "mean_diff", "ci_low", "ci_high",
                                               "p_value", "tolerance", "alpha")},
        mlflow_run_id=mlflow_run_id, eval_set=eval_set.name,
        eval_turn_ids=list(eval_set.turn_ids) if eval_set.turn_ids is not None else None, namespace=namespace)
    store.append(row)
    store.flush()
    serve = str(candidate) if d.promoted else champion
    keep_rollback_reach(data_root, namespace)
    return {**d.to_dict(), "champion_version": champion, "serve_version": serve, "eval_seconds": seconds,
            "promotion_id": row.promotion_id, "eval_set": eval_set.name, "eval_turn_ids": row.eval_turn_ids}


def _decide(store, con, engine: Engine, adapter: ChatAdapter, eval_set: EvalSet, champion: str, candidate: str,
            base_dir: Path, decide: Callable[..., GateDecision], state_dict: Any,
            guarded: dict[str, list[int]] | None = None, namespace: str | None = None) -> tuple[GateDecision, float]:
    """(the decision on ``candidate`` against ``champion``, engine seconds spent measuring now). A set
    with no prompts (a replay set short of judged turns) measures nothing: the rule refuses, saying why.
    ``decide``: ``decide_promotion`` with the gate's tolerance, alpha, min_gain and guard tolerance;
    ``guarded``: each guarded group's prompt indices."""
    if not eval_set.prompts:
        d = decide([], [])
        return (replace(d, reason=f"{d.reason} ({eval_set.note})") if eval_set.note else d), 0.0
    base_version = base_of(namespace)
    champ, fresh_champ = measure(store, con, engine, adapter, eval_set, champion, base_dir)
    base, fresh_base = (champ, False) if champion == base_version or not guarded else \
        measure(store, con, engine, adapter, eval_set, base_version, base_dir)  # stored since the first gate
    cand, fresh_cand = measure(store, con, engine, adapter, eval_set, candidate, base_dir, state_dict)
    floor = best_promoted_mean(con, eval_set.key, namespace)
    if fresh_champ:  # measured just now, so not yet in the table the floor was read from
        floor = champ.mean if floor is None else max(floor, champ.mean)
    d = decide(cand.scores, champ.scores, floor=floor, guards=guards(guarded or {}, cand.scores, base.scores))
    return d, sum(r.seconds for r, fresh in ((champ, fresh_champ), (base, fresh_base), (cand, fresh_cand)) if fresh)


def guards(guarded: dict[str, list[int]], candidate: Sequence[float], base: Sequence[float]) -> list[Guard]:
    """The guarded groups' (name -> prompt indices) means of the candidate and of the initial weights."""
    return [Guard(group, sum(candidate[i] for i in idx) / len(idx), sum(base[i] for i in idx) / len(idx))
            for group, idx in guarded.items()]


def _finite(x: float | None) -> float | None:
    return None if x is None or x != x else float(x)


def check_live(data_root: Path, judge_config_hash: str, *, tolerance: float, alpha: float,
               min_n: int) -> dict[str, Any] | None:
    """The live check (``clawrl.gate.decide_live_rollback``) of the champion against the previous
    champion on the line, with ``champion`` and ``previous``; None when no champion was promoted yet."""
    with open_catalog(data_root) as con:
        line = champion_stack(con)
        if len(line) < 2:
            return None
        champion, previous = line[-1], line[-2]
        check = decide_live_rollback(live_scores(con, judge_config_hash, champion),
                                     live_scores(con, judge_config_hash, previous),
                                     tolerance=tolerance, alpha=alpha, min_n=min_n)
    return {"champion": champion, "previous": previous, **check.to_dict()}


def record_manual(store, data_root: Path, *, action: PromotionAction, version: str, reason: str,
                  source: str = "manual", mlflow_run_id: str | None = None,
                  live: dict[str, Any] | None = None, namespace: str | None = None) -> PromotionRecord:
    """The row of a promotion or rollback made by hand, or by the live check (``source = "live"``,
    ``live``: :func:`check_live`'s evidence, stored as n = the champion's turns, candidate_mean = the
    champion's live mean, champion_mean = the restored version's); the new champion and the ones a
    rollback reaches keep their weights. ``namespace``: of that namespace's adapter line."""
    store.flush()
    with open_catalog(data_root) as con:
        champion = current_champion(con, namespace)
    ev = live or {}
    row = PromotionRecord(
        promotion_id=uuid.uuid4().hex[:16], action=action.value, weight_version=str(version),
        champion_version=champion, source=source, reason=reason, eval_key=None, n=ev.get("n_champion"),
        candidate_mean=_finite(ev.get("champion_mean")), champion_mean=_finite(ev.get("previous_mean")),
        mean_diff=_finite(ev.get("mean_diff")), ci_low=_finite(ev.get("ci_low")), ci_high=_finite(ev.get("ci_high")),
        p_value=_finite(ev.get("p_value")), tolerance=ev.get("tolerance"), alpha=ev.get("alpha"),
        mlflow_run_id=mlflow_run_id, namespace=namespace)
    store.append(row)
    store.flush()
    keep_rollback_reach(data_root, namespace)
    return row
