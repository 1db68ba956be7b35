"""OpenAI's legacy completions (``POST /v1/completions``), for evaluation harnesses (lm-eval's
``local-completions``, prompting-mode benchmarks): text in, text out, no chat template.

A prompt (a string, or token ids) is encoded as it is - with the tokenizer's own special tokens,
such as a BOS, as vLLM does - and served through the chat path as a turn whose request is one user
message holding the prompt text: its session, exact ids and log-probs are recorded as a chat
turn's. A completion is a ``side`` turn unless the request names its turn type (``X-Turn-Type`` /
``turn_type: "main"``), so harness traffic never trains the policy by accident. A list of prompts is
one turn per prompt (choice ``i * n + j`` is prompt i's j-th); ``stream`` takes a single prompt.
``logprobs`` (0-20) gives OpenAI's legacy log-prob lists, ``echo`` the prompt in front of the text,
and both together the prompt tokens' own log-probs (the first one null), which is how harnesses
score a continuation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from clawrl.gateway.deps import SESSION_HEADERS, turn_context
from clawrl.gateway.errors import GatewayError, field_error
from clawrl.gateway.http import (ERROR_RESPONSES, SSE_EVENT_SCHEMA, JSONBodyRequest, JSONBodyRoute, refuse_if_paused,
                                 run_turn, serve_turn, sse)
from clawrl.gateway.schemas import ChatCompletionRequest, CompletionRequest
from clawrl.gateway.service import ChatService, Turn
from clawrl.records import TurnType

router = APIRouter(prefix="/v1", route_class=JSONBodyRoute, strict_content_type=False)


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: one string or id list each."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt or any(not p for p in prompt):
        raise GatewayError(400, "prompt: expected a non-empty string, a list of them, or token ids", param="prompt")
    return list(prompt)


def chat_body(body: CompletionRequest, text: str) -> ChatCompletionRequest:
    """The chat request a prompt is served as (its sampling fields, the prompt as one user message)."""
    fields = body.model_dump(include={"model", "max_tokens", "n", "seed", "stop", "stream", "temperature", "top_p",
                                      "user", "session_id", "turn_type", "session_done"})
    try:
        return ChatCompletionRequest.model_validate({
            **fields, "messages": [{"role": "user", "content": text}], "logprobs": body.logprobs is not None,
            "top_logprobs": body.logprobs or None})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise field_error(".".join(map(str, err["loc"])), err["type"], err["msg"], str(err["loc"][0])) from None


def legacy_logprobs(entries: list[tuple[str, float | None, dict[str, float] | None]], offset: int) -> dict[str, Any]:
    """OpenAI's legacy log-probs of (token text, log-prob, top {token: log-prob}) entries whose text
    starts at character ``offset``."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        for key, value in zip(out, (token, lp, top, offset)):
            out[key].append(value)
        offset += len(token)
    return out


def _choice(service: ChatService, body: CompletionRequest, prompt: str, resp_choice: dict[str, Any], turn: Turn,
            index: int) -> dict[str, Any]:
    """One prompt's choice: its text (after the prompt with echo) and legacy log-probs."""
    result = turn.results[resp_choice["index"]]
    text = resp_choice["message"]["content"] or ""
    logprobs, decode, k = None, service._decode, body.logprobs

    def entries(ids, lps, tops) -> list:
        return [(decode(t), lp, {decode(i): v for v, i in (top or [])[:k]} or None) for t, lp, top in zip(ids, lps, tops)]

    if k is not None:
        n_out = len((resp_choice["logprobs"] or {}).get("content") or [])  # the EOS is not shown
        shown = entries(result.output_ids[:n_out], result.output_logprobs or [], result.output_top_logprobs or [[]] * n_out)
        if body.echo:
            n_in = len(turn.gen.input_ids)
            shown = entries(turn.gen.input_ids, result.input_logprobs or [None] * n_in,
                            result.input_top_logprobs or [None] * n_in) + shown
        logprobs = legacy_logprobs(shown, 0)
    return {"text": (prompt if body.echo else "") + text, "index": index, "logprobs": logprobs,
            "finish_reason": resp_choice["finish_reason"]}


