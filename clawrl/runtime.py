"""One background asyncio loop per process for synchronous callers.

Prefect tasks are synchronous functions running in worker threads; the engines are asyncio
objects. :func:`run` executes a coroutine on one shared background loop (started on first use), so
every engine call of a process goes through one loop whatever thread asks, and an HTTP client made
on that loop is always used on it. At exit it ends, and the threads of the engines' workers with it,
before the interpreter finalizes (:func:`end_at_exit`).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
# How long exit waits for a thread to end: an engine worker finishes the step it is in first (a long prefill
# chunk on a busy CPU: seconds)
EXIT_JOIN_S = 30.0


class Worker(Protocol):
    def end_thread(self) -> threading.Thread | None:
        """Tell the worker's thread to end soon; return it (None: none runs)."""


_workers: weakref.WeakSet[Worker] = weakref.WeakSet()


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


def end_at_exit(worker: Worker) -> None:
    """End ``worker``'s thread at interpreter exit, before the interpreter finalizes (an engine's worker)."""
    _workers.add(worker)


def _shutdown() -> None:
    """End the workers' threads and the loop's, and wait for them. A daemon thread still in a torch call when
    the interpreter finalizes is killed as the call takes the GIL back, inside torch's C++ frames, and the
    process aborts ("terminate called without an active exception", exit status 134) after all its work was
    done: a command that exits while its engine decodes would fail. The requests still running fail."""
    threads = [w.end_thread() for w in list(_workers)]
    if is_running():
        _loop.call_soon_threadsafe(_loop.stop)
        threads.append(_thread)
    for thread in threads:
        if thread is not None and thread is not threading.current_thread():
            thread.join(EXIT_JOIN_S)


atexit.register(_shutdown)
