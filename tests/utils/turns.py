"""Turn factories: TurnRecord / NextStateRecord built by hand, or served by a real engine the way
the gateway serves them (prompt rendered by ChatAdapter, exact ids and log-probs kept)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.chat import ChatAdapter, ChatMessage, ToolDef
from clawrl.records import NextStateRecord, TurnRecord, make_turn_id

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def build_turn(messages: list[dict], *, text: str = "Paris is the capital of France.", tool_calls: list | None = None,
               tools: list | None = None, session_id: str = "s1", turn_index: int = 0, turn_type: str = "main",
               prompt_ids: list[int] | None = None, output_ids: list[int] | None = None,
               rollout_logprobs: list[float] | None = None, weight_version: str = "0") -> TurnRecord:
    output_ids = [11, 12, 13] if output_ids is None else output_ids
    return TurnRecord(
        turn_id=make_turn_id("open", session_id, turn_index), session_id=session_id, turn_index=turn_index,
        turn_type=turn_type, namespace="open", model="tiny", weight_version=weight_version,
        request_messages=json.dumps(messages), request_tools=json.dumps(tools) if tools else None,
        request_params=json.dumps({"temperature": 1.0}), prompt_ids=[1, 2, 3] if prompt_ids is None else prompt_ids,
        output_ids=output_ids,
        rollout_logprobs=[-1.0] * len(output_ids) if rollout_logprobs is None else rollout_logprobs,
        text=text, tool_calls=json.dumps(tool_calls) if tool_calls else None,
        finish_reason="tool_calls" if tool_calls else "stop", created_at=T0, completed_at=T0, latency_ms=1.0,
    )


def build_next_state(turn: TurnRecord, messages: list[dict] | None, reason: str = "next_request") -> NextStateRecord:
    return NextStateRecord(turn.turn_id, turn.session_id, turn.turn_index, has_next_state=messages is not None,
                           messages=json.dumps(messages) if messages is not None else None,
                           reason=reason if messages is not None else "session_done", created_at=T0)


def generate_turn(engine, messages: list[dict], *, tools: list | None = None, max_new_tokens: int = 8,
                  seed: int = 0, session_id: str = "s1", turn_index: int = 0) -> TurnRecord:
    """A turn served the way the gateway serves it: prompt rendered by ChatAdapter, sampled at
    temperature 1 with the engine's log-probs."""
    adapter = ChatAdapter(engine.tokenizer)
    prompt_ids = adapter.render([ChatMessage.model_validate(m) for m in messages],
                                [ToolDef.model_validate(t) for t in tools] if tools else None)
    req = GenerateRequest(input_ids=prompt_ids, return_logprob=True,
                          sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                                         sampling_seed=seed, ignore_eos=True))
    result = asyncio.run(engine.generate(req))
    return build_turn(messages, text=result.text, tools=tools, session_id=session_id, turn_index=turn_index,
                      prompt_ids=prompt_ids, output_ids=list(result.output_ids),
                      rollout_logprobs=list(result.output_logprobs or []))
