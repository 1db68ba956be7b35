"""Run an ASGI app under uvicorn on a background thread (the gateway inside `clawrl demo`, tests), and
``<data_root>/serve.json``: where the `clawrl serve` of a data root answers, for `clawrl train`,
`clawrl sync` and `clawrl status` to find its engine without being told."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from clawrl.lineage import pid_alive


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


SERVE_RECORD = "serve.json"


# bind addresses that mean every address of the machine, and the loopback address a client here uses for each
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (the port taken, the address not this
    machine's), or None when it can: checked before a model loads, so a taken port is told at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"port {port} on {host} is in use by another process"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this machine"
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]


def free_api_port() -> int:
    """A free port for ``[server] api_port`` whose derived ports (``clawrl.config.PORT_OFFSETS``: the engines
    `clawrl up` starts) are free too."""
    from clawrl.config import PORT_OFFSETS

    while True:
        [port] = free_ports(1, span=max(PORT_OFFSETS.values()))
        derived = [port + offset for offset in PORT_OFFSETS.values()]
        if derived[-1] < 65536 and all(listen_problem("127.0.0.1", p) is None for p in derived):
            return port


# Ports a server is given to bind later come from below the kernel's ephemeral range (what outgoing
# connections get: Linux's default 32768-60999); a port from that range can be taken by any process's
# outgoing connection between the draw and the server's bind ("address already in use").
PORT_FLOOR = 10000
EPHEMERAL_LOW_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_LOW_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, avoid: Iterable[int] = (), span: int = 0) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that nothing listens on now, none of ``avoid`` (ports
    handed out before and not bound yet), drawn at random below the ephemeral range; with ``span``,
    ``port + span`` stays below it too."""
    high = _ephemeral_low() - span
    if high - PORT_FLOOR < 4 * n:  # an ephemeral range starting low: draw from above it
        return _kernel_ports(n, set(avoid))
    taken, ports, rng = set(avoid), [], random.SystemRandom()
    while len(ports) < n:
        port = rng.randrange(PORT_FLOOR, high)
        if port not in taken:
            taken.add(port)
            if listen_problem("127.0.0.1", port) is None:
                ports.append(port)
    return ports


def _kernel_ports(n: int, avoid: set[int]) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:  # every probe stays open until all are drawn, so none comes twice
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for a server bound to ``host`` (a wildcard: loopback)."""
    host = WILDCARD_HOSTS.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
