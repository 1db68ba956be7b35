"""clawrl.engine.http1 against real sockets: a raw asyncio server that answers exactly the bytes each
test scripts (keep-alive, chunked, closing at the worst moment), and aiohttp's server for the
ordinary cases."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from clawrl.engine import http1


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


class Scripted:
    """A TCP server; ``answer(conn_no, req_no, head)`` returns what to send back: bytes, or a list of
    bytes, float (seconds to wait) and None (close the connection here); None alone closes it
    without answering. Records every connection and request."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests = answer, 0, []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_no, req_no = self.connections, 0
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append((conn_no, head, body))
                reply = self.answer(conn_no, req_no, head)
                req_no += 1
                for part in reply if isinstance(reply, list) else [reply]:
                    if part is None:  # close the connection here
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    else:
                        writer.write(part)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self):
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_reuses_one_connection_and_sends_prefix_host_and_headers():
    srv = Scripted(lambda c, r, head: ok(b'{"n": %d}' % r))

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url + "/v2/", headers={"Authorization": "Bearer k"})
            bodies = []
            for i in range(5):
                async with pool.post("/generate", b'{"i": %d}' % i) as answer:
                    bodies.append((answer.status, await answer.read()))
            await pool.close()
            return url, bodies

    url, bodies = run(main())
    assert bodies == [(200, b'{"n": %d}' % i) for i in range(5)]
    assert srv.connections == 1 and len(srv.requests) == 5
    head = srv.requests[0][1].decode()
    assert head.startswith("POST /v2/generate HTTP/1.1\r\n")
    assert f"Host: {url.removeprefix('http://')}\r\n" in head and "Authorization: Bearer k\r\n" in head
    assert "Content-Length: 8\r\n" in head and srv.requests[3][2] == b'{"i": 3}'


def test_headers_are_kept_only_when_asked_per_answer_on_a_reused_connection():
    """keep_headers: each answer's own headers (lower-case names, a repeated one joined with ", "),
    fresh for the next answer on the same connection; without it nothing is parsed into them."""
    srv = Scripted(lambda c, r, head: ok(b"{}", b"Server-Timing: gateway;dur=%d\r\nX-A: 1\r\nx-a: 2\r\n" % r
                                         if r == 0 else b"X-Other: yes\r\n"))

    async def main():
        async with srv.running() as url:
            seen = []
            for keep in (True, False):
                pool = http1.Pool(url, keep_headers=keep)
                for _ in range(2):
                    async with pool.post("/x", b"{}") as answer:
                        await answer.read()
                        seen.append(dict(answer.headers))
                await pool.close()
            return seen

    kept0, kept1, plain0, plain1 = run(main())
    assert kept0 == {"content-type": "application/json", "content-length": "2", "server-timing": "gateway;dur=0",
                     "x-a": "1, 2"}
    assert kept1 == {"content-type": "application/json", "content-length": "2", "x-other": "yes"}
    assert plain0 == plain1 == {}
    assert srv.connections == 2  # one per pool: the headers were read on a kept-alive connection


def test_concurrent_requests_each_get_a_connection_then_all_are_kept():
    srv = Scripted(lambda c, r, head: [0.05, ok(b"{}")])

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)

            async def one():
                async with pool.post("/generate", b"{}") as answer:
                    return await answer.read()

            assert await asyncio.gather(*(one() for _ in range(4))) == [b"{}"] * 4
            kept = pool.idle_connections
            assert await asyncio.gather(*(one() for _ in range(4))) == [b"{}"] * 4
            await pool.close()
            return kept

    assert run(main()) == 4
    assert srv.connections == 4 and len(srv.requests) == 8  # the second round reused all four


def test_chunked_body_read_piece_by_piece_as_it_arrives():
    chunks = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    script = [head]
    for c in chunks:
        script += [b"%x\r\n%s\r\n" % (len(c), c), 0.05]
    script.append(b"0\r\n\r\n")
    srv = Scripted(lambda c, r, h: script)

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            got, stamps = [], []
            async with pool.post("/generate", b"{}") as answer:
                async for piece in answer.chunks():
                    got.append(piece)
                    stamps.append(time.monotonic())
            async with pool.post("/generate", b"{}") as answer:  # same connection, read whole
                whole = await answer.read()
            await pool.close()
            return got, stamps, whole

    got, stamps, whole = run(main())
    assert got == chunks  # one piece per chunk: each arrived 50 ms after the previous
    assert stamps[-1] - stamps[0] >= 0.08
    assert whole == b"".join(chunks) and srv.connections == 1


