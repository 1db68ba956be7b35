"""The trainer slot survives a restart of `clawrl up`'s Prefect server: a real `prefect server start`,
started as `clawrl up` starts it, is killed with SIGKILL while a run holds the slot and started again.

With Prefect's default lease storage (memory) the lease is gone after the restart while the slot
stays counted as taken, so releasing it fails and no run trains again. `clawrl up` keeps the leases
on disk: the holder renews and releases its lease after the restart, and the slot is free again."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from clawrl.config import child_env
from clawrl.supervisor import plan, start
from tests.utils.up_process import ports, wait_healthy
from tests.utils.waiting import HANG_S

LIMIT = "trainer"


def _prefect(s, conf, p, home):
    [svc] = [x for x in plan(s, conf, prefect_port=p[0], mlflow_port=p[1], trainer_port=p[2]) if x.name == "prefect"]
    start(svc, home / "logs", child_env(PREFECT_HOME=str(home)))
    wait_healthy(svc)
    return svc


def _kill(svc) -> None:
    os.killpg(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(30)


@pytest.mark.timeout(HANG_S)
def test_a_slot_held_across_a_prefect_restart_is_released(make_settings, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clawrl.flows.slots import leased_slot

    s = make_settings({})
    conf, home, p = tmp_path / "c.toml", tmp_path / "prefect-home", ports(3)
    conf.write_text("")
    svc = _prefect(s, conf, p, home)
    holder = contextlib.ExitStack()
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{p[0]}/api"}):
            assert holder.enter_context(leased_slot(LIMIT)) is True
            [lease_file] = [f for f in (home / "concurrency_leases").glob("*.json") if f.name != "expirations.json"]
            assert json.loads(lease_file.read_text())["metadata"]["slots"] == 1
            _kill(svc)  # the server dies with the slot taken
            svc = _prefect(s, conf, p, home)
            with leased_slot(LIMIT) as got:
                assert got is False  # still held: the holder is alive and its lease is known
            holder.close()  # the holder ends: it releases its lease on the restarted server
            assert not lease_file.exists()
            with leased_slot(LIMIT) as got:
                assert got is True  # free again
    finally:
        holder.close()
        _kill(svc)
