"""Where a server can listen and be reached: whether ``host:port`` is free to bind now, free ports to hand
to servers that bind them later, and the URL a client on this machine uses for a bind address."""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Iterable
from pathlib import Path


# How long our servers keep an idle keep-alive connection. uvicorn's default is 5 s, the same as the
# idle expiry of httpx's pool (the openai SDK) and near Node's (4-5 s): a client can then send its next
# request on a connection in the instant the server closes it, and gets a connection error it did not
# cause (seen on a loaded machine, where a client thread can sit 5 s between two requests). Holding
# idle connections longer than clients do leaves the closing to the client, which never races itself.
SERVER_KEEPALIVE_S = 75

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
