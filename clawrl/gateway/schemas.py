"""OpenAI chat-completions request shape, fields in the spec's order; the response shapes are the
openai SDK's own types, with clawrl's fields added.

Our extensions are grouped at the end of the request and marked: ``session_id``, ``turn_type``,
``session_done`` (also accepted as headers ``X-Session-Id`` / ``X-Turn-Type`` / ``X-Session-Done``);
they are stripped before generation. Responses add ``session_id`` and ``weight_version`` as extra
top-level fields (OpenAI clients ignore unknown fields) and as headers.
"""

from __future__ import annotations

from typing import Any, Literal

import openai.types
from openai.types import chat as openai_chat
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from clawrl.chat import ChatMessage, Lenient, ToolDef


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatCompletionRequest(Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0, description="vLLM's extension: no stop before this many tokens.")
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
    prompt_cache_key: str | None = None  # with user and metadata.session_id: a session id (sessions.py)
    metadata: dict[str, Any] | None = None
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


class ResponsesRequest(Lenient):
    """OpenAI's Responses API request (``POST /v1/responses``), served as a chat completion (responses.py)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools are offered; other types are left out
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # false: the response cannot be continued by previous_response_id (it is still logged)
    metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # --- clawrl extensions (also accepted as X-Session-Id / X-Turn-Type / X-Session-Done headers) ---
    session_id: str | None = None
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None


class CompletionRequest(Lenient):
    """OpenAI's legacy completions request (``POST /v1/completions``): text in, text out, no chat template."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default
    n: int = 1
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None
    # --- clawrl extensions (also accepted as X-Session-Id / X-Turn-Type / X-Session-Done headers) ---
    session_id: str | None = None
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None


class Choice(openai_chat.chat_completion.Choice):
    finish_reason: str  # OpenAI's reasons, and "abort": the engine aborted the generation


class ChatCompletion(openai_chat.ChatCompletion):
    """OpenAI's chat.completion, as the openai SDK defines it, and clawrl's fields."""

    choices: list[Choice]
    # --- clawrl extensions ---
    session_id: str
    turn_type: str
    turn_index: int
    weight_version: str


class ModelCard(openai.types.Model):
    object: Literal["model"] = "model"
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
    code: str | None = None  # OpenAI's machine-readable code (missing_required_parameter, ...), or null


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
    exclude_sessions: list[str] = Field(default_factory=list, description="'NAMESPACE:SESSION_ID' each (a bare "
                                        "session id where only one API-key namespace uses it).")
    reason: str = ""
    set: list[str] = Field(default_factory=list, description="Counterfactual overrides, 'SECTION.KEY=VALUE'.")
