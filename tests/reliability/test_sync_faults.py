"""Weight-sync faults against a real `clawrl engine` process, pushed by the real train flow:

(a) a corrupt checkpoint (bytes garbled after the trainer recorded them; then truncated),
(b) an engine that refuses the load (the checkpoint path is not there when it loads: the engine
    answers ``success: false``),
(c) an engine SIGKILLed while it is paused and loading, then restarted.

Each time: the engine keeps serving the previous weight_version (requests succeed and report it;
after (c) the restarted engine serves the last version synced successfully); the failure shows in
`clawrl status`, in the ``clawrl.sync`` log at ERROR and on the step's MLflow run; a ``syncs`` row
records every attempt; and the next sync (the next step's, or `clawrl sync` retrying the same
checkpoint) succeeds.

The engine is `clawrl engine --resume` run in a child forked from a pre-imported parent
(tests/utils/fork_runner.py). Its only test seam wraps the checkpoint load: while a ``block`` file
exists the load announces itself (``reached``) and waits for ``go``, so the test acts at a known
point of a real update (the engine is paused, its update request in flight). Nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from clawrl.config import dump_toml, load_settings
from clawrl.lineage import client as mlflow_client
from clawrl.ports import free_port
from clawrl.storage.catalog import run_query
from tests.utils.fork_runner import shared_fork_runner
from tests.utils.gateway_process import listening
from tests.utils.samples import write_samples
from tests.utils.waiting import HANG_S, wait_until

pytestmark = [pytest.mark.reliability]

PROMPT = [1, 42, 7, 99, 512, 3]

ENGINE_CHILD = """
    import pathlib, time
    import clawrl.engine.embedded as emb
    from clawrl.cli import app

    gate = pathlib.Path({gate!r})
    load = emb.load_checkpoint_tensors

    def gated(model_dir, model):  # the test seam: announce the load, hold it while `block` exists
        if (gate / "block").exists():
            (gate / "reached").write_text(str(model_dir))
            while not (gate / "go").exists():
                time.sleep(0.02)
            for name in ("go", "block", "reached"):
                (gate / name).unlink(missing_ok=True)
        return load(model_dir, model)

    emb.load_checkpoint_tensors = gated
    app(["engine", "--port", "{port}", "--config", {conf!r}, "--resume"])
