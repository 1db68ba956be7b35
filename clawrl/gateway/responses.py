"""OpenAI's Responses API (``POST /v1/responses``), served as a chat turn.

One conversation model: a request's ``instructions`` and ``input`` items become chat messages - a
message item the message of its role, ``function_call`` items the tool calls of the assistant
message they follow, a ``function_call_output`` a tool message, ``reasoning`` items nothing (no
text a model reads) - and ``previous_response_id`` puts the conversation of that response, read
from the session log, in front (its request's messages and its answer; its instructions are not
carried over, as in OpenAI's API). The chat path then serves the turn: the same template, session
rules, next-state link and record. Its chat completion becomes a ``response`` object and its chunks
the Responses events, ``response.created`` through the text and function-call-argument deltas to
``response.completed`` (``response.incomplete`` when it hit ``max_output_tokens``,
``response.failed`` on an error). The response id names the turn: ``resp_<turn id>``.

Function tools are offered to the model. Tools of other types (a hosted ``web_search``, Codex CLI's
``namespace`` of sub-agent tools) are left out of the prompt, said once in the log: an agent that
sends them still works with the tools a model can call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response
from pydantic import ValidationError

from clawrl.chat import ToolDef
from clawrl.gateway.deps import SESSION_HEADERS, turn_context
from clawrl.gateway.errors import GatewayError, field_error
from clawrl.gateway.http import ERROR_RESPONSES, SSE_EVENT_SCHEMA, JSONBodyRequest, JSONBodyRoute, serve_turn, sse
from clawrl.gateway.schemas import ChatCompletionRequest, ResponsesRequest
from clawrl.gateway.service import ChatService, Turn

log = logging.getLogger("clawrl.gateway")
router = APIRouter(prefix="/v1", route_class=JSONBodyRoute, strict_content_type=False)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for the text's log-probs
TEXT_PARTS = ("input_text", "output_text", "text")
_left_out: set[str] = set()  # tool types already said to be left out


def _text(content: Any, where: str) -> str:
    """The text of a message item's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content: expected a string or a list of content parts", param="input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise GatewayError(400, f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are "
                                    f"supported, got {kind!r:.40}", param="input")
        out.append(part["text"])
    return "".join(out)


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise GatewayError(400, f"{where}.{key}: expected a string", param="input")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function", "function": {
                "name": _str_field(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":  # the calls of one answer, after its text
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind != "reasoning":
            raise GatewayError(400, f"{where}: input items of type {kind!r:.40} are not supported (messages, "
                                    "function_call, function_call_output and reasoning are)", param="input")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The chat form of the function tools; other types are left out (logged once per type)."""
    out = []
    for t in tools or []:
        if t.get("type") == "function":
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                          if t.get(k) is not None}})
        elif (kind := str(t.get("type"))) not in _left_out:
            _left_out.add(kind)
            log.warning("tools of type %r are left out of the prompt: the model can call function tools only", kind)
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise GatewayError(400, "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]], session_id: str | None) -> ChatCompletionRequest:
    """The chat completion request that serves ``body`` after the ``history`` it continues;
    ``session_id``: the continued response's session, when the request names none."""
    fmt = (body.text or {}).get("format") or {}
    if not isinstance(fmt, dict) or fmt.get("type") not in (None, "text"):
        raise GatewayError(400, "text.format other than 'text' is not supported", param="text.format")
    logprobs = body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or [])
    named = body.session_id or body.prompt_cache_key or body.user or (body.metadata or {}).get("session_id")
    fields = {
        "messages": ([{"role": "system", "content": body.instructions}] if body.instructions else [])
        + history + input_messages(body.input),
        "model": body.model, "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None, "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None, "user": body.user,
        "prompt_cache_key": body.prompt_cache_key, "metadata": body.metadata,
        "session_id": body.session_id or (None if named else session_id), "turn_type": body.turn_type,
        "session_done": body.session_done}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        param = {"messages": "input", "tools": "tools", "tool_choice": "tool_choice"}.get(loc[0], loc[0])
        where = "input (as chat messages: " + ".".join(loc) + ")" if param == "input" else ".".join(loc)
        raise field_error(where, err["type"], err["msg"], param) from None


