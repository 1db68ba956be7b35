"""One run at a time without Cancelled clutter: a Prefect global concurrency slot taken without waiting.

A scheduled or triggered run that finds another run of its flow going should end quietly (Completed,
saying which run holds the slot), not pile up waiting processes and not end Cancelled as a
deployment's ``CANCEL_NEW`` limit makes it. :func:`leased_slot` takes the one slot of a global
concurrency limit at once or not at all. The slot is leased and renewed while its run lives: a run
killed while holding it stops renewing, and the slot frees itself ``LEASE_S`` seconds later
(Prefect's shortest lease).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from uuid import UUID

import httpx

LEASE_S = 60.0  # renewed while the run lives; how long a killed run's slot stays taken
JUDGE_LIMIT, TRAINER_LIMIT = "judge", "trainer"  # the global limits the exclusive runs take a slot of
JUDGE_DEPLOYMENT = "judge/on-interval"  # the deployments `clawrl up` serves (clawrl.flows.serve)
TRAIN_DEPLOYMENT = "train/on-samples-ready"
_LIMIT_OF = {JUDGE_DEPLOYMENT: JUDGE_LIMIT, TRAIN_DEPLOYMENT: TRAINER_LIMIT}
RUN_CREATED = threading.Event()  # set by tick: the flow server's in-process runner takes the new run at once

log = logging.getLogger(__name__)


def ensure_limit(name: str) -> None:
    """The global concurrency limit ``name`` (1 slot), created if this Prefect server lacks it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):  # created concurrently
        client.upsert_global_concurrency_limit_by_name(name, 1)


def this_run_id():
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None


def _renew_until(done: threading.Event, name: str, lease_id) -> None:
    """Renew the lease every third of its duration until ``done``; a failed renewal is logged and
    retried at the next turn (the work goes on: what it does is exactly-once whoever overlaps)."""
    from prefect.client.orchestration import get_client

    while not done.wait(LEASE_S / 3):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(lease_id, LEASE_S)
        except Exception as e:  # noqa: BLE001
            log.warning("renewing the `%s` lease failed: %s", name, e)


@contextlib.contextmanager
def leased_slot(name: str) -> Iterator[bool]:
    """The slot of limit ``name``, taken without waiting: True while this run holds it, False when another does."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    ensure_limit(name)
    me = this_run_id()
    holder = ConcurrencyLeaseHolder(type="flow_run", id=me) if me else None
    with get_client(sync_client=True) as client:
        try:
            got = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S, holder=holder)
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 423:  # 423 Locked: every slot is held
                raise
            got = None
    if got is None:
        yield False
        return
    lease_id, done = got.json()["lease_id"], threading.Event()
    renewer = threading.Thread(target=_renew_until, args=(done, name, lease_id), name=f"{name}-lease", daemon=True)
    renewer.start()
    try:
        yield True
    finally:
        done.set()
        renewer.join()
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease_id)
        except Exception as e:  # noqa: BLE001 - the run's work is done; the unrenewed lease lapses
            log.warning("releasing the `%s` slot failed (it frees itself within %g s): %s", name, LEASE_S, e)


def running_run(flow_name: str) -> str | None:
    """The name of another run of flow ``flow_name`` in state Running, or None (the slot's holder was killed)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    me = this_run_id()
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=FlowRunFilter(state=running, id=FlowRunFilterId(not_any_=[me]) if me else None), limit=1)
    return runs[0].name if runs else None


def skipped_because(flow_name: str, limit: str) -> str:
    """What a run that found the slot taken says: which run of its flow is still going."""
    other = running_run(flow_name)
    return f"{flow_name} run {other} is still going" if other else \
        f"another {flow_name} run holds the `{limit}` slot (a killed run's lease lapses within {LEASE_S:g} s)"


