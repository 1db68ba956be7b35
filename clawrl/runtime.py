"""One background asyncio loop per process for synchronous callers.

Prefect tasks are synchronous functions running in worker threads; the engines are asyncio
objects. :func:`run` executes a coroutine on one shared background loop (started on first use), so
every engine call of a process goes through one loop whatever thread asks, and an HTTP client made
on that loop is always used on it.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
# How long exit waits for the loop's thread to end: a callback still running when the loop is told to stop
# finishes first (seconds at most; the engines' work runs on threads of their own)
EXIT_JOIN_S = 30.0


def background_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="clawrl-runtime-loop", daemon=True)
            _thread.start()
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the background loop from synchronous code and return its result."""
    loop = background_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("runtime.run() called from the runtime loop itself; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def is_running() -> bool:
    """Whether the background loop was started (and still runs): work at exit uses it only then."""
    loop = _loop
    return loop is not None and loop.is_running()


def _shutdown() -> None:
    """Stop the loop and wait for its thread to end. A daemon thread still ending when the interpreter
    finalizes is killed as it next takes the GIL, and where that happens inside a C++ destructor (torch's
    thread-local state, run as the thread exits) the process aborts ("terminate called without an active
    exception", exit status 134) after every line of its work was done."""
    thread = _thread
    if is_running():
        _loop.call_soon_threadsafe(_loop.stop)
    if thread is not None and thread is not threading.current_thread():
        thread.join(EXIT_JOIN_S)


atexit.register(_shutdown)
