"""Prefect flow `judge`: turns with a next state -> verdicts, samples and fates, exactly once.

Thin orchestration over clawrl.judge.runner and storage/. The turns are judged in chunks, one task
each (4 x ``MAX_IN_FLIGHT`` turns, judged ``MAX_IN_FLIGHT`` = 16 at once, no global lock): one
catalog read and two writes per chunk, not per turn, which is what lets the judge keep up with live
traffic. A turn whose judge failed is judged again, alone, with exponential backoff, up to ``[prm]
retries`` times; one that still fails is recorded with fate ``judge_error`` (raw outputs kept) and
the other turns go on. Exactly once per (turn, judge-config hash): a turn is judged when its fate
row exists, the fates are written last, and sample ids are deterministic, so a rerun or a crash half
way neither duplicates nor loses a judgment. When enough trainable samples wait, the flow emits the
event ``clawrl.samples.ready`` and, run exclusive (as ``clawrl up`` runs it), creates a run of the train
deployment unless one is scheduled or going. An exclusive run judges a bite of the ready turns (below);
one that took a full bite, more being ready, creates the next judge run as it ends, so a backlog is
judged in consecutive runs rather than one bite every ``--judge-every`` seconds. Last, the live check
(``check_live_score``) compares the judged live score of the champion with the previous champion's
and rolls serving back on a significant drop.

With ``exclusive`` (the ``judge/on-interval`` deployment sets it), a run first takes the slot of
Prefect's global concurrency limit ``judge`` (1 slot) without waiting; a run that finds it taken
judges nothing and ends Completed at once, returning ``skipped`` (which judge run is still going).
The slot is leased: a run killed while holding it stops renewing the lease, and the slot frees
itself a minute later (``clawrl.flows.slots``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from clawrl import runtime
from clawrl.config_sections import LIVE_MIN_TURNS, LIVE_TOLERANCE
from clawrl.flows.common import data_store, judge_for, load_flow_settings, push_weights, serve_target
from clawrl.flows.slots import (JUDGE_DEPLOYMENT, JUDGE_LIMIT, TRAIN_DEPLOYMENT, ensure_limit, leased_slot, mark_idle,
                                run_time_name, skipped_because, this_run_id, tick)
from clawrl.judge.runner import failure_records, next_state_from_row, outcome_records, turn_from_row
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import pending_counts, turns_to_judge

SAMPLES_READY_EVENT = "clawrl.samples.ready"
# Turns judged at once (each a few engine calls; no global lock), and per judging task this many times
# that (one catalog read and two writes a task). A turn whose judge failed is judged again up to RETRIES
# times, RETRY_DELAY_S x 2^attempt apart, before its fate is judge_error.
MAX_IN_FLIGHT, _CHUNK_PER_SLOT = 16, 4
RETRIES, RETRY_DELAY_S = 2, 1.0
# An exclusive run (`clawrl up`'s, which starts a train run when it leaves a full batch) takes at most
# BITE_BATCHES training batches' worth of judge calls (at least MIN_BITE), with the turns only marked
# (side turns, turns told no next state comes) among them uncounted: they cost no judge call. A backlog
# is taken in bites, so the next train step starts soon, and a run that took a full bite starts the next
# at once. A direct run (`clawrl judge`, the demo's loop, which trains right after it) takes every ready
# turn: a bite there leaves part of a round unjudged, the next step trains on older samples than its
# users just made, and the lag grows each round.
BITE_BATCHES, MIN_BITE = 4, 64


def _crash_point(name: str) -> None:
    """No-op; the crash tests replace it to SIGKILL the process at this point."""


def _append_outcomes(s, outcomes: list[list[Any]]) -> None:
    """Every turn's verdict (and sample) first, then every fate in a write of its own: a turn counts
    as judged once its fate is stored, so a crash in between leaves uncommitted attempts that the
    next run judges again (their verdicts and samples supersede these: storage/catalog.py)."""
    body = [r for records in outcomes for r in records[:-1]]
    if body:
        data_store(s).append(body)
        _crash_point("verdict_written")
    if outcomes:
        data_store(s).append([records[-1] for records in outcomes])
        _crash_point("fate_written")


@task(cache_policy=NO_CACHE)
def find_turns(config_path: str | None, judge_config_hash: str, limit: int | None,
               bite: int | None) -> tuple[list[str], bool]:
    """(the ready turns to judge now, oldest first; whether more judge calls were ready than ``bite``): every
    ready turn, at most ``limit``, or a ``bite``: at most that many judge calls, the turns only marked that
    come before the next one uncounted."""
    with open_catalog(load_flow_settings(config_path).storage.data_root) as con:
        found = turns_to_judge(con, judge_config_hash, limit=limit, judge_calls=None if bite is None else bite + 1)
    turn_ids = found.column("turn_id").to_pylist()
    calls = [i for i, call in enumerate(found.column("judge_call").to_pylist()) if call]  # where the judge is called
    if bite is None or len(calls) <= bite:
        return turn_ids, False
    return turn_ids[:calls[bite]], True  # the call past the bite waits, with what follows it


def _pending_turns(config_path: str | None, turn_ids: list[str]):
    """(settings, judge, the rows of those turns that have no fate under this config yet)."""
    s = load_flow_settings(config_path)
    judge = judge_for(s)
    with open_catalog(s.storage.data_root) as con:
        rows = turns_to_judge(con, judge.config_hash, turn_ids=turn_ids).to_pylist()
    return s, judge, rows


async def _judge_rows(judge, rows: list[dict[str, Any]], in_flight: int) -> list[Any]:
    """Each row's JudgeOutcome, or the exception its judge raised; at most ``in_flight`` at once."""
    slots = asyncio.Semaphore(in_flight)

    async def one(row):
        async with slots:
            return await judge.judge(turn_from_row(row), next_state_from_row(row))

    return await asyncio.gather(*(one(row) for row in rows), return_exceptions=True)


