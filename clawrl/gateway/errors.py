"""The gateway's errors: an HTTP status with an OpenAI-style body, and the refusals that have
OpenAI's or SGLang's own wording."""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

from clawrl.engine.types import BadRequestError, EngineOverloadedError, EngineTimeoutError


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers  # e.g. Retry-After on a 503
        self.code = code  # OpenAI's machine-readable code where it has one; else None (null), as OpenAI's

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_error(loc: str, kind: str, message: str, param: str | None = None) -> GatewayError:
    """A 400 for the request field at ``loc`` that failed validation (pydantic's error ``kind`` and
    ``message``), in OpenAI's words and with its code: "Missing required parameter: 'model'."
    (``missing_required_parameter``), else ``loc: message`` (``unknown_parameter`` for a field
    not taken, ``invalid_type`` for a value of the wrong type, ``invalid_value`` for any other)."""
    if kind == "missing":
        return GatewayError(400, f"Missing required parameter: '{loc}'.", param=param or loc,
                            code="missing_required_parameter")
    code = ("unknown_parameter" if kind == "extra_forbidden" else
            "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return GatewayError(400, f"{loc}: {message}", param=param or loc, code=code)


def context_length_error(limit: int, prompt_tokens: int, completion_tokens: int | None = None) -> GatewayError:
    """A request that does not fit the model's context, answered in OpenAI's words and with its code
    (``context_length_exceeded``), which agents such as OpenClaw read as "compact the conversation"."""
    if completion_tokens is None:
        message = (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                   f"{prompt_tokens} tokens. Please reduce the length of the messages.")
    else:
        message = (f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, {completion_tokens} "
                   "in the completion). Please reduce the length of the messages or completion.")
    return GatewayError(400, message, param="messages", code="context_length_exceeded")


# An HTTP engine's own refusals, in SGLang's words (the embedded engine uses the first one too)
_INPUT_TOO_LONG = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_TOTAL_TOO_LONG = re.compile(r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: "
                             r"(\d+) tokens from the input messages and (\d+) tokens for the completion")


def engine_context_error(message: str) -> GatewayError | None:
    """The OpenAI answer for an engine's context refusal, or None if ``message`` is another refusal."""
    if m := _INPUT_TOO_LONG.search(message):
        return context_length_error(int(m[2]), int(m[1]))
    if m := _TOTAL_TOO_LONG.search(message):
        return context_length_error(int(m[1]), int(m[2]), int(m[3]))
    return None


def sampling_error(e: BadRequestError) -> GatewayError:
    """The engine's sampling_params complaint naming the request field, kept short (it may quote a
    value the client sent, e.g. a large logit_bias). The engine's names are the request's own for
    every field it can refuse: max_tokens and seed, whose names differ, are range-checked by the
    request schema before the engine sees them."""
    msg = str(e).removeprefix("sampling_params.")
    name = msg.split(" ", 1)[0].rstrip(":")
    return GatewayError(400, msg if len(msg) <= 300 else msg[:297] + "...", param=name if name.isidentifier() else None)


def engine_failure(e: Exception, stall_s: float) -> GatewayError:
    """The answer to a failed engine call: 504 when the engine stalled, 400 for a request the engine
    refused, 503 when it is at capacity, 502 when it is unreachable or broke (a GatewayError stays as it is)."""
    if isinstance(e, GatewayError):
        return e
    if isinstance(e, (TimeoutError, EngineTimeoutError)):  # a bare TimeoutError is until_stalled's
        stall = f"the engine sent nothing for {stall_s:g} s ([engine] stall_timeout_s)"
        return GatewayError(504, str(e) if isinstance(e, EngineTimeoutError) else stall, "engine_timeout")
    if isinstance(e, BadRequestError):
        return engine_context_error(str(e)) or GatewayError(400, str(e))
    if isinstance(e, EngineOverloadedError):
        return GatewayError(503, f"the engine is at capacity: {e}; retry later", "service_unavailable",
                            headers={"Retry-After": "1"})
    return GatewayError(502, f"engine unavailable: {e}", "engine_unavailable")