"""


class EngineProcess:
    """`clawrl engine --resume` in a forked child; ``kill`` is a SIGKILL."""

    def __init__(self, runner, conf: Path, port: int, gate: Path):
        self.runner, self.conf, self.port, self.gate = runner, conf, port, gate
        self.url = f"http://127.0.0.1:{port}"
        self.pid: int | None = None
        self.log: Path | None = None
        self.starts = 0

    def start(self) -> float:
        t0 = time.monotonic()
        self.pid, self.log = self.runner.spawn(ENGINE_CHILD.format(gate=str(self.gate), port=self.port,
                                                                   conf=str(self.conf)), f"engine{self.starts}")
        self.starts += 1
        wait_until(lambda: httpx.get(self.url + "/health", timeout=10).status_code == 200, "the engine healthy",
                   proc=self.pid, log=self.log)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = None
            wait_until(lambda: not listening(self.port), "the killed engine's port to close")

    def waiting_requests(self) -> int:
        return httpx.get(self.url + "/v1/loads", timeout=30).json()["loads"][0]["num_waiting_reqs"]

    def version(self) -> str:
        return str(httpx.get(self.url + "/model_info", timeout=30).json()["weight_version"])

    def generate(self, timeout: float = 300.0) -> tuple[int, str | None]:
        """(status, weight_version that produced the tokens) of one greedy request."""
        r = httpx.post(self.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.0}}, timeout=timeout)
        return r.status_code, (r.json()["meta_info"]["weight_version"] if r.status_code == 200 else None)


def test_sync_without_any_engine_is_a_skipped_failure_that_says_why():
    import asyncio

    from clawrl.sync import sync_checkpoint

    rep = asyncio.run(sync_checkpoint("3", "/no/such/checkpoint", "0" * 64))
    assert (rep.success, rep.skipped, rep.target, rep.weight_version) == (False, True, None, None)
    assert rep.message == ("no serving engine to sync (none in this process, no [engine] url and no "
                           "`clawrl serve` is running on this data root)")


@pytest.fixture(scope="module")
def sync_env(prefect_harness, tmp_path_factory, model_cache):
    from prefect.settings import PREFECT_API_URL

    base = tmp_path_factory.mktemp("sync-faults")
    port = free_port()
    s = load_settings(env={}, overrides={
        "storage.data_root": str(base / "data"), "storage.model_cache": str(model_cache), "model.name": "tiny",
        "engine.url": f"http://127.0.0.1:{port}", "engine.max_context_len": 512,
        "engine.stall_timeout_s": 60, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
        "ppo.kl_coef": 0.0, "ppo.lr": 1e-3})
    conf = base / "clawrl.toml"
    conf.write_text(dump_toml(s))
    write_samples(s, 12)  # 6 batches: more than every test together needs
    gate = base / "gate"
    gate.mkdir()
    runner = shared_fork_runner({**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}, base / "logs")
    engine = EngineProcess(runner, conf, port, gate)
    startup = engine.start()
    try:
        yield {"s": s, "conf": conf, "engine": engine, "gate": gate, "startup_s": [startup]}
    finally:
        engine.kill()


def _train_step(conf: Path) -> dict:
    from clawrl.flows.train import train_flow

    [step] = train_flow(config_path=str(conf), max_steps=1)["steps"]
    return step


def _status(conf: Path) -> str:
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status", "--config", str(conf)])
    assert res.exit_code == 0, res.output
    return [line for line in res.output.splitlines() if line.startswith("last sync:")][0]


def _cli_sync(conf: Path) -> tuple[int, str]:
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["sync", "--config", str(conf)])
    return res.exit_code, res.output


def _newest_checkpoint(s) -> Path:
    [row] = run_query(s.storage.data_root, "SELECT path FROM checkpoints ORDER BY step DESC LIMIT 1").to_pylist()
    return Path(row["path"])


def _syncs(s) -> list[dict]:
    return run_query(s.storage.data_root, "SELECT * FROM syncs ORDER BY created_at").to_pylist()


def _mlflow(s, run_id: str) -> tuple[dict, list[float]]:
    c = mlflow_client(s.storage.data_root)
    return c.get_run(run_id).data.tags, [m.value for m in c.get_metric_history(run_id, "sync_ok")]


@pytest.fixture
def sync_log():
    """ERROR records of the ``clawrl.sync`` logger (a handler on that logger itself: Prefect
    reconfigures the root logger's handlers when a flow starts)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("clawrl.sync")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _sync_errors(records, version: str) -> list[str]:
    return [r.getMessage() for r in records if f"version {version} failed" in r.getMessage()]


def _ensure_serving_a_trained_version(env) -> str:
    engine = env["engine"]
    if engine.version() == "0":
        step = _train_step(env["conf"])
        assert step["sync"]["success"], step["sync"]
    return engine.version()


class DuringLoad:
    """Runs ``action`` once the engine announces the held load, with a request sent meanwhile (it
    waits behind the pause); ``release`` lets the load go on."""

    def __init__(self, env, action, release: bool):
        self.env, self.action, self.release = env, action, release
        self.request: tuple | None = None
        self.error: BaseException | None = None
        (env["gate"] / "block").touch()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        gate, engine = self.env["gate"], self.env["engine"]
        try:
            wait_until(lambda: (gate / "reached").exists(), "the engine to reach the weight load", proc=engine.pid,
                       log=engine.log)
            holder = threading.Thread(target=self._request, daemon=True)
            holder.start()
            wait_until(lambda: engine.waiting_requests() >= 1, "the request held by the pause", proc=engine.pid,
                       log=engine.log)
            self.action()
            if self.release:
                (gate / "go").touch()
            wait_until(lambda: not holder.is_alive(), "the held request's answer")
        except BaseException as e:  # reported by join()
            self.error = e

    def _request(self):
        try:
            self.request = self.env["engine"].generate()
        except httpx.HTTPError as e:
            self.request = ("error", type(e).__name__)

    def join(self):
        wait_until(lambda: not self.thread.is_alive(), "the action during the load")
        if self.error:
            raise self.error


@pytest.mark.timeout(HANG_S)
def test_corrupt_checkpoint_is_refused_before_the_engine_and_the_next_step_is_served(sync_env, monkeypatch, sync_log):
    import clawrl.flows.train as ft

    s, conf, engine = sync_env["s"], sync_env["conf"], sync_env["engine"]
    before = _ensure_serving_a_trained_version(sync_env)
    attempts = len(_syncs(s))

    def garble(point):  # after the checkpoint is recorded, before the sync: flip bytes mid-file, same size
        if point == "recorded":
            f = _newest_checkpoint(s) / "model.safetensors"
            data = bytearray(f.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
            f.write_bytes(bytes(data))

    monkeypatch.setattr(ft, "_crash_point", garble)
    step = _train_step(conf)
    monkeypatch.undo()
    bad = step["weight_version"]
    assert not step["sync"]["success"] and "corrupt" in step["sync"]["message"], step["sync"]
    assert step["sync"]["weight_version"] == before  # the engine was never paused or touched
    assert engine.version() == before and engine.generate() == (200, before)
    line = _status(conf)
    assert "FAILED" in line and f"version {bad}" in line and "corrupt" in line, line
    assert f"serving version {before}" in line and f"checkpoint {bad} waiting" in line, line
    assert _sync_errors(sync_log, bad), [r.getMessage() for r in sync_log]
    tags, oks = _mlflow(s, step["mlflow_run_id"])
    assert tags["sync_status"] == "failed" and "corrupt" in tags["sync_error"] and oks == [0.0]
    from clawrl.checkpoint import CheckpointError
    from clawrl.train.trainer import trainer_from_settings

    with pytest.raises(CheckpointError, match="corrupt"):  # nor would a restarted trainer resume from it
        trainer_from_settings(s)
    # retrying the same checkpoint cannot help: still refused, still nothing loaded; truncated too
    f = Path(step["path"]) / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    code, out = _cli_sync(conf)
    assert code == 1 and "FAILED" in out and "corrupt" in out and engine.version() == before, out
    # the next step (trained from the trainer's good in-memory weights) is served
    nxt = _train_step(conf)
    assert nxt["sync"]["success"] and engine.version() == nxt["weight_version"], nxt["sync"]
    assert engine.generate() == (200, nxt["weight_version"])
    line = _status(conf)
    assert line.startswith("last sync: ok") and f"serving version {nxt['weight_version']}" in line, line
    rows = _syncs(s)[attempts:]
    assert [(r["weight_version"], r["ok"]) for r in rows] == [(bad, False), (bad, False), (nxt["weight_version"], True)]
    assert all("corrupt" in r["error"] for r in rows[:2]) and rows[0]["serving_version"] == before
    print(f"\n(a) corrupt v{bad}: 2 attempts refused (garbled, truncated), engine stayed on v{before}, "
          f"v{nxt['weight_version']} served next; requests failed 0")


@pytest.mark.timeout(HANG_S)
def test_engine_refusing_the_load_keeps_serving_and_a_retry_succeeds(sync_env, sync_log):
    s, conf, engine = sync_env["s"], sync_env["conf"], sync_env["engine"]
    before = _ensure_serving_a_trained_version(sync_env)
    attempts = len(_syncs(s))
    moved: list[Path] = []

    def hide_checkpoint():  # the path is not there when the engine loads it (storage not mounted there)
        src = _newest_checkpoint(s)
        moved.append(src)
        src.rename(src.with_name(src.name + ".offline"))

    during = DuringLoad(sync_env, hide_checkpoint, release=True)
    step = _train_step(conf)
    during.join()
    bad = step["weight_version"]
    assert not step["sync"]["success"] and "not a directory" in step["sync"]["message"], step["sync"]
    assert step["sync"]["weight_version"] == before
    assert during.request == (200, before)  # held by the pause, then served on the old weights
    assert engine.version() == before and engine.generate() == (200, before)
    line = _status(conf)
    assert "FAILED" in line and "not a directory" in line and f"serving version {before}" in line, line
    assert f"checkpoint {bad} waiting" in line, line
    assert _sync_errors(sync_log, bad), [r.getMessage() for r in sync_log]
    tags, oks = _mlflow(s, step["mlflow_run_id"])
    assert tags["sync_status"] == "failed" and "not a directory" in tags["sync_error"] and oks == [0.0]
    # the lineage logged after the sync could not reach the checkpoint either: left for the next train run
    from clawrl.lineage import runs_without_model_version

    assert runs_without_model_version(s.storage.data_root, [step["mlflow_run_id"]]) == [step["mlflow_run_id"]]
    # the storage is back: retrying the same checkpoint succeeds
    moved[0].with_name(moved[0].name + ".offline").rename(moved[0])
    code, out = _cli_sync(conf)
    assert code == 0 and "synced" in out and engine.version() == bad, out
    assert engine.generate() == (200, bad)
    tags, oks = _mlflow(s, step["mlflow_run_id"])
    assert tags["sync_status"] == "ok" and "sync_error" not in tags and oks == [0.0, 1.0]
    assert [(r["weight_version"], r["ok"]) for r in _syncs(s)[attempts:]] == [(bad, False), (bad, True)]
    print(f"\n(b) engine refused v{bad}: served v{before} meanwhile (held request answered by v{before}), "
          f"retry of the same checkpoint served v{bad}; requests failed 0")


@pytest.mark.timeout(HANG_S)
def test_engine_killed_mid_update_restarts_on_the_last_good_version_and_the_retry_succeeds(sync_env, sync_log):
    s, conf, engine = sync_env["s"], sync_env["conf"], sync_env["engine"]
    before = _ensure_serving_a_trained_version(sync_env)
    attempts = len(_syncs(s))

    def kill_engine():  # paused, its update request in flight, the weights being read
        engine.kill()
        for name in ("block", "reached"):
            (sync_env["gate"] / name).unlink(missing_ok=True)

    during = DuringLoad(sync_env, kill_engine, release=False)
    step = _train_step(conf)
    during.join()
    bad = step["weight_version"]
    assert not step["sync"]["success"] and step["sync"]["weight_version"] is None, step["sync"]
    assert during.request[0] == "error"  # a request held by the dead engine's pause cannot be answered
    line = _status(conf)
    assert "FAILED" in line and f"version {bad}" in line and "unknown" in line, line
    assert _sync_errors(sync_log, bad), [r.getMessage() for r in sync_log]
    tags, oks = _mlflow(s, step["mlflow_run_id"])
    assert tags["sync_status"] == "failed" and tags["sync_serving_version"] == "unknown" and oks == [0.0]

    sync_env["startup_s"].append(engine.start())  # `clawrl engine --resume`
    assert engine.version() == before and engine.generate() == (200, before)  # the last good version
    code, out = _cli_sync(conf)  # the retry of the same checkpoint
    assert code == 0 and engine.version() == bad and engine.generate() == (200, bad), out
    assert [(r["weight_version"], r["ok"], r["serving_version"]) for r in _syncs(s)[attempts:]] == [
        (bad, False, None), (bad, True, bad)]
    print(f"\n(c) engine SIGKILLed while loading v{bad}: restarted on v{before} (last good) in "
          f"{sync_env['startup_s'][-1]:.1f} s, retry served v{bad}")