def _sort_results(judge, rows, results, last: bool) -> tuple[list[list[Any]], list[dict[str, Any]], list[str]]:
    """(records of the turns decided now, the rows to judge again, their errors): a turn whose judge
    failed or raised is judged again unless this was the ``last`` attempt, when it ends judge_error."""
    done, again, errors = [], [], []
    for row, result in zip(rows, results):
        error = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else None
        if error is not None and last:
            done.append(failure_records(turn_from_row(row), judge, error))
        elif error is not None or (result.failed and not last):
            again.append(row)
            errors.append(f"turn {row['turn_id']}: {error or (result.verdict and result.verdict.error) or 'failed'}")
        else:
            done.append(outcome_records(result))
    return done, again, errors


@task(cache_policy=NO_CACHE, task_run_name="judge-{label}")
def judge_turns(config_path: str | None, turn_ids: list[str], label: str) -> dict[str, int]:
    """Judge these turns (``MAX_IN_FLIGHT`` at once) and append their records in two writes per
    attempt. A turn whose judge failed or raised is judged again, alone, after an exponential backoff
    (``RETRY_DELAY_S`` x 2^attempt), up to ``RETRIES`` times; then it is recorded with fate
    judge_error and its error. Returns the count of each fate (``already_judged``: turns that
    had a fate under this config when the task started)."""
    log = get_run_logger()
    s, judge, rows = _pending_turns(config_path, turn_ids)
    fates = Counter({"already_judged": len(turn_ids) - len(rows)} if len(turn_ids) > len(rows) else {})
    for attempt in range(RETRIES + 1):
        results = runtime.run(_judge_rows(judge, rows, MAX_IN_FLIGHT))
        done, rows, errors = _sort_results(judge, rows, results, last=attempt == RETRIES)
        _append_outcomes(s, done)
        fates.update(records[-1].fate for records in done)
        if not rows:
            break
        delay = RETRY_DELAY_S * 2 ** attempt
        log.warning("%d turns failed (attempt %d of %d), e.g. %s; judging them again in %.1f s", len(rows),
                    attempt + 1, RETRIES + 1, errors[0], delay)
        time.sleep(delay)
    return dict(fates)


@task(cache_policy=NO_CACHE)
def record_judge_errors(config_path: str | None, turn_ids: list[str], error: str) -> dict[str, int]:
    """The judging task itself failed on its last attempt: keep its turns with fate judge_error and the error."""
    s = load_flow_settings(config_path)
    data_store(s).flush()  # the fates the failed task did write must be seen, or they are written twice
    s, judge, rows = _pending_turns(config_path, turn_ids)
    _append_outcomes(s, [failure_records(turn_from_row(row), judge, error) for row in rows])
    return {"judge_error": len(rows)} if rows else {}


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
    from clawrl.promotion import GateError, check_live, record_manual
    from clawrl.records import PromotionAction

    s = load_flow_settings(config_path)
    g = s.gate
    if not (g.enabled and g.live_rollback):
        return None
    data_store(s).flush()
    found = check_live(s.storage.data_root, judge_config_hash, tolerance=LIVE_TOLERANCE, alpha=g.alpha,
                       min_n=LIVE_MIN_TURNS)
    if found is None or not found["rollback"]:
        return found
    log = get_run_logger()
    try:
        target = serve_target(s, found["previous"])
    except GateError as e:  # its weights were pruned: nothing is tried, serving stays as it is
        log.error("live rollback from version %s to %s not possible: %s", found["champion"], found["previous"], e)
        return found
    synced = push_weights(s, target, None)
    found["sync"] = synced
    if not synced["success"]:
        log.error("live rollback from version %s to %s failed, still serving %s: %s", found["champion"],
                  found["previous"], synced["weight_version"], synced["message"])
        return found
    record_manual(data_store(s), s.storage.data_root, action=PromotionAction.ROLLBACK, version=found["previous"],
                  source="live", reason=f"live score of version {found['champion']} {found['reason']}",
                  mlflow_run_id=target["mlflow_run_id"], live={**found, "tolerance": LIVE_TOLERANCE, "alpha": g.alpha})
    set_policy_alias(s.storage.data_root, "champion", found["previous"])
    log.warning("live rollback: serving version %s again, not %s: %s", found["previous"], found["champion"],
                found["reason"])
    return found


