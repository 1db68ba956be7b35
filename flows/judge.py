"""Prefect flow `judge`: turns with a next state -> verdicts, samples and fates, exactly once.

Thin orchestration over clawrl.judge.runner and storage/. One task per turn, run concurrently up to
``[prm] max_in_flight`` (no global lock), each with Prefect retries and exponential backoff; a turn
that still fails on its last attempt is recorded with fate ``judge_error`` (raw outputs kept) and
the other turns go on. Exactly once per (turn, judge-config hash): a turn is judged when its fate
row exists, the fate is written last, and sample ids are deterministic, so a rerun or a crash half
way neither duplicates nor loses a judgment. When enough trainable samples wait, the flow emits the
event ``clawrl.samples.ready`` that the train deployment listens to. Last, the live check
(``check_live_score``) compares the judged live score of the champion with the previous champion's
and rolls serving back on a significant drop.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.tasks import exponential_backoff
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.runtime import task_run
from prefect.task_runners import ThreadPoolTaskRunner

from clawrl import runtime
from clawrl.flows.common import data_store, judge_for, load_flow_settings, push_weights, serve_target
from clawrl.judge.runner import failure_records, next_state_from_row, outcome_records, turn_from_row
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import pending_counts, turns_to_judge

SAMPLES_READY_EVENT = "clawrl.samples.ready"


class JudgeAttemptFailed(RuntimeError):
    """Raised to make Prefect retry a turn whose judge or teacher failed."""


def _crash_point(name: str) -> None:
    """No-op; the crash tests replace it to SIGKILL the process at this point."""


def _append_outcome(s, records: list[Any]) -> None:
    """The verdict (and sample) first, then the fate in a write of its own: the turn counts as
    judged once its fate is stored, so a crash in between leaves an uncommitted attempt that the
    next run judges again (its verdict and sample supersede these: storage/catalog.py)."""
    if len(records) > 1:
        data_store(s).append(records[:-1])
        _crash_point("verdict_written")
    data_store(s).append(records[-1])
    _crash_point("fate_written")


@task(cache_policy=NO_CACHE)
def find_turns(config_path: str | None, judge_config_hash: str, limit: int) -> list[str]:
    with open_catalog(load_flow_settings(config_path).storage.data_root) as con:
        return turns_to_judge(con, judge_config_hash, limit=limit).column("turn_id").to_pylist()


def _pending_turn(config_path: str | None, turn_id: str):
    """(settings, judge, the turn's row or None when it already has a fate under this config)."""
    s = load_flow_settings(config_path)
    judge = judge_for(s)
    with open_catalog(s.storage.data_root) as con:
        rows = turns_to_judge(con, judge.config_hash, turn_id=turn_id).to_pylist()
    return s, judge, (rows[0] if rows else None)


@task(cache_policy=NO_CACHE, task_run_name="judge-{turn_id}")
def judge_one(config_path: str | None, turn_id: str, retries: int) -> str:
    """Judge one turn and append its records; raises (-> Prefect retry) while attempts remain."""
    s, judge, row = _pending_turn(config_path, turn_id)
    if row is None:
        return "already_judged"
    outcome = runtime.run(judge.judge(turn_from_row(row), next_state_from_row(row)))
    if outcome.failed and task_run.get_run_count() <= retries:
        raise JudgeAttemptFailed(f"turn {turn_id}: {outcome.verdict.error if outcome.verdict else 'failed'}")
    _append_outcome(s, outcome_records(outcome))
    return outcome.fate.fate


@task(cache_policy=NO_CACHE)
def record_judge_error(config_path: str | None, turn_id: str, error: str) -> str:
    """The last attempt raised: keep the turn with fate judge_error and the error text."""
    s, judge, row = _pending_turn(config_path, turn_id)
    if row is None:
        return "already_judged"
    _append_outcome(s, failure_records(turn_from_row(row), judge, error))
    return "judge_error"


@task(cache_policy=NO_CACHE)
def count_pending(config_path: str | None, judge_config_hash: str) -> dict[str, Any]:
    s = load_flow_settings(config_path)
    data_store(s).flush()
    with open_catalog(s.storage.data_root) as con:
        return pending_counts(con, judge_config_hash, s.ppo.rollout_batch_size)


@task(cache_policy=NO_CACHE)
def check_live_score(config_path: str | None, judge_config_hash: str) -> dict[str, Any] | None:
    """The live check (``[gate] live_rollback``): when the champion's judged live score dropped
    significantly below the previous champion's, serve the previous one again (the usual sync, no
    request refused) and record the rollback with its evidence."""
    from clawrl.lineage import set_policy_alias
    from clawrl.promotion import check_live, record_manual
    from clawrl.records import PromotionAction

    s = load_flow_settings(config_path)
    g = s.gate
    if not (g.enabled and g.live_rollback):
        return None
    data_store(s).flush()
    found = check_live(s.storage.data_root, judge_config_hash, tolerance=g.live_tolerance, alpha=g.alpha,
                       min_n=g.live_min_turns)
    if found is None or not found["rollback"]:
        return found
    log = get_run_logger()
    target = serve_target(s, found["previous"])
    synced = push_weights(s, target, None)
    found["sync"] = synced
    if not synced["success"]:
        log.error("live rollback from version %s to %s failed, still serving %s: %s", found["champion"],
                  found["previous"], synced["weight_version"], synced["message"])
        return found
    record_manual(data_store(s), s.storage.data_root, action=PromotionAction.ROLLBACK, version=found["previous"],
                  source="live", reason=f"live score of version {found['champion']} {found['reason']}",
                  mlflow_run_id=target["mlflow_run_id"], live={**found, "tolerance": g.live_tolerance, "alpha": g.alpha})
    set_policy_alias(s.storage.data_root, "champion", found["previous"])
    log.warning("live rollback: serving version %s again, not %s: %s", found["previous"], found["champion"],
                found["reason"])
    return found


def _judge_run_name() -> str:
    return f"judge-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


@flow(name="judge", flow_run_name=_judge_run_name, log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def judge_flow(config_path: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """Judge every turn that is ready (at most ``limit``, default ``[prm] batch_limit``)."""
    log = get_run_logger()
    s = load_flow_settings(config_path)
    judge = judge_for(s)
    turn_ids = find_turns(config_path, judge.config_hash, limit or s.prm.batch_limit)
    _crash_point("found")
    log.info("%d turns to judge (judge config %s, backend %s)", len(turn_ids), judge.config_hash, s.prm.backend)
    one = judge_one.with_options(retries=s.prm.retries, retry_delay_seconds=exponential_backoff(s.prm.retry_delay_s))
    fates: Counter[str] = Counter()
    for i in range(0, len(turn_ids), s.prm.max_in_flight):  # at most max_in_flight in flight
        batch = turn_ids[i : i + s.prm.max_in_flight]
        for tid, future in zip(batch, [one.submit(config_path, tid, s.prm.retries) for tid in batch]):
            fate = future.result(raise_on_failure=False)
            if isinstance(fate, BaseException):  # every attempt raised: record it, go on with the rest
                log.warning("turn %s failed after %d retries: %s", tid, s.prm.retries, fate)
                fate = record_judge_error(config_path, tid, f"{type(fate).__name__}: {fate}")
            fates[fate] += 1
    _crash_point("judged")
    counts = count_pending(config_path, judge.config_hash)
    _crash_point("counted")
    log.info("fates this run: %s; trainable samples %d / rollout_batch_size %d", dict(fates), counts["trainable"],
             counts["rollout_batch_size"])
    live = check_live_score(config_path, judge.config_hash)
    if counts["full_batches"] > 0:
        emit_event(event=SAMPLES_READY_EVENT, resource={"prefect.resource.id": f"clawrl.samples.{judge.config_hash}"},
                   payload={"trainable": counts["trainable"], "judge_config_hash": judge.config_hash})
        _crash_point("emitted")
    return {"judged": len(turn_ids), "fates": dict(fates), "judge_config_hash": judge.config_hash, "status": counts,
            "live": live}
