"""`clawrl up` for real, killed with SIGKILL mid-traffic and started again: no acknowledged turn is
lost, no batch is consumed twice, and training resumes from the last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from clawrl.storage.catalog import run_query
from tests.utils.gateway_server import free_socket

REPO = Path(__file__).resolve().parents[2]


def _ports(n):
    socks = [free_socket() for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _up(conf: Path, ports, log: Path) -> subprocess.Popen:
    gw, pf, ml, tr, _ = ports
    return subprocess.Popen(
        [sys.executable, "-m", "clawrl.cli", "up", "-c", str(conf), "--prefect-port", str(pf), "--mlflow-port",
         str(ml), "--trainer-port", str(tr), "--judge-every", "8", "--train-every", "15"],
        cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_for(pred, timeout_s, what, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"clawrl up exited while waiting for {what}:\n{log.read_text()[-3000:]}")
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:] if log else ''}")


class Traffic:
    """Simulated users: ask, then react; every turn the gateway acknowledged is remembered."""

    def __init__(self, base_url: str, tag: str):
        self.base_url, self.tag = base_url, tag
        self.acked: list[tuple[str, int]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.user, args=(i,), daemon=True) for i in range(3)]

    def user(self, i: int) -> None:
        client = OpenAI(base_url=self.base_url, api_key="x", max_retries=0, timeout=60)
        n = 0
        while not self.stop.is_set():
            sid = f"{self.tag}-{i}-{n}"
            msgs = [{"role": "user", "content": f"question {n}"}]
            try:
                r = client.chat.completions.create(model="m", messages=msgs, extra_body={"session_id": sid})
                self.acked.append((sid, r.model_extra["turn_index"]))
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "thanks!" if n % 2 else "no, shorter please"}]
                r = client.chat.completions.create(model="m", messages=msgs,
                                                   extra_body={"session_id": sid, "session_done": True})
                self.acked.append((sid, r.model_extra["turn_index"]))
            except Exception:
                time.sleep(0.5)  # the gateway is down: nothing acknowledged
            n += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


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
[prm]
# short judge runs: the users below log tens of turns a second, and a judge run of the default 512
# turns takes minutes on two cores before its samples-ready event starts a training step
batch_limit = 64
# the judge engine (the combine method's frozen teacher), on a free port
engine_port = {ports[4]}
[gate]
# a small evaluation set: the gate is not what this test is about
size = 4
samples = 1
max_tokens = 8
""")
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{ports[0]}/v1"
    ckpt = lambda v: (data / "checkpoints" / f"v{v:06d}" / "trainer.json").is_file()  # noqa: E731
    up = _up(conf, ports, log)
    try:
        _wait_for(lambda: httpx.get(base + "/models", timeout=2).status_code == 200, 300, "the gateway", up, log)
        # generous waits: on two cores a step's gate evaluation, MLflow lineage and doctor report share the
        # CPU with the judge, both engines and the users (70 s for the gate alone under that load)
        with Traffic(base, "before") as before:
            _wait_for(lambda: ckpt(1), 480, "a first training step", up, log)
            pids = json.loads((data / "up.pids.json").read_text())
            assert "judge-engine" in pids  # the frozen teacher stays loaded between judge runs
            os.kill(pids["gateway"], signal.SIGKILL)  # mid-traffic
            os.kill(pids["trainer"], signal.SIGKILL)
            up.wait(60)  # the supervisor notices and stops the rest
        up = _up(conf, ports, log)
        _wait_for(lambda: httpx.get(base + "/models", timeout=2).status_code == 200, 300, "the gateway again", up, log)
        with Traffic(base, "after") as after:
            last = max(int(p.name[1:]) for p in (data / "checkpoints").glob("v0*") if (p / "trainer.json").exists())
            _wait_for(lambda: ckpt(last + 1), 480, "a training step after the restart", up, log)
        served = httpx.get(base + "/models").json()["data"][0]["weight_version"]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
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
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion

    with open_catalog(data, private=True) as con:
        champion = current_champion(con)
    assert served == champion  # the restarted gateway serves the gate's champion, never a refused candidate
