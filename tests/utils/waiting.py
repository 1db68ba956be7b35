"""Waiting in tests on what happens, never on the clock alone.

On a busy machine (two test runs side by side on 2 cores: load ~15) a server takes many times longer to
start than on a quiet one, so a fixed budget ("not ready after 240 s") fails tests that are only slow.
:func:`wait_until` polls a condition for as long as what it waits on makes progress, and gives up:

- at once when a process it watches exits (with the tail of its log), or when the condition raises
  :class:`Failed` (what it waits for can no longer happen);
- after ``stall_s`` without progress: no CPU used by the watched process and its children or by this
  process's other threads (an in-thread server, the test's clients), no byte logged, and no change in the
  value of ``progress()``;
- after ``cap_s`` in all, a backstop for a process that keeps spinning without getting anywhere.

:func:`run_to_end` runs a command to its end the same way (``subprocess.run`` with a progress rule
instead of ``timeout=``); :func:`spawn` starts one whose end is awaited later (:meth:`Child.result`).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# No CPU second and no log line for this long is a stall, not slowness: at load ~15 on 2 cores a
# process still gets about an eighth of a core, a CPU second every 8 s.
STALL_S = 180.0
# A process that keeps using CPU without ever getting there (a retry loop, a busy wait) is stopped here.
CAP_S = 1800.0
# CPU seconds that count as progress: an idle server's event loop and heartbeats use far less in STALL_S.
MIN_CPU_S = 1.0
LOG_TAIL_CHARS = 4000
# A test's pytest-timeout mark only stops a test that hangs, never one that is slow: well above STALL_S (so a
# stalled wait fails first, saying what it waited for) and above the longest test's time at load ~15 (the
# first sync fault test, with its fixtures' starts: 530 s at load 16 on 2 cores) by a wide margin.
HANG_S = 1800


class Failed(Exception):
    """Raised by a condition to stop waiting at once: what it waits for can no longer happen."""


def wait_until(ready: Callable[[], Any], what: str, *, proc: subprocess.Popen | int | None = None,
               log: Path | Sequence[Path] | None = None, progress: Callable[[], Any] | None = None,
               stall_s: float = STALL_S, cap_s: float = CAP_S, poll_s: float = 0.1) -> Any:
    """Poll ``ready()`` until it returns something truthy, and return that. An exception from ``ready``
    counts as "not yet" (a server that does not listen yet refuses connections), except :class:`Failed`.
    ``proc`` (a Popen or a pid) is the process whose work is awaited: its exit ends the wait and its CPU
    time (its children's included) is progress; ``log`` files it writes grow as it progresses and their
    tails explain a failure; a change in ``progress()`` (a row count, a token counter) is progress too."""
    watch = _Watch(what, proc, log, progress, stall_s, cap_s)
    while True:
        done, value = watch.poll(ready)
        if done:
            return value
        time.sleep(poll_s)


def join(*threads: threading.Thread) -> None:
    """``Thread.join`` for as long as this process makes progress (its threads use CPU)."""
    for t in threads:
        wait_until(lambda: not t.is_alive(), f"the thread {t.name} to end")


async def wait_until_async(ready: Callable[[], Any], what: str, *, progress: Callable[[], Any] | None = None,
                           stall_s: float = STALL_S, cap_s: float = CAP_S, poll_s: float = 0.005) -> Any:
    """:func:`wait_until` inside an event loop (an in-process engine the test drives with ``asyncio.run``)."""
    watch = _Watch(what, None, None, progress, stall_s, cap_s)
    while True:
        done, value = watch.poll(ready)
        if done:
            return value
        await asyncio.sleep(poll_s)


@dataclass
class Child:
    """A command started by :func:`spawn`; its output goes to two files, whose growth shows progress."""

    args: Sequence[str]
    proc: subprocess.Popen
    out: Path
    err: Path
    drains: list[threading.Thread]

    def result(self, what: str | None = None, *, stall_s: float = STALL_S,
               cap_s: float = CAP_S) -> subprocess.CompletedProcess:
        """Wait for the command's end while it makes progress (CPU, output); kill it (with its children)
        and raise after a stall. Returns what ``subprocess.run(capture_output=True, text=True)`` would."""
        try:
            wait_until(lambda: self.proc.poll() is not None, what or " ".join(map(str, self.args))[:200],
                       proc=self.proc, log=[self.out, self.err], stall_s=stall_s, cap_s=cap_s, poll_s=0.2)
        finally:
            if self.proc.poll() is None:
                _kill_tree(self.proc.pid)
                self.proc.wait()
        for t in self.drains:  # the pipes close at the exit (or with the last child holding them)
            t.join(stall_s)
        return subprocess.CompletedProcess(self.args, self.proc.returncode, self.out.read_text(errors="replace"),
                                           self.err.read_text(errors="replace"))


def spawn(args: Sequence[str], out_dir: Path, name: str = "child", **popen_kw) -> Child:
    """Start ``args`` with stdout and stderr copied to ``out_dir/<name>.out`` and ``.err`` by this process
    (a child under a file-size limit must not fail on its own output); see :meth:`Child.result`."""
    out, err = Path(out_dir) / f"{name}.out", Path(out_dir) / f"{name}.err"
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kw)
    return Child(args, proc, out, err, [drain(proc.stdout, out), drain(proc.stderr, err)])


def drain(pipe, path: Path) -> threading.Thread:
    """Copy a child's output ``pipe`` to the file ``path``, line by line as it comes, in a thread."""
    def copy() -> None:
        with pipe, Path(path).open("ab") as f:
            for line in pipe:
                f.write(line)
                f.flush()

    thread = threading.Thread(target=copy, name=f"drain-{Path(path).name}", daemon=True)
    thread.start()
    return thread


def run_to_end(args: Sequence[str], what: str | None = None, *, stall_s: float = STALL_S, cap_s: float = CAP_S,
               **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, **popen_kw)`` that waits while the command
    makes progress (CPU, output) instead of for a fixed ``timeout``; the command is killed after a stall."""
    with tempfile.TemporaryDirectory(prefix="run-to-end-") as tmp:
        return spawn(args, Path(tmp), **popen_kw).result(what, stall_s=stall_s, cap_s=cap_s)


class Overlap:
    """How many calls are in flight at once (``max_in_flight``), for tests of concurrency. Inside
    ``async with overlap.held():`` a call waits until ``together`` calls are in flight: calls made at once
    are seen together however slow the machine (a fixed sleep sees them together only if they all start
    within it). Calls made one after another cannot meet: the first gives up after ``hold_s``, and
    ``max_in_flight`` tells. Once they have met (or one gave up), no call is held any more."""

    def __init__(self, together: int = 1, hold_s: float = 60.0):
        self.together, self.hold_s = together, hold_s
        self.in_flight = self.max_in_flight = 0
        self.released = False

    @contextlib.asynccontextmanager
    async def held(self):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            t0 = time.monotonic()
            while not self.released:
                self.released = self.in_flight >= self.together or time.monotonic() - t0 > self.hold_s
                await asyncio.sleep(0 if self.released else 0.01)
            yield
        finally:
            self.in_flight -= 1


def log_tail(log: Path | Sequence[Path] | None, n: int = LOG_TAIL_CHARS) -> str:
    """The last ``n`` characters of each log file, headed by its name."""
    parts = []
    for path in _paths(log):
        try:
            parts.append(f"--- {path.name}:\n" + path.read_bytes()[-n:].decode("utf-8", "replace"))
        except FileNotFoundError:
            parts.append(f"--- {path.name}: (no file)")
    return "\n".join(parts)


class _Watch:
    """The bookkeeping of one wait: when progress was last seen, and whether to give up."""

    def __init__(self, what, proc, log, progress, stall_s, cap_s):
        self.what, self.log, self.progress, self.stall_s, self.cap_s = what, log, progress, stall_s, cap_s
        self.popen = proc if isinstance(proc, subprocess.Popen) else None
        self.pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
        self.t0 = self.seen_at = time.monotonic()
        self.cpu_mark = self._cpu()
        self.state = self._state()
        self.error: BaseException | None = None

    def poll(self, ready) -> tuple[bool, Any]:
        try:
            value = ready()
            if value:
                return True, value
        except Failed:
            raise
        except Exception as e:  # not yet; shown if the wait gives up
            self.error = e
        if (code := self._exit_code()) is not None:
            raise AssertionError(f"the process exited ({code}) while waiting for {self.what}\n{log_tail(self.log)}")
        now = time.monotonic()
        cpu, state = self._cpu(), self._state()
        if state != self.state or abs(cpu - self.cpu_mark) >= MIN_CPU_S:
            self.seen_at, self.cpu_mark, self.state = now, cpu, state
        if now - self.seen_at > self.stall_s:
            self._give_up(f"no progress for {self.stall_s:.0f} s (no CPU used, nothing logged)")
        if now - self.t0 > self.cap_s:
            self._give_up(f"not there after {self.cap_s:.0f} s, though still busy")
        return False, None

    def _give_up(self, why: str):
        last = f"; the last check said {self.error!r}" if self.error is not None else ""
        raise AssertionError(f"gave up waiting for {self.what}: {why}{last}\n{log_tail(self.log)}")

    def _exit_code(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        if self.pid is None:
            return None
        try:
            gone = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        return -1 if gone else None

    def _cpu(self) -> float:
        """CPU seconds of this process's other threads (an in-thread server, the test's clients, a flow it
        runs) and of the watched process with its children."""
        total = time.process_time() - time.thread_time()
        if self.pid is None:
            return total
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:  # exited: its exit is seen by the caller
            return total
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # exited meanwhile
                pass
        return total

    def _state(self) -> tuple:
        sizes = tuple(p.stat().st_size if p.exists() else -1 for p in _paths(self.log))
        try:
            value = self.progress() if self.progress is not None else None
        except Exception:
            value = None
        return sizes, value


def _paths(log: Path | Sequence[Path] | None) -> list[Path]:
    if log is None:
        return []
    return [Path(log)] if isinstance(log, (str, Path)) else [Path(p) for p in log]


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
