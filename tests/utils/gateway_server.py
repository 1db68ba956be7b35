"""Run a gateway app under uvicorn on a free localhost port in a background thread (tests)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from clawrl.serving import ServerThread, bind_socket, serve_in_thread
from tests.utils.waiting import CAP_S


class RunningGateway:
    def __init__(self, handle: ServerThread, app):
        self.handle, self.app, self.url = handle, app, handle.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def loop(self):
        return self.handle.loop

    def call(self, coro, timeout: float = 300.0):
        """Run ``coro`` on the server's loop; the timeout only guards against a hang (slow on a busy machine)."""
        return self.handle.call(coro, timeout)


def free_socket() -> socket.socket:
    return bind_socket("127.0.0.1", 0)


@contextmanager
def running_gateway(app) -> Iterator[RunningGateway]:
    # the startup (lifespan: the engine's model loaded) ends early only if the server's thread dies: on a busy
    # machine it is slow, and a hang is what the cap is for
    handle = serve_in_thread(app, startup_timeout_s=CAP_S)
    try:
        httpx.get(handle.url + "/metrics", timeout=60).raise_for_status()
        yield RunningGateway(handle, app)
    finally:
        handle.stop()
