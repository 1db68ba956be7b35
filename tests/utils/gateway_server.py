"""Run a gateway app under uvicorn on a free localhost port in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn


@dataclass
class RunningGateway:
    url: str
    app: Any
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def free_socket() -> socket.socket:
    # IPPROTO_TCP so asyncio turns Nagle off (see tests/utils/engine_server.py)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_gateway(app, startup_timeout_s: float = 120.0) -> Iterator[RunningGateway]:
    sock = free_socket()
    port = sock.getsockname()[1]
    running = RunningGateway(url=f"http://127.0.0.1:{port}", app=app)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def thread_main() -> None:
        async def main():
            running.loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced below
            failure.append(e)

    thread = threading.Thread(target=thread_main, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"gateway failed to start: {failure[0] if failure else 'thread exited'!r}")
        if time.monotonic() > deadline:
            raise RuntimeError("gateway did not start in time")
        time.sleep(0.02)
    httpx.get(running.url + "/metrics", timeout=10).raise_for_status()
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
