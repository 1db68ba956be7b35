"""`clawrl serve` records where it serves (``<data_root>/serve.json``); `clawrl train`, `clawrl sync`
and `clawrl status` on that data root find its embedded engine at ``{gateway}/engine`` without being
told, and say loudly which checkpoint waits, and the command that serves it, when nothing serves."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import httpx
import pytest
from typer.testing import CliRunner

from clawrl.config import dump_toml
from clawrl.records import CheckpointRecord
from clawrl.serving import SERVE_RECORD, serving_gateway, write_serve_record
from clawrl.storage.writer import DataStore
from tests.utils.gateway_process import ServerProcess, free_port, serve_env
from tests.utils.samples import write_samples
from tests.utils.waiting import HANG_S


def _status(conf) -> list[str]:
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status", "--config", str(conf)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    return res.output.splitlines()


def _line(lines: list[str], start: str) -> str | None:
    return next((x for x in lines if x.startswith(start)), None)


def _row(lines: list[str], label: str) -> str:
    """The status table's row of ``label`` as one line of words, the lines its cells wrap onto joined
    (the console may be narrower than the row: pytest-xdist's workers fix it at 80 columns)."""
    [start] = [i for i, x in enumerate(lines) if x.startswith(f"│ {label} ")]
    row = [lines[start]]
    for x in lines[start + 1:]:
        cells = x.split("│")
        if len(cells) < 3 or cells[1].strip():  # a border, or the next row's label
            break
        row.append(x)
    label_cells = [r.split("│")[1] for r in row]
    value_cells = ["│".join(r.split("│")[2:]) for r in row]
    return " ".join(" ".join(c.replace("│", " ") for c in label_cells).split()
                    + " ".join(c.replace("│", " ") for c in value_cells).split())


@pytest.mark.timeout(HANG_S)
def test_train_syncs_the_running_gateway_and_status_shows_what_waits_once_it_is_gone(
        prefect_harness, make_settings, tmp_path, model_cache, monkeypatch):
    from clawrl.cli import app
    from clawrl.flows.common import policy_engine
    from clawrl.flows.train import train_flow

    assert policy_engine() is None  # nothing in this process to sync: only serve.json says where
    port = free_port()
    s = make_settings({"server.open_mode": True, "server.api_port": port, "gate.enabled": False,
                       "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo", "ppo.kl_coef": 0.0,
                       "ppo.lr": 1e-3, "engine.max_context_len": 512})
    conf = tmp_path / "clawrl.toml"
    conf.write_text(dump_toml(s))
    write_samples(s, 4)  # two batches of two
    root = s.storage.data_root
    gw = ServerProcess(["serve", "-c", str(conf)], port, serve_env(root, model_cache), tmp_path / "serve.log")
    gw.start()
    try:
        gw.wait_ready()
        record = json.loads((root / SERVE_RECORD).read_text())
        assert {k: record[k] for k in ("pid", "gateway_url", "engine_url", "engine_kind")} == {
            "pid": gw.pid, "gateway_url": gw.url, "engine_url": f"{gw.url}/engine", "engine_kind": "embedded"}
        assert serving_gateway(root)["pid"] == gw.pid

        [step] = train_flow(config_path=str(conf), max_steps=1)["steps"]
        assert step["weight_version"] == "1"
        sync = step["sync"]
        assert (sync["success"], sync["version"], sync["weight_version"], sync["target"]) == \
            (True, "1", "1", f"{gw.url}/engine")
        [model] = httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"]
        assert model["weight_version"] == "1"  # the gateway serves the new version
        assert httpx.get(f"{gw.url}/healthz", timeout=10).json()["weight_version"] == "1"

        lines = _status(conf)
        assert _row(lines, "served version") == f"served version 1 (live, from {gw.url})"
        assert _line(lines, "checkpoint v") is None  # nothing waits
        assert _line(lines, "last sync: ok").endswith(
            "(version 1 -> " + f"{gw.url}/engine); serving version 1; 1 sync attempts, 0 failed")
    finally:
        assert gw.stop() in (0, -15)  # SIGTERM: uvicorn shuts down, then ends by re-raising the signal
    assert not (root / SERVE_RECORD).exists()  # removed when it shut down

    # no gateway now: the next checkpoint waits, and both `train` and `status` say so and how to serve it
    monkeypatch.setattr("clawrl.cli.training.data_root_prefect", lambda s: contextlib.nullcontext())  # the session's
    res = CliRunner().invoke(app, ["train", "--config", str(conf)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    command = f"clawrl sync 2 -c {conf} --engine-url http://127.0.0.1:{port}/engine"
    assert res.stderr.strip() == (
        f"checkpoint v2 is WAITING: nothing serves it (no `clawrl serve` is running on {root} and no [engine] "
        f"url). With the gateway running, serve it with: {command}")
    lines = _status(conf)
    assert _row(lines, "latest checkpoint") == "latest checkpoint weight_version 2 (step 2)"
    assert _row(lines, "served version") == "served version 1 (as the last sync saw it; no `clawrl serve` answers)"
    assert _line(lines, "checkpoint v") == \
        f"checkpoint v2 is waiting: served version is v1 (run `{command}` with `clawrl serve` running)"
    res = CliRunner().invoke(app, ["sync", "--config", str(conf)])
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        f"checkpoint v2 is WAITING: no engine to sync (no `clawrl serve` is running on {root} and no [engine] "
        f"url). Start `clawrl serve`, or name the engine: {command}")


def test_status_ignores_a_stale_serve_record_and_shows_the_waiting_checkpoint(tmp_path):
    """A `clawrl serve` killed before it could remove its record: its pid is gone, so the record is
    ignored and the checkpoints nothing ever served are waiting on the initial weights."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with DataStore(tmp_path, background=False) as store:
        store.append([CheckpointRecord("1", 1, "b1", "0", "/c/v000001", "ab", None),
                      CheckpointRecord("2", 2, "b2", "1", "/c/v000002", "cd", None)])
        store.flush()
    write_serve_record(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:9/engine", "embedded")
    rec = json.loads((tmp_path / SERVE_RECORD).read_text())
    assert rec["pid"] == os.getpid() and serving_gateway(tmp_path)["engine_url"] == "http://127.0.0.1:9/engine"
    (tmp_path / SERVE_RECORD).write_text(json.dumps({**rec, "pid": int(dead.stdout)}))
    assert serving_gateway(tmp_path) is None

    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status"], env={"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path), "COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert _row(lines, "served version") == \
        "served version 0 (the initial weights; no sync recorded, no `clawrl serve` answers)"
    assert _line(lines, "last sync:") == \
        "last sync: none recorded; checkpoints 1, 2 waiting: nothing serves them (`clawrl sync`)"
    assert _line(lines, "checkpoint v") == ("checkpoint v2 is waiting: served version is v0 (run `clawrl sync 2 "
                                            "--engine-url http://127.0.0.1:30000/engine` with `clawrl serve` running)")
