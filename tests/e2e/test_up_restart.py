"""`clawrl up` for real, killed with SIGKILL mid-traffic and started again: no acknowledged turn is
lost, no batch is consumed twice, and training resumes from the last checkpoint."""

import json
import os
import signal

import httpx
import pytest

from clawrl.storage.catalog import run_query
from tests.utils.up_process import Traffic, stop
from tests.utils.up_process import ports as _ports
from tests.utils.up_process import up as _up
from tests.utils.waiting import wait_until


@pytest.mark.slow
def test_kill_9_and_up_again_resumes_exactly(tmp_path, model_cache):
    data = tmp_path / "data"
    ports = _ports(5)
    conf = tmp_path / "up.toml"
    conf.write_text(f"""
[model]
name = "tiny"
[server]
open_mode = true
api_port = {ports[0]}
[storage]
data_root = "{data}"
model_cache = "{model_cache}"
[ppo]
rollout_batch_size = 2
max_new_tokens = 6
lr = 1e-4
max_staleness = 100
[gate]
# a small evaluation set: the gate is not what this test is about
size = 4
""")
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{ports[0]}/v1"
    ckpt = lambda v: (data / "checkpoints" / f"v{v:06d}" / "trainer.json").is_file()  # noqa: E731
    up = _up(conf, ports, log)
    try:
        wait_until(lambda: httpx.get(base + "/models", timeout=10).status_code == 200, "the gateway", proc=up, log=log)
        # waits on progress, not time: on two cores a step's gate evaluation, MLflow lineage and doctor report
        # share the CPU with the judge, both engines and the users (70 s for the gate alone under that load)
        with Traffic(base, "before") as before:
            wait_until(lambda: ckpt(1), "a first training step", proc=up, log=log)
            pids = json.loads((data / "up.pids.json").read_text())
            assert "judge-engine" in pids  # the frozen teacher stays loaded between judge runs
            os.kill(pids["gateway"], signal.SIGKILL)  # mid-traffic
            os.kill(pids["trainer"], signal.SIGKILL)
            wait_until(lambda: up.poll() is not None, "up to stop the rest", proc=up, log=log)  # the supervisor notices
        up = _up(conf, ports, log)
        wait_until(lambda: httpx.get(base + "/models", timeout=10).status_code == 200, "the gateway again", proc=up,
                   log=log)
        with Traffic(base, "after") as after:
            last = max(int(p.name[1:]) for p in (data / "checkpoints").glob("v0*") if (p / "trainer.json").exists())
            wait_until(lambda: ckpt(last + 1), "a training step after the restart", proc=up, log=log)
            # the gateway's version and the champion read together, once the new step's gate and sync are
            # through: read apart, a train run finishing in between (runs are threads of the flow server
            # and take seconds) would make them disagree without anything being wrong
            pair = {}
            wait_until(lambda: pair.update(served=_served(base), champion=_champion(data))
                       or pair["served"] == pair["champion"], "the champion served", proc=up, log=log)
            served, champion = pair["served"], pair["champion"]
    finally:
        stop(up)
    acked = before.acked + after.acked
    assert len(before.acked) >= 2 and len(after.acked) >= 2
    rows = run_query(data, "select session_id, turn_index, count(*) as n from turns group by all").to_pylist()
    stored = {(r["session_id"], r["turn_index"]): r["n"] for r in rows}
    assert [a for a in acked if a not in stored] == []  # no acknowledged turn lost
    assert all(n == 1 for n in stored.values())
    used = [sid for b in run_query(data, "select sample_ids from batches").to_pylist() for sid in b["sample_ids"]]
    assert len(used) == len(set(used))  # no sample consumed twice
    steps = run_query(data, "select step, parent_version from checkpoints order by step").to_pylist()
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    after_restart = json.loads((data / "checkpoints" / f"v{last + 1:06d}" / "trainer.json").read_text())
    assert after_restart["parent_version"] == str(last)  # resumed from the last checkpoint, not from scratch
    assert served == champion  # the restarted gateway serves the gate's champion, never a refused candidate


def _served(base: str) -> str:
    return httpx.get(base + "/models", timeout=5).json()["data"][0]["weight_version"]


def _champion(data) -> str:
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion

    with open_catalog(data, private=True) as con:
        return current_champion(con)
