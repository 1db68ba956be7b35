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


def background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="clawrl-runtime-loop", daemon=True).start()
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


def _shutdown() -> None:  # pragma: no cover - interpreter exit
    if is_running():
        _loop.call_soon_threadsafe(_loop.stop)


atexit.register(_shutdown)