def _body(service: ChatService, resp: dict[str, Any], choices: list[dict], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-" + resp["id"].removeprefix("chatcmpl-"), "object": "text_completion",
            "created": resp["created"], "model": resp["model"], "choices": choices, "usage": usage,
            "session_id": resp["session_id"], "turn_type": resp["turn_type"], "turn_index": resp["turn_index"],
            "weight_version": resp["weight_version"]}


async def completion_events(body: CompletionRequest, prompt: str,
                            chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """A streamed completion's text_completion chunks, from its chat chunks, then [DONE]."""
    offsets: dict[int, int] = {}  # by choice: where its next token's text starts (the legacy text_offset)
    async for chunk in chunks:
        if "error" in chunk or not chunk["choices"]:
            yield sse(chunk)
            continue
        c = chunk["choices"][0]
        i, first = c["index"], c["index"] not in offsets
        text = (prompt if body.echo and first else "") + (c["delta"].get("content") or "")
        offsets.setdefault(i, len(prompt) if body.echo else 0)
        lps = None
        if body.logprobs is not None:
            lps = legacy_logprobs([(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]} or None)
                                   for e in (c["logprobs"] or {}).get("content") or []], offsets[i])
            offsets[i] += sum(map(len, lps["tokens"]))
        if text or lps and lps["tokens"] or c["finish_reason"]:
            more = {k: chunk[k] for k in ("weight_version", "turn_index") if k in chunk}
            yield sse({"id": "cmpl-" + chunk["id"].removeprefix("chatcmpl-"), "object": "text_completion",
                       "created": chunk["created"], "model": chunk["model"], "choices": [{
                           "text": text, "index": i, "logprobs": lps, "finish_reason": c["finish_reason"]}],
                       "session_id": chunk["session_id"], "turn_type": chunk["turn_type"], **more})
    yield "data: [DONE]\n\n"


@router.post("/completions", openapi_extra={"parameters": SESSION_HEADERS}, responses={
    **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                             "description": "The text_completion; an SSE stream when stream = true."}})
async def create_completion(body: CompletionRequest, request: JSONBodyRequest) -> Response:
    """A legacy completion, each prompt served and recorded as one turn (module docstring)."""
    service: ChatService = request.app.state.service
    ctx, tok = turn_context(request), service.adapter.tokenizer
    prompts = prompts_of(body.prompt)
    if body.stream and (len(prompts) > 1 or body.echo and body.logprobs is not None):
        raise GatewayError(400, "stream takes one prompt, and no echo with logprobs (the prompt's log-probs come "
                                "with the whole answer)", param="stream")
    ids = [tok(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    if any(not p or min(p) < 0 or max(p) >= len(tok) for p in ids):
        raise GatewayError(400, f"prompt: every prompt needs at least one token, and token ids from 0 to {len(tok) - 1}",
                           param="prompt")
    texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
    prepare = [{"prompt_ids": p, "params": {"api": "completions"}, "default_turn_type": TurnType.SIDE.value,
                "score_prompt": body.echo and body.logprobs is not None} for p in ids]
    if len(prompts) == 1:
        return await serve_turn(
            request, chat_body(body, texts[0]), ctx, input_param="prompt", **prepare[0],
            shape=lambda resp, turn: _body(service, resp, [_choice(service, body, texts[0], c, turn, c["index"])
                                                           for c in resp["choices"]], resp["usage"]),
            events=lambda chunks, turn: completion_events(body, texts[0], chunks))
    refuse_if_paused(request)
    t0 = time.perf_counter()
    turns = [service.prepare(chat_body(body, t), ctx, **kw) for t, kw in zip(texts, prepare)]  # all checked first
    served = await asyncio.gather(*(run_turn(request, turn) for turn in turns))
    choices = [_choice(service, body, texts[i], c, turn, i * body.n + c["index"])
               for i, (resp, _, turn) in enumerate(served) for c in resp["choices"]]
    usage = {k: sum(resp["usage"][k] for resp, _, _ in served) for k in ("prompt_tokens", "completion_tokens",
                                                                           "total_tokens")}
    first = served[0][0]
    service.metrics.requests.labels("200", "false", first["turn_type"]).inc()
    service.metrics.latency.labels("false").observe(time.perf_counter() - t0)
    return JSONResponse(_body(service, first, choices, usage), headers={"X-Weight-Version": first["weight_version"]})
