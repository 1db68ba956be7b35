"""OpenAI chat-completions request/response shapes, fields in the spec's order.

Our extensions are grouped at the end of the request and marked: ``session_id``, ``turn_type``,
``session_done`` (also accepted as headers ``X-Session-Id`` / ``X-Turn-Type`` / ``X-Session-Done``);
they are stripped before generation. Responses add ``session_id`` and ``weight_version`` as extra
top-level fields (OpenAI clients ignore unknown fields) and as headers.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Lenient(BaseModel):
    # Clients send fields we do not act on (user metadata, store, service_tier...): accept them.
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"  # a JSON string, as in OpenAI's API

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, v: str) -> str:
        if v.strip():
            try:
                json.loads(v)
            except ValueError:
                raise ValueError("must be the call's arguments as a JSON-encoded string, "
                                 "e.g. '{\"city\": \"Paris\"}'") from None
        return v


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_json_schema(v)
        return v


JSON_SCHEMA_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def check_json_schema(schema: Any, path: str = "parameters") -> None:
    """Raise ValueError naming the first place where ``schema`` is not a JSON Schema: the shape
    checks a tool's ``parameters`` needs (the model is shown the schema, so garbage in it would
    be trained on), not a full meta-schema validation."""
    if isinstance(schema, bool):  # true / false are schemas too
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must be a JSON Schema object, got {type(schema).__name__}")
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    for one in types:
        if one not in JSON_SCHEMA_TYPES:
            raise ValueError(f"{path}.type must be one of {', '.join(sorted(JSON_SCHEMA_TYPES))} (or a list "
                             f"of them), got {one!r:.80}")
    req = schema.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise ValueError(f"{path}.required must be a list of property names")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, dict):
                raise ValueError(f"{path}.{key} must be an object mapping names to schemas")
            for name, s in sub.items():
                check_json_schema(s, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                raise ValueError(f"{path}.{key} must be a list of schemas")
            for i, s in enumerate(schema[key]):
                check_json_schema(s, f"{path}.{key}.{i}")
    for key in _SUBSCHEMAS:
        if key in schema:
            check_json_schema(schema[key], f"{path}.{key}")


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    # --- clawrl extensions (also accepted as X-Session-Id / X-Turn-Type / X-Session-Done headers) ---
    session_id: str | None = None
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []  # validated before tool_choice (field order)
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"must be 'none', 'auto', 'required' or {{'type': 'function', ...}}, got {choice!r:.80}")
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError("must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
            if name not in {t.function.name for t in tools}:
                raise ValueError(f"names function {name!r:.80}, which is not in tools")
        elif choice == "required" and not tools:
            raise ValueError("'required' needs at least one tool in tools")
        return choice


# ------------------------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    # --- clawrl extensions ---
    session_id: str
    turn_type: str
    turn_index: int
    weight_version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "clawrl"
    root: str | None = None
    max_model_len: int | None = None
    weight_version: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- clawrl extensions: reading one's own session, admin requests ---


class SessionTurn(BaseModel):
    turn_index: int
    turn_type: str
    text: str
    weight_version: str
    finish_reason: str | None = None
    created_at: str  # ISO 8601, UTC
    has_next_state: bool | None = Field(
        None, description="true: the next state arrived; false: none will come; null: still waiting.")
    next_state_reason: str | None = None


class SessionLog(BaseModel):
    """``GET /v1/sessions/{id}``: the caller's own session as the log holds it."""

    id: str
    object: Literal["session"] = "session"
    open: bool  # the gateway still waits for more turns of it
    turns: list[SessionTurn]


class ReplayRequest(BaseModel):
    """``POST /admin/replay``: the `replay/on-demand` deployment's parameters. Give ``version`` (a
    weight version or 'latest') or ``run_id`` (the MLflow run that trained a version), not both."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = None
    run_id: str | None = None
    exclude_sessions: list[str] = Field(default_factory=list)
    reason: str = ""
    set: list[str] = Field(default_factory=list, description="Counterfactual overrides, 'SECTION.KEY=VALUE'.")
