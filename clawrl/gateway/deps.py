"""Request dependencies: who is calling (API key -> namespace, admin key -> admin routes) and the
session headers."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers

from clawrl.gateway.errors import GatewayError
from clawrl.gateway.service import ChatService, TurnContext
from clawrl.gateway.sessions import SESSION_ID_RE
from clawrl.records import OPEN_NAMESPACE


def namespace_for_key(key: str) -> str:
    """Sessions are namespaced by a digest of the key (the key itself is never stored)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _match(presented: str, keys: list[str]) -> str | None:
    """The configured key equal to ``presented``, or None. Every key is compared with
    ``hmac.compare_digest`` and the loop never exits early, so the time taken does not reveal
    which key (or how much of one) matched."""
    matched = None
    for k in keys:
        if hmac.compare_digest(presented.encode(), k.encode()):
            matched = k
    return matched


def check_api_key(presented: str | None, keys: list[str]) -> str:
    """The caller's namespace; 401 unless the key matches one configured key.

    Error messages never repeat the presented key (it may be a secret sent to the wrong server).
    """
    if not keys:
        return OPEN_NAMESPACE
    if not presented:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error")
    matched = _match(presented, keys)
    if matched is None:
        raise GatewayError(401, "invalid API key", "authentication_error")
    return namespace_for_key(matched)


def check_admin_key(presented: str | None, admin_keys: list[str], api_keys: list[str]) -> None:
    """Admin routes (/admin/*, the engine control API under /engine): pass with an admin key; 403 for
    a valid API key (authenticated, not allowed); 401 for no key or an unknown one. With no admin
    keys configured they are open only in open mode (no API keys either), else closed to everyone."""
    if not admin_keys and not api_keys:
        return
    if not presented:
        raise GatewayError(401, "missing admin key: send 'Authorization: Bearer <admin key>'", "authentication_error")
    is_admin, is_user = _match(presented, admin_keys), _match(presented, api_keys)  # both: no timing hint
    if is_admin is not None:
        return
    if is_user is not None:
        why = "" if admin_keys else " (no admin keys are configured: set the env var named by server.admin_keys_env)"
        raise GatewayError(403, f"this route needs an admin key; an API key is not enough{why}", "permission_error")
    raise GatewayError(401, "invalid admin key", "authentication_error")


def bearer_token(authorization: str | None) -> str | None:
    scheme, token = get_authorization_scheme_param(authorization)
    return token if scheme.lower() == "bearer" else None


class AdminGuard:
    """ASGI wrapper: every route of ``app`` but ``/health`` (liveness, no data) needs an admin key
    (``check_admin_key``).

    Plain ASGI (not BaseHTTPMiddleware) so SSE streams and client disconnects pass through untouched.
    Under a mount, paths are compared without the mount prefix, and a refusal raised here is
    answered by the outer app's GatewayError handler.
    """

    def __init__(self, app, *, admin_keys: list[str], api_keys: list[str]):
        self.app, self.admin_keys, self.api_keys = app, admin_keys, api_keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and path != "/health":
            check_admin_key(bearer_token(Headers(scope=scope).get("authorization")), self.admin_keys, self.api_keys)
        await self.app(scope, receive, send)


async def get_service(request: Request) -> ChatService:
    return request.app.state.service


async def get_namespace(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    return check_api_key(bearer_token(authorization), request.app.state.api_keys)


async def require_admin(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    check_admin_key(bearer_token(authorization), request.app.state.admin_keys, request.app.state.api_keys)


def _flag(v: str | None) -> bool | None:
    if v is None:
        return None
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise GatewayError(400, f"X-Session-Done must be true or false, got {v!r}", param="X-Session-Done")


# The session headers are checked by the service, whose 400s say where a bad value came from: FastAPI
# documents their shapes (json_schema_extra) without enforcing them. The key is read here too rather
# than through a sub-dependency: every dependency FastAPI solves adds to each completion's CPU time.
async def get_turn_context(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_session_id: Annotated[str | None, Header(
        alias="X-Session-Id", description="Session id (before the body's session_id); 1-128 characters from "
        "A-Z a-z 0-9 . _ : @ -.", json_schema_extra={"pattern": SESSION_ID_RE.pattern})] = None,
    x_turn_type: Annotated[str | None, Header(alias="X-Turn-Type", json_schema_extra={"enum": ["main", "side"]})] = None,
    x_session_done: Annotated[str | None, Header(alias="X-Session-Done", json_schema_extra={
        "enum": ["true", "false", "1", "0", "yes", "no", "on", "off"]})] = None,
) -> TurnContext:
    namespace = await get_namespace(request, authorization)
    turn_type = x_turn_type.strip().lower() if x_turn_type else None
    return TurnContext(namespace=namespace, session_id=x_session_id, turn_type=turn_type,
                       session_done=_flag(x_session_done))


ServiceDep = Annotated[ChatService, Depends(get_service)]
TurnContextDep = Annotated[TurnContext, Depends(get_turn_context)]
NamespaceDep = Annotated[str, Depends(get_namespace)]
