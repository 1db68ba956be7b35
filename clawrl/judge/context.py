"""What the judge is shown about one turn, extracted from its records.

OpenClaw-RL's judge sees only the assistant output and the next state. :class:`JudgeContext` adds
the task context: the system prompt, the user request the turn answers, the conversation just
before that request, and what happened between the request and the turn (tool calls and results
in an agent loop).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from clawrl.records import NextStateRecord, TurnRecord

ROLE_LABELS = {
    "system": "[system]",
    "developer": "[system]",
    "user": "[user]",
    "assistant": "[assistant]",
    "tool": "[tool result]",
}
TOOL_CALL_LABEL = "[tool call]"
_TOOL_CALL_MARKUP = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class JudgeContext:
    """One turn as the judge sees it; every text is plain and role-labelled where it is a message."""

    system_prompt: str  # "" when the conversation has none
    user_request: str  # the last user message before the turn ("" when there is none)
    context_before: list[tuple[str, str]]  # (label, text): recent messages before the request, oldest first
    since_request: list[tuple[str, str]]  # (label, text): messages after the request, before the turn
    assistant_text: str  # the turn's text, tool-call markup removed when the calls are listed below
    tool_calls: list[str]  # "name(arguments)" per call
    next_state: list[tuple[str, str]]  # (label, text): the messages that followed the turn


def message_text(message: dict[str, Any]) -> str:
    """Text of an OpenAI message: str content, joined text parts, or "" for None."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def format_tool_call(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    return f"{fn.get('name', '?')}({fn.get('arguments', '')})"


def _labelled(message: dict[str, Any]) -> tuple[str, str]:
    label = ROLE_LABELS.get(message.get("role", ""), f"[{message.get('role', '?')}]")
    text = message_text(message)
    calls = [f"{TOOL_CALL_LABEL} {format_tool_call(c)}" for c in message.get("tool_calls") or []]
    return label, "\n".join(([text] if text else []) + calls)


def build_judge_context(turn: TurnRecord, next_state: NextStateRecord, *, max_recent: int = 4) -> JudgeContext:
    """The judge's view of ``turn`` given its ``next_state`` (which must have one).

    ``max_recent`` bounds both message lists (the latest ones are kept); the character budget is
    applied later, by the prompt builders."""
    if not next_state.has_next_state or not next_state.messages:
        raise ValueError(f"turn {turn.turn_id} has no next state ({next_state.reason}); it is not judged")
    if next_state.turn_id != turn.turn_id:
        raise ValueError(f"next state belongs to turn {next_state.turn_id}, not {turn.turn_id}")
    calls = json.loads(turn.tool_calls) if turn.tool_calls else []
    text = turn.text
    if calls:  # the calls are listed separately; do not show them twice
        text = _TOOL_CALL_MARKUP.sub("", text).strip()
    return _context(json.loads(turn.request_messages), text, [format_tool_call(c) for c in calls],
                    [_labelled(m) for m in json.loads(next_state.messages)], max_recent)


def answer_context(messages: list[dict[str, Any]], answer: str, *, max_recent: int = 4) -> JudgeContext:
    """The judge's view of ``answer`` (raw model text, tool-call markup kept) to the request ``messages``,
    with no next state: what the promotion gate's replay evaluation rates."""
    return _context(messages, answer, [], [], max_recent)


def _context(messages: list[dict[str, Any]], text: str, calls: list[str], next_state: list[tuple[str, str]],
             max_recent: int) -> JudgeContext:
    system = "\n\n".join(message_text(m) for m in messages if m.get("role") in ("system", "developer"))
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_user = max((i for i, m in enumerate(rest) if m.get("role") == "user"), default=None)
    if last_user is None:
        request, before, since = "", [], rest
    else:
        request, before, since = message_text(rest[last_user]), rest[:last_user], rest[last_user + 1:]
    return JudgeContext(
        system_prompt=system,
        user_request=request,
        context_before=[_labelled(m) for m in before[-max_recent:]] if max_recent else [],
        since_request=[_labelled(m) for m in since[-max_recent:]] if max_recent else [],
        assistant_text=text,
        tool_calls=calls,
        next_state=next_state,
    )