def ensure_judge_limit() -> None:
    """The global concurrency limit `judge` (1 slot), created if this Prefect server lacks it."""
    ensure_limit(JUDGE_LIMIT)


def _judge_run_name() -> str:
    return run_time_name("judge")


def _start_run(deployment: str, why: str, config_path: str | None = None) -> None:
    """A run of ``deployment`` (`clawrl up`'s), unless one is scheduled or going; this run, which is ending,
    does not count. Outside `clawrl up` (no such deployment), nothing. The train deployment with ``[ppo]
    adapters = "namespace"``: one run per namespace with a batch (clawrl.flows.adapters)."""
    from prefect.exceptions import ObjectNotFound

    from clawrl.flows.adapters import start_train_runs

    try:
        if deployment == TRAIN_DEPLOYMENT:
            started = ", ".join(start_train_runs(config_path))
        else:
            started = tick(deployment, ending_run=this_run_id())
    except ObjectNotFound:  # judging outside `clawrl up`: nothing to start
        return
    except Exception as e:  # noqa: BLE001 - the ticker starts one later
        get_run_logger().warning("could not start a run of %s: %s", deployment, e)
        return
    get_run_logger().info("%s: %s", why, f"{deployment} run {started} created" if started else
                          f"a {deployment} run is already scheduled or going")


@flow(name="judge", flow_run_name=_judge_run_name, log_prints=True)
def judge_flow(config_path: str | None = None, limit: int | None = None, exclusive: bool = False) -> dict[str, Any]:
    """Judge every turn that is ready, at most ``limit`` (an ``exclusive`` run's default: a bite, ``BITE_BATCHES``
    x ``[ppo] rollout_batch_size`` judge calls, at least ``MIN_BITE``, and the turns only marked among them). With
    ``exclusive``, only while no other exclusive judge run is going, else it skips, Completed; one that took a full
    bite creates the next run of the judge deployment as it ends."""
    if not exclusive:
        return _judge_ready(config_path, limit)
    out = None
    with leased_slot(JUDGE_LIMIT) as held:
        if held:
            out = _judge_ready(config_path, limit, start_training=True)
    if out is not None:
        if out["full_bite"]:  # the slot given back: the next run takes it
            _start_run(JUDGE_DEPLOYMENT, "more turns wait than a bite")
        return out
    skipped = skipped_because("judge", JUDGE_LIMIT)
    get_run_logger().info("skipped: %s", skipped)
    mark_idle()
    return {"judged": 0, "fates": {}, "skipped": skipped}


def _judge_ready(config_path: str | None, limit: int | None, start_training: bool = False) -> dict[str, Any]:
    log = get_run_logger()
    s = load_flow_settings(config_path)
    judge = judge_for(s)
    bite = max(MIN_BITE, BITE_BATCHES * s.ppo.rollout_batch_size) if start_training and not limit else None
    turn_ids, full_bite = find_turns(config_path, judge.config_hash, limit, bite)
    _crash_point("found")
    log.info("%d turns to judge (judge config %s, backend %s)", len(turn_ids), judge.config_hash, s.prm.backend)
    fates: Counter[str] = Counter()
    size = _CHUNK_PER_SLOT * MAX_IN_FLIGHT
    for i in range(0, len(turn_ids), size):  # one task per chunk: one catalog read and two writes for all
        chunk = turn_ids[i : i + size]
        label = f"{i + 1}-{i + len(chunk)}-of-{len(turn_ids)}"
        got = judge_turns(config_path, chunk, label, return_state=True).result(raise_on_failure=False)
        if isinstance(got, BaseException):  # the task itself failed (not a judge: storage): record its turns, go on
            log.warning("judging turns %s failed: %s", label, got)
            got = record_judge_errors(config_path, chunk, f"{type(got).__name__}: {got}")
        fates.update(got)
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
        if start_training:
            _start_run(TRAIN_DEPLOYMENT, "a full batch waits", config_path)
    if not turn_ids:
        mark_idle()
    return {"judged": len(turn_ids), "fates": dict(fates), "judge_config_hash": judge.config_hash, "status": counts,
            "live": live, "full_bite": full_bite}
