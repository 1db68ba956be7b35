"""Ctrl-C in a terminal: the signal goes to the whole foreground process group. `clawrl demo` (and
`clawrl judge|train|replay` without a `clawrl up`) run their flows against a Prefect server of their
own, started in a session of its own, so the Ctrl-C interrupts the flows, which report their crash to a
server that is still up, and then the server is stopped. With Prefect's temporary server (in the
terminal's group) the same Ctrl-C stopped the server first, and the flows retried their last reports
for ~4 minutes, printing tracebacks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.demo_config import tiny_demo_config
from tests.utils.gateway_process import REPO
from tests.utils.waiting import wait_until


def _clawrl(args: list[str], tmp_path, model_cache) -> tuple[subprocess.Popen, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAWRL__", "PREFECT_API_URL"))}
    env.update({"CLAWRL__STORAGE__MODEL_CACHE": str(model_cache), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    log = open(tmp_path / "out.log", "w+")
    # a process group of its own, as a shell gives a foreground job: the "terminal" signals all of it. And
    # SIGINT's default disposition, as a foreground job has it: pytest-xdist's workers ignore SIGINT, and an
    # ignored signal stays ignored across exec (Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-m", "clawrl.cli", *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def _wait_for(log, pattern: str, proc: subprocess.Popen) -> re.Match:
    return wait_until(lambda: re.search(pattern, Path(log.name).read_text()), f"{pattern!r} in the output",
                      proc=proc, log=Path(log.name), poll_s=0.5)


def test_ctrl_c_stops_the_demo_and_its_prefect_server(tmp_path, model_cache):
    run = tmp_path / "run"
    conf = tiny_demo_config(tmp_path, model_cache)  # small steps: the Ctrl-C comes in the second
    proc, log = _clawrl(["demo", "-c", str(conf), "--steps", "16", "--users", "4", "--heldout", "4", "--eval-samples",
                         "1", "--max-tokens", "8", "--run-dir", str(run)], tmp_path, model_cache)
    try:
        ui = _wait_for(log, r"Prefect UI of this run while it runs: (http://127\.0\.0\.1:\d+)", proc).group(1)
        _wait_for(log, r"step  1: served_score", proc)  # a step done, the next one under way
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        wait_until(lambda: proc.poll() is not None, "the demo to stop", proc=proc, log=Path(log.name))
        rc = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    out = log.read()
    assert rc == 130, out[-3000:]
    assert f"interrupted: the steps so far are kept in {run}" in " ".join(out.split())
    # reported while the server is up: Crashed, or Failed when the Ctrl-C landed in a DuckDB query (its RuntimeError)
    assert re.search(r"Flow run 'learning-loop-persona-16-steps' - Finished in state (Crashed|Failed)", out), out[-3000:]
    assert "Error logging to API" not in out and "Connection refused" not in out
    assert (run / "checkpoints" / "v000001" / "trainer.json").is_file()  # what was done is kept
    try:
        httpx.get(f"{ui}/api/health", timeout=2)
        raise AssertionError(f"the run's Prefect server at {ui} still answers")
    except httpx.ConnectError:
        pass


def test_ctrl_c_in_the_middle_of_a_duckdb_query_exits_130_with_the_message(capsys):
    """DuckDB (2.0.1) catches the KeyboardInterrupt of a Ctrl-C that lands mid-query and raises
    RuntimeError("Query interrupted") in its place (seen with a long `range` query and a real SIGINT; how soon
    DuckDB notices depends on its threads, so this test makes the swap itself): after a SIGINT, the demo still
    ends with its message and 130, and any other error is still an error."""
    import typer

    from clawrl.cli.demo import ctrl_c_exits

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(typer.Exit) as e, ctrl_c_exits("interrupted: the steps so far are kept"):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT: the handler ctrl_c_exits installed sees it
            time.sleep(600)  # interrupted at once by the signal: the length only bounds a signal never delivered
        except KeyboardInterrupt:
            raise RuntimeError("Query interrupted") from None  # what DuckDB raises instead
        raise AssertionError("the SIGINT raised nothing")
    assert e.value.exit_code == 130
    assert capsys.readouterr().out.strip() == "interrupted: the steps so far are kept"
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RuntimeError, match="boom"), ctrl_c_exits("interrupted"):
        raise RuntimeError("boom")


def test_a_ctrl_c_prefect_drops_as_a_subflow_ends_still_stops_the_loop(prefect_harness, capsys):
    """Prefect (3.9) drops a KeyboardInterrupt that lands after a subflow's own code returned, while its engine
    reports the final state (a demo in CI ran all its 16 steps after a Ctrl-C in the second and exited 0). The
    subflow's on_completion hook runs in that window and sends the real SIGINT here. The loop's next
    ``stop_if_ctrl_c`` raises it again; a block that ends anyway is still interrupted: message and 130."""
    import typer
    from prefect import flow

    from clawrl import interrupts
    from clawrl.cli.demo import ctrl_c_exits

    @flow(on_completion=[lambda *_: os.kill(os.getpid(), signal.SIGINT)])
    def child() -> int:
        return 1

    done: list[str] = []

    @flow
    def loop(stop: bool) -> None:
        for step in range(1, 3):
            if stop:
                interrupts.stop_if_ctrl_c()
            child()
            done.append(f"step {step}")

    before = signal.getsignal(signal.SIGINT)
    for stop, steps in ((False, ["step 1", "step 2"]), (True, ["step 1"])):
        done.clear()
        with pytest.raises(typer.Exit) as e, ctrl_c_exits("interrupted"):
            loop(stop)
        assert e.value.exit_code == 130
        assert done == steps  # without the check the loop went on to its end: Prefect swallowed the interrupt
        assert capsys.readouterr().out.strip().endswith("interrupted")
    assert signal.getsignal(signal.SIGINT) is before
    interrupts.stop_if_ctrl_c()  # noted only inside the block: raises nothing after it
