"""Run an ASGI app under uvicorn on a background thread (the gateway inside `clawrl demo`, tests), and
``<data_root>/serve.json``: where the `clawrl serve` of a data root answers, for `clawrl train`,
`clawrl sync` and `clawrl status` to find its engine without being told."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from clawrl.lineage import pid_alive
from clawrl.ports import SERVER_KEEPALIVE_S


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (modules, model, tokenizer: ~450k objects
    in a gateway) out of the cyclic collector's reach. A full collection otherwise walks them all:
    a 100-300 ms stall of the event loop whenever one triggers. Servers call this once, when loaded
    and before serving (not in tests: frozen objects are never collected). Returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on sockets that say so, and without it each
    # response waits ~40 ms on Nagle + delayed ACK (headers and body are separate writes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@dataclass
class ServerThread:
    url: str
    server: Any
    thread: threading.Thread
    sock: socket.socket
    loop: asyncio.AbstractEventLoop | None = None
    failure: list[BaseException] = field(default_factory=list)

    def call(self, coro, timeout: float | None = 60.0):
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 300.0,
                    log_level: str = "warning") -> ServerThread:
    """Start ``app`` (lifespan on) and return once it accepts requests."""
    sock = bind_socket(host, port)
    real_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                           timeout_keep_alive=SERVER_KEEPALIVE_S))
    handle = ServerThread(url=f"http://{host}:{real_port}", server=server, thread=None, sock=sock)  # type: ignore[arg-type]

    def main() -> None:
        async def run():
            handle.loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        try:
            asyncio.run(run())
        except BaseException as e:  # surfaced to the caller below
            handle.failure.append(e)

    handle.thread = threading.Thread(target=main, name=f"server-{real_port}", daemon=True)
    handle.thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if handle.failure or not handle.thread.is_alive():
            sock.close()
            raise RuntimeError(f"server failed to start: {handle.failure[0] if handle.failure else 'thread exited'!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at {handle.url} did not start within {startup_timeout_s} s")
        time.sleep(0.02)
    return handle


def serve_own_gateway(settings, *, engine, tokenizer, store, api_keys: list[str] | None = None) -> ServerThread:
    """The gateway of this process's own clients (the demo's simulated users, a bench's client) on loopback,
    open whatever keys the environment holds: those clients carry no key of the user's, and the keys set
    for `clawrl serve` (``$CLAWRL_API_KEYS``, as the README says) would turn each of their requests into a 401.
    ``api_keys``: the keys of those clients instead (each its own namespace), never the environment's."""
    from clawrl.gateway.routes import create_app

    if api_keys:
        return serve_in_thread(create_app(settings, engine=engine, tokenizer=tokenizer, store=store,
                                          api_keys=api_keys, own=True))
    opened = settings.model_copy(update={"server": settings.server.model_copy(update={"open_mode": True})})
    return serve_in_thread(create_app(opened, engine=engine, tokenizer=tokenizer, store=store, api_keys=[],
                                      own=True))


SERVE_RECORD = "serve.json"


def write_serve_record(data_root: Path, gateway_url: str, engine_url: str | None, engine_kind: str) -> Path:
    """Record that this process serves the data root: its pid, the gateway's URL and the URL its
    weights are synced through (``{gateway}/engine`` for the embedded engine, ``[engine] url`` for an
    HTTP engine). Written atomically (a temporary file renamed), so a reader never sees half of it."""
    target = Path(data_root) / SERVE_RECORD
    tmp = target.with_name(f".{SERVE_RECORD}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "gateway_url": gateway_url, "engine_url": engine_url,
                               "engine_kind": engine_kind, "started_at": time.time()}))
    tmp.replace(target)
    return target


def record_where_it_serves(app, data_root: Path, gateway_url: str, engine_url: str | None, engine_kind: str) -> None:
    """Write the data root's serve record when ``app`` starts serving and remove it when it shuts down
    (its lifespan: also on SIGTERM and Ctrl-C, which end uvicorn by re-raising the signal)."""
    import contextlib

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            write_serve_record(data_root, gateway_url, engine_url, engine_kind)
            try:
                yield state
            finally:
                remove_serve_record(data_root)

    app.router.lifespan_context = lifespan


def remove_serve_record(data_root: Path) -> None:
    """Remove the data root's serve record when this process wrote it (a newer server's stays)."""
    target = Path(data_root) / SERVE_RECORD
    try:
        if json.loads(target.read_text()).get("pid") == os.getpid():
            target.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def serving_gateway(data_root: Path) -> dict[str, Any] | None:
    """The serve record of the `clawrl serve` running on ``data_root`` (pid, gateway_url, engine_url,
    engine_kind), or None: no record, an unreadable one, or one whose process is gone (killed
    before it could remove its record)."""
    try:
        rec = json.loads((Path(data_root) / SERVE_RECORD).read_text())
        pid = int(rec["pid"])
        if not isinstance(rec.get("gateway_url"), str):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if pid > 0 and pid_alive(pid) else None
