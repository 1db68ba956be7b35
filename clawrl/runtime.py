"""Process-wide runtime: one background asyncio loop for sync callers, and named long-lived objects.

Prefect tasks are synchronous functions running in worker threads; the engines are asyncio
objects. :func:`run` executes a coroutine on one shared background loop (started on first use), so
every engine call of a process goes through one loop whatever thread asks.

:func:`register` / :func:`lookup` hold the long-lived objects of a process - the serving engine,
the frozen judge/teacher engine, the trainer - so an in-process flow run (``clawrl demo``,
``clawrl train`` without a trainer service) reuses them instead of loading a model per run. The
registry is explicit: nothing registers itself at import time.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_objects: dict[str, Any] = {}


def background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="clawrl-runtime-loop", daemon=True)
            thread.start()
            _loop = loop
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


def register(name: str, obj: Any) -> Any:
    with _lock:
        _objects[name] = obj
    return obj


def lookup(name: str) -> Any | None:
    with _lock:
        return _objects.get(name)


def get_or_create(name: str, factory: Callable[[], Any]) -> Any:
    """The object registered under ``name``, created by ``factory`` on first use."""
    with _lock:
        if name in _objects:
            return _objects[name]
    obj = factory()  # outside the lock: loading a model takes seconds
    with _lock:
        return _objects.setdefault(name, obj)


def unregister(name: str) -> Any | None:
    with _lock:
        return _objects.pop(name, None)


def close_registered(timeout_s: float = 5.0) -> None:
    """Await ``close()`` of every registered object that has an async one (HTTP clients of judges,
    engines), on the background loop, then forget them all. Errors are swallowed: this runs at
    interpreter exit, when nothing can be done about them."""
    with _lock:
        objects = list(_objects.values())
        _objects.clear()
    loop = _loop
    closers = [obj.close for obj in objects if asyncio.iscoroutinefunction(getattr(obj, "close", None))]
    if not closers or loop is None or not loop.is_running():
        return

    async def close_all() -> None:
        await asyncio.gather(*(close() for close in closers), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout_s)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _shutdown() -> None:  # pragma: no cover - interpreter exit
    close_registered()
    loop = _loop
    if loop is not None and loop.is_running():
        loop.call_soon_threadsafe(loop.stop)


atexit.register(_shutdown)
