"""Run a gateway app under uvicorn on a free localhost port in a background thread (tests)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from clawrl.serving import ServerThread, bind_socket, serve_in_thread


class RunningGateway:
    def __init__(self, handle: ServerThread, app):
        self.handle, self.app, self.url = handle, app, handle.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def loop(self):
        return self.handle.loop

    def call(self, coro, timeout: float = 60.0):
        return self.handle.call(coro, timeout)


def free_socket() -> socket.socket:
    return bind_socket("127.0.0.1", 0)


@contextmanager
def running_gateway(app, startup_timeout_s: float = 120.0) -> Iterator[RunningGateway]:
    handle = serve_in_thread(app, startup_timeout_s=startup_timeout_s)
    try:
        httpx.get(handle.url + "/metrics", timeout=10).raise_for_status()
        yield RunningGateway(handle, app)
    finally:
        handle.stop()
