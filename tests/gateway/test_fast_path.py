"""The chat route's fast path pieces that read the raw ASGI request (headers, body)."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from clawrl.gateway.deps import namespace_for_key, turn_context_from_headers
from clawrl.gateway.routes import read_body
from clawrl.gateway.service import GatewayError


def receiver(*messages):
    it = iter(messages)

    async def receive():
        return next(it)

    return receive


def test_turn_context_reads_the_session_headers_first_one_wins():
    raw = [(b"host", b"x"), (b"x-session-id", b"s-1"), (b"x-turn-type", b" Side "),
           (b"x-session-done", b"yes"), (b"x-session-id", b"s-2"), (b"authorization", b"Bearer k1")]
    ctx = turn_context_from_headers(raw, ["k0", "k1"])
    assert (ctx.namespace, ctx.session_id, ctx.turn_type, ctx.session_done) == (namespace_for_key("k1"), "s-1", "side", True)
    bare = turn_context_from_headers([(b"host", b"x")], [])
    assert (bare.namespace, bare.session_id, bare.turn_type, bare.session_done) == ("open", None, None, None)
    with pytest.raises(GatewayError) as e:
        turn_context_from_headers([(b"authorization", b"Bearer nope")], ["k1"])
    assert e.value.status == 401
    with pytest.raises(GatewayError) as e:
        turn_context_from_headers([(b"x-session-done", b"maybe")], [])
    assert e.value.status == 400 and e.value.param == "X-Session-Done"


def test_read_body_joins_chunks_and_reports_a_client_that_left():
    one = receiver({"type": "http.request", "body": b'{"a": 1}', "more_body": False})
    assert asyncio.run(read_body(one)) == b'{"a": 1}'
    chunks = receiver({"type": "http.request", "body": b'{"a"', "more_body": True},
                      {"type": "http.request", "body": b"", "more_body": True},
                      {"type": "http.request", "body": b": 2}"})
    assert asyncio.run(read_body(chunks)) == b'{"a": 2}'
    assert asyncio.run(read_body(receiver({"type": "http.request"}))) == b""
    left = receiver({"type": "http.request", "body": b'{"a"', "more_body": True}, {"type": "http.disconnect"})
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_body(left))
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_body(receiver({"type": "http.disconnect"})))
