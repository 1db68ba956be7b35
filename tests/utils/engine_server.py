"""Run an engine behind the SGLang-compatible server on a free localhost port, in a background thread.

The engine is built, started, served and closed inside the server thread's own event loop, so
nothing asyncio-bound crosses threads; tests talk to it over real HTTP only.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from clawrl.engine.server import create_engine_app
from tests.utils.waiting import Failed, wait_until


CONTEXT = 256  # small, so "prompt longer than the context" is cheap to send
PROMPT = [1, 42, 7, 99, 512, 3]


def make_tiny_engine(tiny_dir: Path, **kw):
    """An EmbeddedEngine over the tiny model with a 256-token context (not started)."""
    from clawrl.engine.embedded import EmbeddedEngine

    kw.setdefault("max_batch_size", 8)
    return EmbeddedEngine(tiny_dir, max_context_len=CONTEXT, **kw)


def save_perturbed_copy(model_dir: Path, out: Path, scale: float = 0.05) -> Path:
    """``model_dir``'s weights plus seeded Gaussian noise, saved with ``save_pretrained`` to ``out``."""
    import torch

    from clawrl.models import load_causal_lm

    model = load_causal_lm(model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


@dataclass
class RunningServer:
    url: str
    engine: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    _server: Any = field(default=None, repr=False)

    def call(self, coro, timeout: float = 300.0):
        """Run a coroutine on the server's loop (e.g. to read engine state) and return its result; the
        timeout only guards against a hang (a weight swap under traffic takes long on a busy machine)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def running_engine_server(
    make_engine: Callable[[], Any],
    *,
    model_path: str = "tiny",
    served_model_name: str = "tiny",
    max_context_len: int = 4096,
    api_key: str | None = None,
) -> Iterator[RunningServer]:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it every response waits ~40 ms on Nagle + delayed ACK (headers and body are separate writes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; we hand the bound socket to uvicorn: no race
    port = sock.getsockname()[1]
    running = RunningServer(url=f"http://127.0.0.1:{port}")
    failure: list[BaseException] = []

    async def main() -> None:
        engine = make_engine()
        start = getattr(engine, "start", None)
        if start is not None:
            await start()
        running.engine, running.loop = engine, asyncio.get_running_loop()
        app = create_engine_app(engine, model_path=model_path, served_model_name=served_model_name,
                                max_context_len=max_context_len, max_running_requests=16, api_key=api_key)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
        running._server = server
        try:
            await server.serve(sockets=[sock])
        finally:
            await engine.close()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to the test below
            failure.append(e)

    thread = threading.Thread(target=thread_main, name=f"engine-server-{port}", daemon=True)
    thread.start()

    def healthy() -> bool:
        if failure:
            raise Failed(f"engine server failed to start: {failure[0]!r}") from failure[0]
        return httpx.get(f"{running.url}/health", timeout=10.0).status_code == 200

    wait_until(healthy, f"the engine server at {running.url} to answer /health", poll_s=0.05)
    try:
        yield running
    finally:
        if running._server is not None:
            running._server.should_exit = True
        thread.join(timeout=30)
        sock.close()
