"""Teacher log-probs for on-policy distillation: the turn's own output tokens scored under the
prompt with the hindsight hint added.

Two things OpenClaw-RL (the reference design) gets wrong and we do not:

* The teacher prompt is rendered into ids by :class:`~clawrl.chat.ChatAdapter`, as the gateway
  renders requests, and the turn's sampled ``output_ids`` are appended as ids: no text round trip, so the
  scored tokens are exactly the trained tokens.
* The slicing of SGLang's prompt log-probs (its ``/generate`` API): with ``logprob_start_len = s`` the
  engine returns ``len(input_ids) - s`` entries, entry j describing ``input_ids[s + j]`` and
  entry 0 always null. With P prompt and R output tokens, ``s = P`` would make entry 0 - output
  token 0 - null: that is the reference's off-by-one (it then pads a 0.0). We send ``s = P - 1``,
  get R + 1 entries, drop entry 0 (the last prompt token) and keep entries 1..R, which are
  log P(output_k | prompt, output_<k). Anything else raises :class:`TeacherAlignmentError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from clawrl.chat import ChatAdapter, ChatMessage, ToolDef
from clawrl.engine.types import Engine, GenerateRequest, SamplingParams

HINT_LABEL = "[Hint for this reply]"


class TeacherAlignmentError(RuntimeError):
    """Teacher log-probs that do not line up one-to-one with the output tokens."""


def _with_hint(text: str, hint: str) -> str:
    return f"{text}\n\n{HINT_LABEL} {hint}" if text else f"{HINT_LABEL} {hint}"


def _place_append_last_user(msgs: list[ChatMessage], hint: str) -> list[ChatMessage]:
    # The reference's placement: appended to the last user message, or to the last message when
    # there is none (a tool loop started without a user turn).
    i = max((k for k, m in enumerate(msgs) if m.role == "user"), default=len(msgs) - 1)
    msgs[i] = msgs[i].model_copy(update={"content": _with_hint(msgs[i].text(), hint)})
    return msgs


def _place_system(msgs: list[ChatMessage], hint: str) -> list[ChatMessage]:
    if msgs and msgs[0].role in ("system", "developer"):
        msgs[0] = msgs[0].model_copy(update={"content": _with_hint(msgs[0].text(), hint)})
    else:
        msgs.insert(0, ChatMessage(role="system", content=_with_hint("", hint)))
    return msgs


HINT_PLACEMENTS = {
    "append_last_user": _place_append_last_user,
    "system": _place_system,
}


def build_teacher_prompt_ids(tokenizer, messages: Sequence[ChatMessage | dict[str, Any]],
                             tools: Sequence[ToolDef | dict[str, Any]] | None, hint: str | None,
                             placement: str = "append_last_user", *,
                             tool_choice: str | dict | None = None) -> list[int]:
    """Prompt ids the teacher conditions on: the turn's messages with ``hint`` placed per
    ``placement``, rendered exactly as the gateway renders a request. An empty or None hint
    leaves the messages untouched, so the result equals the turn's own prompt ids."""
    try:
        place = HINT_PLACEMENTS[placement]
    except KeyError:
        raise ValueError(f"unknown hint placement {placement!r}; valid: {', '.join(sorted(HINT_PLACEMENTS))}") from None
    msgs = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
    if not msgs:
        raise ValueError("the teacher prompt needs at least one message")
    tool_defs = [t if isinstance(t, ToolDef) else ToolDef.model_validate(t) for t in tools] if tools else None
    if hint and hint.strip():
        msgs = place(list(msgs), hint.strip())
    return ChatAdapter(tokenizer).render(msgs, tool_defs, tool_choice)


def demonstration_ids(tokenizer, messages: Sequence[ChatMessage | dict[str, Any]],
                      tools: Sequence[ToolDef | dict[str, Any]] | None, hint: str | None, *,
                      tool_choice: str | dict | None = None) -> list[int] | None:
    """The reply a hint spells out, as output ids: when ``hint`` holds tool calls of the turn's
    declared tools (in the tool-call format the model writes, ``<tool_call>{...}</tool_call>``), the
    assistant message making exactly those calls, rendered by the chat template after the turn's
    prompt through its EOS. None when the hint holds no such call."""
    tool_defs = [t if isinstance(t, ToolDef) else ToolDef.model_validate(t) for t in tools] if tools else None
    if not hint or not tool_defs:
        return None
    adapter = ChatAdapter(tokenizer)
    calls = adapter.parse(hint, tool_defs).tool_calls
    if not calls:
        return None
    msgs = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
    reply = ChatMessage(role="assistant", content=None, tool_calls=calls)
    return adapter.render_reply(msgs, reply, tool_defs, tool_choice)


async def compute_teacher_logprobs(engine: Engine, teacher_prompt_ids: Sequence[int],
                                   output_ids: Sequence[int]) -> list[float]:
    """log P_teacher(output_ids[k] | teacher_prompt_ids, output_ids[:k]) for every k: one
    prefill-only request (``max_new_tokens = 0``), sliced as the module docstring explains.
    Raises TeacherAlignmentError unless exactly ``len(output_ids)`` finite values come back."""
    prompt, output = list(teacher_prompt_ids), list(output_ids)
    if not prompt:
        raise ValueError("the teacher prompt is empty")
    if not output:
        return []
    start = len(prompt) - 1  # entry 0 (null) lands on the last prompt token, not on output token 0
    req = GenerateRequest(
        input_ids=prompt + output,
        sampling_params=SamplingParams(max_new_tokens=0, temperature=1.0),
        return_logprob=True,
        logprob_start_len=start,
    )
    result = await engine.generate(req)
    entries = result.input_logprobs
    expected = len(output) + 1
    if entries is None or len(entries) != expected:
        got = "no input log-probs" if entries is None else f"{len(entries)} entries"
        raise TeacherAlignmentError(
            f"teacher returned {got} for logprob_start_len={start} over {len(prompt) + len(output)} input ids; "
            f"expected {expected} (one null entry for the last prompt token, then one per output token)")
    values = entries[1:]
    bad = [k for k, v in enumerate(values) if v is None or not math.isfinite(v)]
    if bad:
        raise TeacherAlignmentError(
            f"teacher log-probs missing or not finite at output positions {bad[:10]} of {len(output)}")
    return [float(v) for v in values]
