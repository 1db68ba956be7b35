"""Reserve CPUs for the embedded engine's worker thread (``[engine] worker_cpus``, Linux only).

On a small CPU machine the worker thread (the forward passes) and the serving threads in the
same process (the gateway's or ``clawrl engine``'s HTTP event loop, the session-log writer) are
scheduled onto the same cores: every millisecond of HTTP work that lands on the worker's core
delays a whole batch of sequences. Pinning the worker to reserved CPUs and every other thread of
the process to the rest keeps them apart. Threads started later inherit their creator's mask:
the worker's (torch's intra-op pool) stays on the reserved CPUs, the event loop's on the rest.

``sched_setaffinity(0, ...)`` sets the *calling thread's* mask on Linux; a thread id from
``/proc/self/task`` sets that thread's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from clawrl.config import ConfigError

log = logging.getLogger(__name__)


class CpuPinning:
    """Worker thread on ``worker_cpus``, the process's other threads on the CPUs left over."""

    def __init__(self, worker_cpus: Iterable[int]):
        self.worker_cpus = frozenset(int(c) for c in worker_cpus)
        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError("engine.worker_cpus needs Linux (os.sched_setaffinity); leave it empty here")
        self.allowed = frozenset(os.sched_getaffinity(0))
        unknown = sorted(self.worker_cpus - self.allowed)
        if unknown:
            raise ConfigError(f"engine.worker_cpus: CPU {unknown} is not available to this process "
                             f"(allowed: {sorted(self.allowed)})")
        self.rest = self.allowed - self.worker_cpus
        if not self.rest:
            raise ConfigError(f"engine.worker_cpus {sorted(self.worker_cpus)} takes every CPU this process may use; "
                             "leave at least one for the serving threads")

    def pin_current_thread(self) -> None:
        """Called by the worker thread itself, before its first step."""
        os.sched_setaffinity(0, self.worker_cpus)

    def pin_others(self, worker_tid: int) -> None:
        """Move every other thread of this process off the reserved CPUs."""
        moved = sum(_set(tid, self.rest) for tid in _thread_ids() if tid != worker_tid)
        log.info("engine worker (thread %d) on CPUs %s; %d other threads on %s", worker_tid,
                 sorted(self.worker_cpus), moved, sorted(self.rest))

    def restore(self) -> None:
        """Give the moved threads (and any they started) the process's original mask back."""
        for tid in _thread_ids():
            _set(tid, self.allowed)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: only the calling thread can be moved
        return [0]


def _set(tid: int, cpus: frozenset[int]) -> bool:
    try:
        os.sched_setaffinity(tid, cpus)
        return True
    except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
        return False
