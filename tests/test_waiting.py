"""tests/utils/waiting.py: a wait goes on while what it waits on makes progress (CPU, log lines, a counter),
gives up at once when the process dies, and only after a stall otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from tests.utils.waiting import Failed, Overlap, run_to_end, spawn, wait_until, wait_until_async

SPIN = "import time\nwhile time.process_time() < {cpu_s}: pass\nprint('spun', flush=True)"  # CPU, no output


def _python(code: str, log) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)


def test_a_process_that_dies_ends_the_wait_at_once_with_its_log(tmp_path):
    log = tmp_path / "child.log"
    proc = _python("print('loading the model'); raise SystemExit(3)", log)
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: False, "the server", proc=proc, log=log)
    assert "the process exited (3) while waiting for the server" in str(e.value)
    assert "loading the model" in str(e.value)  # its log's tail says why


def test_a_process_using_cpu_is_waited_for_past_the_stall_time(tmp_path):
    # 2 CPU seconds without a line of output; a stall is 20 s without a CPU second (on a busy machine the
    # child gets a fraction of a core: its 2 CPU seconds may take many more wall seconds, never a stall)
    log = tmp_path / "child.log"
    proc = _python(SPIN.format(cpu_s=2.0), log)
    wait_until(lambda: proc.poll() is not None, "the spinning child", proc=proc, log=log, stall_s=20)
    assert proc.returncode == 0 and log.read_text() == "spun\n"


def test_a_growing_log_is_progress_and_silence_is_a_stall(tmp_path):
    log = tmp_path / "child.log"
    talks = _python("import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.5)", log)
    wait_until(lambda: talks.poll() is not None, "the talking child", proc=talks, log=log, stall_s=3)
    assert log.read_text().split() == [str(i) for i in range(8)]  # 4 s of output, never 3 s of silence

    quiet = tmp_path / "quiet.log"
    sleeper = _python("import time; print('started', flush=True); time.sleep(600)", quiet)
    try:
        with pytest.raises(AssertionError) as e:
            wait_until(lambda: False, "the sleeper", proc=sleeper, log=quiet, stall_s=2)
        assert "gave up waiting for the sleeper: no progress for 2 s" in str(e.value) and "started" in str(e.value)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_condition_answers_with_its_value_retries_errors_and_can_give_up_at_once():
    calls = []

    def ready():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("not listening yet")  # not yet: asked again
        return {"status": "ok"}

    assert wait_until(ready, "a server", poll_s=0.01) == {"status": "ok"} and len(calls) == 3

    def gone():
        raise Failed("the server thread died")

    with pytest.raises(Failed, match="the server thread died"):
        wait_until(gone, "a server")


def test_a_changing_counter_is_progress_and_the_cap_ends_any_wait():
    counter = iter(range(1_000_000))
    with pytest.raises(AssertionError, match="not there after 1 s, though still busy"):
        wait_until(lambda: False, "nothing", progress=lambda: next(counter), stall_s=0.5, cap_s=1, poll_s=0.05)


def test_the_async_wait_sees_another_threads_work():
    done = threading.Event()
    threading.Timer(0.2, done.set).start()
    assert asyncio.run(wait_until_async(done.is_set, "the timer", stall_s=30)) is True


def test_run_to_end_gives_what_subprocess_run_gives(tmp_path):
    out = run_to_end([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(2)"])
    assert (out.returncode, out.stdout, out.stderr) == (2, "out\n", "err\n")
    child = spawn([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path, "stuck")
    with pytest.raises(AssertionError, match="no progress for 1 s"):
        child.result("the stuck child", stall_s=1)
    assert child.proc.returncode == -9  # killed when the wait gave up


def test_overlap_sees_concurrent_calls_together_and_serial_ones_apart():
    async def calls(overlap: Overlap, concurrent: bool) -> int:
        async def one():
            async with overlap.held():
                await asyncio.sleep(0)

        if concurrent:
            await asyncio.gather(*(one() for _ in range(5)))
        else:
            for _ in range(5):
                await one()
        return overlap.max_in_flight

    assert asyncio.run(calls(Overlap(together=5), concurrent=True)) == 5
    assert asyncio.run(calls(Overlap(together=5, hold_s=0.2), concurrent=False)) == 1


def test_no_timeout_mark_is_tighter_than_the_hang_guard():
    """A pytest-timeout mark stops a hung test; a tighter one fails a slow but correct test on a busy machine."""
    import re
    from pathlib import Path

    from tests.utils.waiting import HANG_S

    marks = {f"{p.name}:{n}": int(m.group(1)) for p in Path(__file__).parent.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if (m := re.search(r"mark\.timeout\((\d+)", line))}
    assert {where: s for where, s in marks.items() if s < HANG_S} == {}
