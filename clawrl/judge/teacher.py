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

Top-k OPD (``[opd] top_k = k``) slices the same way: the policy's ``input_top_logprobs`` (the
student's k most likely ids at each output position), then the teacher's ``input_token_ids_logprobs``
at those ids, both from prefill-only requests with ``logprob_start_len = P - 1``.
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


def _append_hint(msgs: list[ChatMessage], hint: str) -> list[ChatMessage]:
    # The reference's placement, the only one: appended to the last user message, or to the last message
    # when there is none (a tool loop started without a user turn).
    i = max((k for k, m in enumerate(msgs) if m.role == "user"), default=len(msgs) - 1)
    msgs[i] = msgs[i].model_copy(update={"content": _with_hint(msgs[i].text(), hint)})
    return msgs


def build_teacher_prompt_ids(tokenizer, messages: Sequence[ChatMessage | dict[str, Any]],
                             tools: Sequence[ToolDef | dict[str, Any]] | None, hint: str | None, *,
                             tool_choice: str | dict | None = None) -> list[int]:
    """Prompt ids the teacher conditions on: the turn's messages with ``hint`` appended to the last
    user message, rendered exactly as the gateway renders a request. An empty or None hint leaves the
    messages untouched, so the result equals the turn's own prompt ids."""
    msgs = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
    if not msgs:
        raise ValueError("the teacher prompt needs at least one message")
    tool_defs = [t if isinstance(t, ToolDef) else ToolDef.model_validate(t) for t in tools] if tools else None
    if hint and hint.strip():
        msgs = _append_hint(list(msgs), hint.strip())
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


def _output_rows(entries: list | None, name: str, start: int, n_input: int, n_output: int) -> list:
    """Entries 1..R of a prompt-score list from ``logprob_start_len = P - 1`` (module docstring)."""
    expected = n_output + 1
    if entries is None or len(entries) != expected:
        got = f"no {name}" if entries is None else f"{len(entries)} entries of {name}"
        raise TeacherAlignmentError(
            f"teacher returned {got} for logprob_start_len={start} over {n_input} input ids; "
            f"expected {expected} (one null entry for the last prompt token, then one per output token)")
    return entries[1:]


def _finite(values: Sequence[float | None], what: str) -> list[float]:
    bad = [k for k, v in enumerate(values) if v is None or not math.isfinite(v)]
    if bad:
        raise TeacherAlignmentError(f"{what} missing or not finite at output positions {bad[:10]} of {len(values)}")
    return [float(v) for v in values]


async def _score_output(engine: Engine, prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                        top_k: int = 0, token_ids: Sequence[int] | None = None):
    """(result, start): one prefill-only request scoring ``output_ids`` after ``prompt_ids``."""
    prompt, output = list(prompt_ids), list(output_ids)
    if not prompt:
        raise ValueError("the teacher prompt is empty")
    start = len(prompt) - 1  # entry 0 (null) lands on the last prompt token, not on output token 0
    req = GenerateRequest(input_ids=prompt + output, sampling_params=SamplingParams(max_new_tokens=0, temperature=1.0),
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=top_k,
                          token_ids_logprob=list(token_ids) if token_ids else None)
    return await engine.generate(req), start


async def compute_teacher_logprobs(engine: Engine, teacher_prompt_ids: Sequence[int],
                                   output_ids: Sequence[int]) -> list[float]:
    """log P_teacher(output_ids[k] | teacher_prompt_ids, output_ids[:k]) for every k: one
    prefill-only request (``max_new_tokens = 0``), sliced as the module docstring explains.
    Raises TeacherAlignmentError unless exactly ``len(output_ids)`` finite values come back."""
    if not teacher_prompt_ids:
        raise ValueError("the teacher prompt is empty")
    if not output_ids:
        return []
    result, start = await _score_output(engine, teacher_prompt_ids, output_ids)
    n_input = len(teacher_prompt_ids) + len(output_ids)
    return _finite(_output_rows(result.input_logprobs, "input log-probs", start, n_input, len(output_ids)),
                   "teacher log-probs")


async def compute_student_topk(engine: Engine, prompt_ids: Sequence[int], output_ids: Sequence[int],
                               k: int) -> tuple[list[list[int]], list[list[float]]]:
    """(ids, log-probs), one row of ``k`` per output token, best first: the policy's ``k`` most likely
    tokens at each output position (``top_logprobs_num = k`` over the same prefill-only request and
    slicing as :func:`compute_teacher_logprobs`), plain ``log_softmax`` as the trainer computes it."""
    if not output_ids:
        return [], []
    result, start = await _score_output(engine, prompt_ids, output_ids, top_k=k)
    n_input = len(prompt_ids) + len(output_ids)
    rows = _output_rows(result.input_top_logprobs, "input top log-probs", start, n_input, len(output_ids))
    if any(row is None or len(row) != k for row in rows):
        raise TeacherAlignmentError(f"the policy's top-{k} lists do not hold {k} entries at every output position")
    ids = [[int(t) for _, t in row] for row in rows]
    return ids, [_finite([lp for lp, _ in row], "student top-k log-probs") for row in rows]


async def compute_teacher_topk_logprobs(engine: Engine, teacher_prompt_ids: Sequence[int],
                                        output_ids: Sequence[int], topk_ids: Sequence[Sequence[int]]
                                        ) -> tuple[list[float], list[list[float]]]:
    """(the teacher's log-probs of ``output_ids``, as :func:`compute_teacher_logprobs`, and its
    log-probs of ``topk_ids[k][j]`` at output position k), from one prefill-only request: SGLang's
    ``token_ids_logprob`` holds the union of the ids of every position and each position keeps its own."""
    if len(topk_ids) != len(output_ids):
        raise ValueError(f"{len(topk_ids)} top-k rows for {len(output_ids)} output ids")
    if not output_ids:
        return [], []
    union = sorted({int(t) for row in topk_ids for t in row})
    result, start = await _score_output(engine, teacher_prompt_ids, output_ids, token_ids=union)
    n_input, n = len(teacher_prompt_ids) + len(output_ids), len(output_ids)
    sampled = _finite(_output_rows(result.input_logprobs, "input log-probs", start, n_input, n), "teacher log-probs")
    rows = _output_rows(result.input_token_ids_logprobs, "input token-ids log-probs", start, n_input, n)
    topk = []
    for pos, (row, want) in enumerate(zip(rows, topk_ids)):
        by_id = {int(t): lp for lp, t in row or []}
        if any(int(t) not in by_id for t in want):
            raise TeacherAlignmentError(f"the teacher did not score every asked id at output position {pos}")
        topk.append(_finite([by_id[int(t)] for t in want], "teacher top-k log-probs"))
    return sampled, topk