def tick(deployment: str, ending_run: UUID | None = None) -> str | None:
    """Create a run of ``deployment`` unless one of its runs is scheduled, pending or running; the new
    run's id, or None. A run created while another is going would only start, find the slot taken and
    skip (on a work pool, as a process of its own that imports torch). A run still marked Running while
    its deployment's slot is free died without being marked (its process was killed with the flow
    server's): it does not count, or nothing would run again. Nor does ``ending_run``, the id of a run
    that starts its successor as it ends, its slot given back."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    active = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING,
                                                                  StateType.RUNNING]))
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                                     flow_run_filter=FlowRunFilter(state=active))
        runs = [r for r in runs if r.id != ending_run]
        if runs and not (all(r.state.is_running() for r in runs) and _slot_free(client, _LIMIT_OF.get(deployment))):
            return None
        run_id = str(client.create_flow_run_from_deployment(dep.id).id)
    RUN_CREATED.set()
    return run_id


NAMESPACE_TAG = "namespace:"  # a train run of one namespace's adapter ([ppo] adapters = "namespace")


def trainer_limit(namespace: str) -> str:
    """The global concurrency limit that keeps one step of ``namespace``'s adapter at a time."""
    return f"trainer-{namespace}"


def tick_namespaces(deployment: str, namespaces: list[str]) -> list[str]:
    """A run of ``deployment`` for each of ``namespaces`` (parameter ``namespace``, tag ``namespace:<ns>``)
    unless one of that namespace's runs is scheduled, pending or running: the steps of different
    namespaces run at once, each holding its own slot (``trainer-<namespace>``). A run still marked
    Running while its namespace's slot is free died unmarked, as in :func:`tick`. The new runs' ids."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    if not namespaces:
        return []
    active = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING,
                                                                  StateType.RUNNING]))
    created = []
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                                     flow_run_filter=FlowRunFilter(state=active))
        busy = {tag.removeprefix(NAMESPACE_TAG): r for r in runs for tag in r.tags if tag.startswith(NAMESPACE_TAG)}
        for ns in namespaces:
            run = busy.get(ns)
            if run is not None and not (run.state.is_running() and _slot_free(client, trainer_limit(ns))):
                continue
            created.append(str(client.create_flow_run_from_deployment(
                dep.id, parameters={"namespace": ns}, tags=[NAMESPACE_TAG + ns]).id))
    if created:
        RUN_CREATED.set()
    return created


def _slot_free(client, limit: str | None) -> bool:
    if limit is None:
        return False
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_global_concurrency_limit_by_name(limit).active_slots == 0
    except ObjectNotFound:
        return True  # no run has taken a slot of it yet


IDLE_TAG = "idle"  # a run that found nothing to do: named <flow>-idle-<time> and tagged, out of the way in the UI


RUN_TIME = "%Y%m%d-%H%M%S"  # runs named for when they began: judge-<time>, <flow>-idle-<time>


def run_time_name(prefix: str) -> str:
    """``<prefix>-<UTC time>``: a run named for when it began."""
    return f"{prefix}-{datetime.now(timezone.utc):{RUN_TIME}}"


def idle_name(name: str) -> str:
    """The name of a run called ``name`` that found nothing to do: ``<flow>-idle-<what followed the flow's
    name>`` (``judge-idle-<time>``), but the time now for a run named for the version it was to make
    (``train-v4``); a name that says idle already stays."""
    flow, _, rest = name.partition("-")
    if rest.startswith("idle-"):
        return name
    if re.fullmatch(r"v\d+", rest):
        return run_time_name(f"{flow}-idle")
    return f"{flow}-idle-{rest}"


def mark_idle() -> None:
    """Name this flow run as :func:`idle_name` says and tag it ``idle``: it found nothing to do, and must not
    read like a run that judged or trained (filter the tag out in the UI's run list)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    run = ctx.flow_run
    with get_client(sync_client=True) as client:
        client.update_flow_run(run.id, name=idle_name(run.name), tags=[*run.tags, IDLE_TAG])
