"""`clawrl up` as a subprocess for end-to-end tests: free ports, the command, simulated users (waiting on it:
:func:`tests.utils.waiting.wait_until` with ``proc`` and ``log``)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from tests.utils.waiting import wait_until


REPO = Path(__file__).resolve().parents[2]


def ports(n):
    """``n`` free ports, the first for the gateway: its engines' ports ([server] api_port + 10, 21, 22, 23) are
    free too and none of the others."""
    from clawrl.config import PORT_OFFSETS
    from clawrl.ports import free_api_port, free_ports

    api = free_api_port()
    return [api, *free_ports(n - 1, avoid=[api + o for o in PORT_OFFSETS.values()])]


def up(conf: Path, ports, log: Path, *extra: str) -> subprocess.Popen:
    gw, pf, ml, tr, _ = ports
    return subprocess.Popen(
        [sys.executable, "-m", "clawrl.cli", "up", "-c", str(conf), "--prefect-port", str(pf), "--mlflow-port",
         str(ml), "--trainer-port", str(tr), "--judge-every", "8", "--train-every", "15", *extra],
        cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_healthy(svc) -> None:
    """A service of `clawrl up` a test started with ``clawrl.supervisor.start``: until its health URL answers
    200, for as long as it makes progress (the supervisor's own wait has a fixed budget)."""
    wait_until(lambda: httpx.get(svc.health_url, timeout=10).status_code == 200, f"{svc.name} healthy",
               proc=svc.proc, log=svc.log_path, poll_s=0.5)


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `clawrl up`; SIGKILL if it has not stopped within 90 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


class Traffic:
    """Simulated users: ask, then react; every turn the gateway acknowledged is remembered."""

    def __init__(self, base_url: str, tag: str, pause_s: float = 1.0):
        # a pause between each user's sessions: three users that never wait keep both cores of a small
        # machine busy with serving, and the judge, the trainer and the gate under test crawl
        self.base_url, self.tag, self.pause_s = base_url, tag, pause_s
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
                time.sleep(0.5)  # pacing: the gateway is down, nothing acknowledged; try again
            n += 1
            self.stop.wait(self.pause_s)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


