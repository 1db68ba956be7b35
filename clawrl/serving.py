"""Run an ASGI app under uvicorn on a background thread (the gateway inside `clawrl demo`, tests)."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn


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
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
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
