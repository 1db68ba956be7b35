"""A Ctrl-C that stops a long command even where a library swallows its KeyboardInterrupt.

Prefect drops a KeyboardInterrupt that lands after a subflow's own code returned (while its engine reports the
run's final state), and DuckDB turns one mid-query into a RuntimeError that a report's broad handler catches: the
work then went on to its end. Inside :func:`ctrl_c_noted` every Ctrl-C is also noted, and long loops call
:func:`stop_if_ctrl_c` before each new piece of work.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_ctrl_c = threading.Event()  # set by a Ctrl-C inside ctrl_c_noted()


@contextmanager
def ctrl_c_noted() -> Iterator[Callable[[], bool]]:
    """Within the block (main thread), a Ctrl-C raises KeyboardInterrupt as always and is also noted, so that
    :func:`stop_if_ctrl_c` raises it again where it was swallowed. Yields whether one came."""
    def on_sigint(signum, frame) -> None:
        _ctrl_c.set()
        signal.default_int_handler(signum, frame)

    _ctrl_c.clear()
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield _ctrl_c.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
        _ctrl_c.clear()


def stop_if_ctrl_c() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came inside :func:`ctrl_c_noted`: long loops call it before each new
    piece of work, so a swallowed Ctrl-C stops them there."""
    if _ctrl_c.is_set():
        raise KeyboardInterrupt
