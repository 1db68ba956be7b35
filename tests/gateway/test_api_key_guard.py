"""ApiKeyGuard, the ASGI layer that checks API keys under /v1 before a body is read."""

import asyncio

import orjson

from clawrl.gateway.deps import ApiKeyGuard
from clawrl.ids import namespace_for_key
from clawrl.records import OPEN_NAMESPACE


def _call(api_keys: list[str], path: str, *, root_path: str = "", key: str | None = None, method: str = "POST"):
    """(status sent, the scope that the app behind the guard saw or None, the response body)."""
    seen, sent = [], []

    async def app(scope, receive, send):
        seen.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path, "headers": headers}
    asyncio.run(ApiKeyGuard(app, api_keys=api_keys)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], (seen[0] if seen else None), body


def test_keys_are_checked_under_v1_also_behind_a_root_path():
    for root in ("", "/api"):
        status, seen, body = _call(["k1"], "/v1/chat/completions", root_path=root)
        assert status == 401 and seen is None, root  # the app behind it never ran
        assert orjson.loads(body)["error"]["message"] == "missing API key: send 'Authorization: Bearer <key>'"
        status, seen, body = _call(["k1"], "/v1/models", root_path=root, key="nope", method="GET")
        assert status == 401 and seen is None and orjson.loads(body)["error"]["message"] == "invalid API key"
        status, seen, _ = _call(["k1"], "/v1/models", root_path=root, key="k1", method="GET")
        assert status == 200 and seen["state"]["namespace"] == namespace_for_key("k1")


def test_other_paths_and_open_mode_pass():
    status, seen, _ = _call(["k1"], "/healthz", method="GET")  # not under /v1: no key asked, no namespace set
    assert status == 200 and "state" not in seen
    status, seen, _ = _call([], "/v1/chat/completions")  # open mode: everyone shares the open namespace
    assert status == 200 and seen["state"]["namespace"] == OPEN_NAMESPACE
