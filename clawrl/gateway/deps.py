"""Request dependencies: who is calling (API key -> namespace) and the session headers."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Header, Request
from pydantic import ValidationError

from clawrl.gateway.schemas import ChatCompletionRequest
from clawrl.gateway.service import ChatService, GatewayError, TurnContext

OPEN_NAMESPACE = "open"


def namespace_for_key(key: str) -> str:
    """Sessions are namespaced by a digest of the key (the key itself is never stored)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def check_api_key(presented: str | None, keys: list[str]) -> str:
    """The caller's namespace; 401 unless the key matches one configured key.

    Every configured key is compared with ``hmac.compare_digest`` and the loop never exits early,
    so the time taken does not reveal which key (or how much of one) matched.
    """
    if not keys:
        return OPEN_NAMESPACE
    if not presented:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error")
    matched = None
    for k in keys:
        if hmac.compare_digest(presented.encode(), k.encode()):
            matched = k
    if matched is None:
        raise GatewayError(401, "invalid API key", "authentication_error")
    return namespace_for_key(matched)


async def get_service(request: Request) -> ChatService:
    return request.app.state.service


async def get_namespace(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    token = None
    if authorization:
        scheme, _, value = authorization.partition(" ")
        token = value.strip() if scheme.lower() == "bearer" else None
    return check_api_key(token, request.app.state.api_keys)


def _flag(v: str | None) -> bool | None:
    if v is None:
        return None
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise GatewayError(400, f"X-Session-Done must be true or false, got {v!r}", param="X-Session-Done")


async def get_turn_context(
    namespace: Annotated[str, Depends(get_namespace)],
    x_session_id: Annotated[str | None, Header()] = None,
    x_turn_type: Annotated[str | None, Header()] = None,
    x_session_done: Annotated[str | None, Header()] = None,
) -> TurnContext:
    turn_type = x_turn_type.strip().lower() if x_turn_type else None
    return TurnContext(namespace=namespace, session_id=x_session_id, turn_type=turn_type,
                       session_done=_flag(x_session_done))


def turn_context_from_headers(headers, api_keys: list[str]) -> TurnContext:
    """The same as the dependencies above, for the chat route's fast path (no dependency solver)."""
    authorization = headers.get("authorization")
    token = None
    if authorization:
        scheme, _, value = authorization.partition(" ")
        token = value.strip() if scheme.lower() == "bearer" else None
    turn_type = headers.get("x-turn-type")
    return TurnContext(namespace=check_api_key(token, api_keys), session_id=headers.get("x-session-id"),
                       turn_type=turn_type.strip().lower() if turn_type else None,
                       session_done=_flag(headers.get("x-session-done")))


def parse_chat_request(raw: bytes) -> ChatCompletionRequest:
    """Validate a chat-completions body; errors become 400s naming the field (or the JSON error)."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            raise GatewayError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}") from None
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", "invalid request")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise GatewayError(400, f"{loc}: {msg}{more}" if loc else f"{msg}{more}", param=loc or None) from None


ServiceDep = Annotated[ChatService, Depends(get_service)]
TurnContextDep = Annotated[TurnContext, Depends(get_turn_context)]
NamespaceDep = Annotated[str, Depends(get_namespace)]