async def previous_conversation(service: ChatService, namespace: str, response_id: str) -> tuple[list[dict], str]:
    """The messages of response ``response_id`` (its request's, less its instructions, and its answer)
    and its session, from the session log. A response of another API key, or one made with
    ``store: false``, is not found, as in OpenAI's API."""
    from clawrl.storage.queries import turn_by_id

    row = None
    if response_id.startswith("resp_"):
        row = await asyncio.to_thread(service.read, turn_by_id, namespace, response_id.removeprefix("resp_"))
    params = json.loads(row["request_params"]) if row else {}
    if row is None or params.get("store") is False:
        raise GatewayError(400, f"Previous response with id '{response_id:.80}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
    tools = [ToolDef.model_validate(t) for t in json.loads(row["request_tools"])] if row["request_tools"] else None
    parsed = service.adapter.parse(row["text"], tools)
    answer = {"role": "assistant", "content": parsed.content, **({"tool_calls": parsed.tool_calls} if parsed.tool_calls else {})}
    return json.loads(row["request_messages"])[1 if params.get("instructions") else 0:] + [answer], row["session_id"]


def _response(body: ResponsesRequest, turn: Turn, model: str, **more: Any) -> dict[str, Any]:
    """A ``response`` object of ``turn`` (OpenAI's fields, then clawrl's), in progress unless ``more`` says otherwise."""
    sp = turn.gen.sampling_params
    return {"id": f"resp_{turn.turn_id}", "object": "response", "created_at": int(turn.created_at.timestamp()),
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store, "temperature": sp.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": sp.top_p, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}, "prompt_cache_key": body.prompt_cache_key,
            # --- clawrl extensions ---
            "session_id": turn.session_id, "turn_type": turn.turn_type} | more


def _message_item(turn: Turn, text: str, logprobs: list, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": f"msg_{turn.turn_id}", "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}


def _call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress"}


def _ending(finish: str, usage: dict[str, Any], index: int, version: str) -> dict[str, Any]:
    """A finished response's status, incomplete_details, usage and turn fields."""
    return {"status": "incomplete" if finish == "length" else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]},
            "turn_index": index, "weight_version": version}


def response_body(body: ResponsesRequest, resp: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """The ``response`` object of a served chat completion ``resp``."""
    choice = resp["choices"][0]
    msg, logprobs = choice["message"], (choice["logprobs"] or {}).get("content") or []
    output = ([_message_item(turn, msg["content"], logprobs)] if msg["content"] else []) + [
        _call_item(c) for c in msg["tool_calls"] or []]
    return _response(body, turn, resp["model"], **{
        "output": output, **_ending(choice["finish_reason"], resp["usage"], resp["turn_index"], resp["weight_version"])})


async def response_events(body: ResponsesRequest, chunks: AsyncIterator[dict[str, Any]], turn: Turn,
                          model: str) -> AsyncIterator[str]:
    """The Responses events of a streamed turn, from its chat chunks (module docstring)."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    head = _response(body, turn, model)
    yield event("response.created", response=head)
    yield event("response.in_progress", response=head)
    text, logprobs, output, final = "", [], [], None
    ids = {"item_id": f"msg_{turn.turn_id}", "output_index": 0}
    async for chunk in chunks:
        if "error" in chunk:
            err = chunk["error"]  # OpenAI's code where it has one (a string), else its type: engine_timeout, ...
            code = err["code"] if isinstance(err.get("code"), str) else err.get("type")
            yield event("response.failed", response={**head, "status": "failed", "output": output, "error": {
                "code": code, "message": err.get("message")}})
            return
        if not chunk["choices"]:  # the usage chunk, after the last choice's
            final = {**final, "usage": chunk["usage"]}
            continue
        choice = chunk["choices"][0]
        delta, new = choice["delta"].get("content"), (choice.get("logprobs") or {}).get("content") or []
        logprobs += new
        if delta:
            if not text:
                yield event("response.output_item.added", output_index=0, item=_message_item(turn, "", [], "in_progress"))
                yield event("response.content_part.added", **ids, content_index=0, part={
                    "type": "output_text", "text": "", "annotations": [], "logprobs": []})
            text += delta
            yield event("response.output_text.delta", **ids, content_index=0, delta=delta, logprobs=new)
        if choice["finish_reason"] is not None:
            final = {"finish": choice["finish_reason"], "calls": choice["delta"].get("tool_calls") or [],
                     "turn_index": chunk["turn_index"], "weight_version": chunk["weight_version"]}
            if text:
                item = _message_item(turn, text, logprobs)
                yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=logprobs)
                yield event("response.content_part.done", **ids, content_index=0, part=item["content"][0])
                yield event("response.output_item.done", output_index=0, item=item)
                output.append(item)
            for call in final["calls"]:
                item = _call_item(call)
                at = {"item_id": item["id"], "output_index": len(output)}
                yield event("response.output_item.added", output_index=len(output), item=_call_item(call, ""))
                yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=len(output), item=item)
                output.append(item)
    done = _response(body, turn, model, output=output, **_ending(
        final["finish"], final["usage"], final["turn_index"], final["weight_version"]))
    yield event(f"response.{done['status']}", response=done)


@router.post("/responses", openapi_extra={"parameters": SESSION_HEADERS}, responses={
    **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                             "description": "The response object; its events when stream = true."}})
async def create_response(body: ResponsesRequest, request: JSONBodyRequest) -> Response:
    """A response (OpenAI's Responses API), served and recorded as one chat turn (module docstring)."""
    ctx = turn_context(request)
    history, session_id = [], None
    if body.previous_response_id:
        history, session_id = await previous_conversation(request.app.state.service, ctx.namespace,
                                                          body.previous_response_id)
    params = {"api": "responses", "store": body.store, "instructions": bool(body.instructions)}
    return await serve_turn(request, chat_request(body, history, session_id), ctx, input_param="input", params=params,
                            shape=lambda resp, turn: response_body(body, resp, turn),
                            events=lambda chunks, turn: response_events(
                                body, chunks, turn, request.app.state.settings.server.served_model_name))