def test_idle_connection_closed_by_the_server_is_retried_once_on_a_new_one():
    # The server drops a kept-alive connection when its second request arrives, without answering
    # (what a keep-alive timeout firing as the request is written looks like).
    srv = Scripted(lambda c, r, head: ok(b'{"c": %d}' % c) if r == 0 else None)

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            out = []
            for _ in range(3):
                async with pool.post("/generate", b"{}") as answer:
                    out.append(await answer.read())
            await pool.close()
            return out

    assert run(main()) == [b'{"c": 0}', b'{"c": 1}', b'{"c": 2}']
    assert srv.connections == 3 and len(srv.requests) == 5  # two requests were sent twice


def test_a_new_connection_that_closes_unanswered_is_an_error_not_a_retry():
    srv = Scripted(lambda c, r, head: None)

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            with pytest.raises(http1.ConnectionClosed, match="closed before the response ended"):
                async with pool.post("/generate", b"{}"):
                    pass

    run(main())
    assert srv.connections == 1 and len(srv.requests) == 1


def test_body_cut_short_and_malformed_answers_are_errors_and_never_pooled():
    def answer(c, r, head):
        if b"/short" in head:
            return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789", 0.05, None]
        return b"SMTP ready\r\n\r\n"

    srv = Scripted(answer)

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            async with pool.post("/short", b"{}") as reply:
                with pytest.raises(http1.ConnectionClosed):
                    await reply.read()
            with pytest.raises(http1.ProtocolError, match="malformed HTTP response"):
                async with pool.post("/bad", b"{}"):
                    pass
            return pool.idle_connections

    assert run(main()) == 0


def test_an_answer_nobody_asked_for_is_dropped_with_its_connection():
    # The first answer comes with a second one glued to it (a 408 some servers send before closing
    # an idle connection); on the second connection the 408 arrives later, while it sits idle.
    late_408 = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"
    srv = Scripted(lambda c, r, head: ok(b'{"c": 0}') + late_408 if c == 0 else [ok(b'{"c": %d}' % c), 0.05, late_408])

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            out = []
            for pause in (0, 0.2, 0):
                async with pool.post("/generate", b"{}") as answer:
                    out.append((answer.status, await answer.read()))
                await asyncio.sleep(pause)
            return out

    assert run(main()) == [(200, b'{"c": 0}'), (200, b'{"c": 1}'), (200, b'{"c": 2}')]
    assert srv.connections == 3 and len(srv.requests) == 3  # neither poisoned connection was used again


def test_connection_close_answer_is_not_pooled():
    srv = Scripted(lambda c, r, head: [ok(b"{}", b"Connection: close\r\n"), None])

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url)
            for _ in range(2):
                async with pool.post("/generate", b"{}") as answer:
                    assert await answer.read() == b"{}"
            return pool.idle_connections

    assert run(main()) == 0
    assert srv.connections == 2


def test_deadline_covers_the_whole_answer_and_closes_the_connection():
    srv = Scripted(lambda c, r, head: [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab", 5.0, b"cd"]
                   if b"/slow-body" in head else [5.0, ok(b"{}")])

    async def main():
        async with srv.running() as url:
            pool = http1.Pool(url, timeout_s=0.3)
            t0 = time.monotonic()
            with pytest.raises(http1.DeadlineExceeded, match="no complete answer within 0.3 s"):
                async with pool.post("/slow-head", b"{}"):
                    pass
            t1 = time.monotonic()
            async with pool.post("/slow-body", b"{}") as answer:
                with pytest.raises(TimeoutError):
                    await answer.read()
            return t1 - t0, time.monotonic() - t1, pool.idle_connections

    head_s, body_s, idle = run(main())
    assert 0.25 < head_s < 1.5 and 0.25 < body_s < 1.5 and idle == 0


def test_leaving_a_stream_early_closes_the_connection_so_the_server_stops():
    disconnected = asyncio.Event()

    async def endless(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: x\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            disconnected.set()
            raise

    async def main():
        app = web.Application()
        app.router.add_post("/generate", endless)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            pool = http1.Pool(str(server.make_url("")))
            async with pool.post("/generate", b"{}") as answer:
                async for piece in answer.chunks():
                    assert piece.startswith(b"data: x")
                    break
            await asyncio.wait_for(disconnected.wait(), 5)
            return pool.idle_connections
        finally:
            await server.close()

    assert run(main()) == 0


def test_refused_connection_and_bad_urls():
    async def main():
        pool = http1.Pool("http://127.0.0.1:1")
        with pytest.raises(http1.ConnectFailed) as info:
            async with pool.post("/generate", b"{}"):
                pass
        return info.value

    err = run(main())
    assert isinstance(err.__cause__, ConnectionRefusedError)
    for bad in ("ftp://x/", "127.0.0.1:30000", "http:///generate"):
        with pytest.raises(ValueError, match="not an http\\(s\\) URL"):
            http1.Pool(bad)
    assert http1.Pool("https://sglang.example").port == 443
    assert http1.Pool("http://[::1]:30000")._head_tail.startswith(b"Host: [::1]:30000\r\n")
