"""A small HTTP/1.1 client for the one call on the gateway's hot path: ``POST /generate``.

Every served turn makes exactly one such call, so its cost is paid on every request. Measured in
front of the tiny CPU engine on the 2-core machine (docs/benchmarks.md, gateway overhead), a
do-nothing Python pass-through adds +1.20 ms p50 at concurrency 16 when it forwards with aiohttp and
+0.68 .. +0.78 ms with this client (646 vs ~300 us of CPU a request): aiohttp builds a request object,
a response object, a stream reader, a payload writer and a task or two per call; this client
writes one buffer and feeds the answer to httptools' parser (llhttp, the parser uvicorn uses).

What it does: keep-alive connections in a last-in-first-out pool (no cap on open connections: the
engine bounds concurrency itself); content-length and chunked bodies, read whole or piece by piece
as they arrive (SSE); ``Connection: close`` honoured; plain http and https. A request that fails on
a *reused* connection before any byte of its answer arrived is sent once more on a new connection:
the server closed the idle connection as it was being written (uvicorn, under SGLang and
``clawrl engine``, drops keep-alive connections after 5 s idle). A deadline per request (connect,
send and the whole answer) closes the connection when it passes; so does leaving the exchange early
(the caller cancelled, or stopped reading a stream), which is how the server learns to stop
generating. A pool belongs to the event loop that first used it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools


class HTTPError(Exception):
    """Transport failure; ``str()`` says what happened, for the caller to put in its own message."""


class ConnectFailed(HTTPError):
    """No connection could be made (the cause is the OSError)."""


class ConnectionClosed(HTTPError):
    """The connection ended before the answer did."""


class ProtocolError(HTTPError):
    """The server answered something that is not HTTP/1.1."""


class DeadlineExceeded(HTTPError, TimeoutError):
    """The request's deadline passed."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the ``on_*`` methods while it parses an answer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.start()

    def start(self) -> None:
        """Ready for the next answer."""
        self.status = 0
        self.head = self.complete = self.received = self.keep_alive = False
        self.chunks: list[bytes] = []
        self.error: HTTPError | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.complete:  # a second answer to one request (on_headers_complete refused it)
                self.keep_alive = False  # keep the first; the connection is not used again
            else:
                self.fail(ProtocolError(f"malformed HTTP response: {e}"))
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self.fail(ConnectionClosed("connection closed before the response ended"
                                       + (f" ({exc})" if exc else "")))
        self._wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.complete:
            raise ProtocolError("an answer nobody asked for")  # stops the parser: feed_data raises
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message ends
        self.head = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # ours
    def fail(self, error: HTTPError) -> None:
        """End the connection with ``error``: whoever waits on it raises it."""
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def changed(self) -> None:
        """Until the next bytes arrive, the connection ends or the deadline passes."""
        if self.error is not None:
            raise self.error
        self.waiter = self.loop.create_future()
        await self.waiter
        if self.error is not None:
            raise self.error


class _HeaderConnection(_Connection):
    """A connection that also keeps the answer's headers (``Pool(keep_headers=True)``); the plain one
    gives httptools no ``on_header`` callback, so the gateway's engine calls do not pay for them."""

    def start(self) -> None:
        super().start()
        self.headers: dict[str, str] = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text  # RFC 9110 5.3


class Pool:
    """Keep-alive connections to the server at ``base_url`` (scheme, host, port and an optional
    path prefix); ``headers`` go with every request. With ``keep_headers`` each answer's headers are
    read into :attr:`Exchange.headers` (names in lower case, a repeated one joined with ", ")."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 120.0,
                 max_idle: int = 256, keep_headers: bool = False):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port:
            netloc += f":{parts.port}"
        lines = [f"Host: {netloc}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._head_tail = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self.timeout_s, self.max_idle = timeout_s, max_idle
        self._connection = _HeaderConnection if keep_headers else _Connection
        self._idle: list[_Connection] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def post(self, path: str, body: bytes, content_type: str = "application/json") -> Exchange:
        """``async with pool.post(path, body) as answer``: the answer once its status line and
        headers arrived; read its body with :meth:`Exchange.read` or :meth:`Exchange.chunks`."""
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n").encode("latin-1") + self._head_tail + b"\r\n"
        return Exchange(self, head + body)

    @property
    def idle_connections(self) -> int:
        return sum(not c.closed for c in self._idle)

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(lambda: self._connection(loop), self.host, self.port,
                                                       ssl=self.ssl)
        except TimeoutError:
            raise DeadlineExceeded(f"no connection within {self.timeout_s:g} s") from None
        except OSError as e:
            raise ConnectFailed(e.strerror or str(e) or type(e).__name__) from e
        return conn

    def _take_idle(self) -> _Connection | None:
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # connections belong to the loop that made them
            self._idle, self.loop = [], loop
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.received:
                return conn
            conn.close()  # closed by the server, or it sent something unasked (e.g. a 408 before closing)
        return None

    def _give_back(self, conn: _Connection) -> None:
        if conn.closed or not conn.keep_alive or len(self._idle) >= self.max_idle:
            conn.close()
        else:
            conn.start()
            self._idle.append(conn)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Exchange:
    """One request and its answer (see :meth:`Pool.post`)."""

    def __init__(self, pool: Pool, request: bytes):
        self.pool, self.request = pool, request
        self.conn: _Connection | None = None
        self.status = 0
        self.headers: dict[str, str] = {}  # filled only by a Pool(keep_headers=True)
        self._timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> Exchange:
        pool = self.pool
        deadline = asyncio.get_running_loop().time() + pool.timeout_s
        conn = pool._take_idle()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await pool._connect(deadline)
            self.conn = conn
            if self._timer is not None:
                self._timer.cancel()
            self._timer = conn.loop.call_at(deadline, self._expire)
            conn.transport.write(self.request)  # type: ignore[union-attr]
            try:
                while not conn.head:
                    await conn.changed()
                self.status = conn.status
                self.headers = getattr(conn, "headers", self.headers)
                return self
            except ConnectionClosed:
                self._end(keep=False)
                if not reused or conn.received:
                    raise
                conn, reused = None, False  # the server closed it while idle: once more, on a new one
            except BaseException:
                self._end(keep=False)
                raise

    async def __aexit__(self, exc_type, exc, tb) -> None:
        conn = self.conn
        self._end(keep=exc_type is None and conn is not None and conn.complete and conn.error is None)

    def _expire(self) -> None:
        if self.conn is not None:
            self.conn.fail(DeadlineExceeded(f"no complete answer within {self.pool.timeout_s:g} s"))

    def _end(self, keep: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if keep:
            self.pool._give_back(conn)
        else:
            conn.close()

    async def read(self) -> bytes:
        """The whole body."""
        conn = self.conn
        assert conn is not None, "read inside the async with block"
        while not conn.complete:
            await conn.changed()
        body = b"".join(conn.chunks)
        conn.chunks = []
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives (chunked transfer encoding already removed)."""
        conn = self.conn
        assert conn is not None, "read inside the async with block"
        while True:
            if conn.chunks:
                pieces, conn.chunks = conn.chunks, []
                yield b"".join(pieces)
            if conn.complete:
                return
            await conn.changed()
