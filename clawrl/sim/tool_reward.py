"""The tools scenario's ``[hooks] reward`` (``clawrl.sim.tool_reward:reward``): it knows the task bank
of ``clawrl.sim.tools`` (it finds the task by the session's first user message) and scores a turn from
its next state, step by step:

* a first reply with tool calls, scored from the tool results in its next state: an ``error:``
  result (malformed call, unknown tool, bad arguments) -1, a result that is not the task's answer
  (wrong tool or wrong arguments) -1, the task's answer +1;
* a first reply without a call to a task that needs one: +1 when it states the right answer anyway,
  else -1;
* a reply after tool results (the final answer), and every reply to a plain question, from the
  user's reaction (thanks +1, "that's wrong." or "that's not what I asked." -1); a plain question
  answered with a tool call: -1, with the hint to answer directly.

A -1 on a tool task comes with the hint that names the tool and its arguments, written as the
call itself (``<tool_call>{...}</tool_call>``): ``[opd] hint_demonstrations`` turns such a hint into
a demonstration sample (see ``clawrl.judge.pipeline``), which is what gives a model that never
calls a tool on its own its first positive examples.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from clawrl.sim.personas import OFF_TOPIC, THANKS
from clawrl.sim.tools import (
    COUNTRIES,
    FACT_PHRASES,
    UNIT_WORDS,
    WRONG,
    ToolTask,
    calculate,
    convert,
    fmt_number,
    plain_tasks,
)

_ARITH_RE = re.compile(r"^What is (\d+) (times|plus|minus) (\d+)\?$")
_CONV_RE = re.compile(r"^How many (.+) is (\d+) (.+)\?$")
_FACT_RES = {field: re.compile("^" + re.escape(p).replace(r"\{\}", "(.+)") + "$") for field, p in FACT_PHRASES.items()}
_WORD_UNITS = {w: u for u, w in UNIT_WORDS.items()}


def find_task(question: str) -> ToolTask | None:
    """The tool task a question states (its call and answer rebuilt from the text, whatever seed
    generated it), a plain question of the bank, or None."""
    q = question.strip()
    if m := _ARITH_RE.match(q):
        expr = f"{m[1]}{dict(times='*', plus='+', minus='-')[m[2]]}{m[3]}"
        return ToolTask(q, "calculator", json.dumps({"expression": expr}), fmt_number(calculate(expr)))
    if (m := _CONV_RE.match(q)) and m[1] in _WORD_UNITS and m[3] in _WORD_UNITS:
        args = {"value": int(m[2]), "from_unit": _WORD_UNITS[m[3]], "to_unit": _WORD_UNITS[m[1]]}
        return ToolTask(q, "convert_units", json.dumps(args), fmt_number(convert(**args)))
    for field, rx in _FACT_RES.items():
        if (m := rx.match(q)) and m[1].lower() in COUNTRIES:
            return ToolTask(q, "lookup_country", json.dumps({"country": m[1], "field": field}),
                            COUNTRIES[m[1].lower()][field])
    return _plain_by_question().get(q)


@functools.cache
def _plain_by_question() -> dict[str, ToolTask]:
    return {t.question: t for t in plain_tasks()}


def _first_user(messages: list[dict[str, Any]]) -> str:
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


def _reaction_score(next_messages: list[dict[str, Any]]) -> int:
    """The simulated user's reaction: thanks +1, "that's wrong." / "that's not what I asked." -1;
    a tool result reporting an error -1; anything else 0."""
    if any(m.get("role") == "tool" and str(m.get("content") or "").startswith("error:") for m in next_messages):
        return -1
    said = [str(m.get("content") or "") for m in next_messages if m.get("role") == "user"]
    return 1 if THANKS in said else (-1 if WRONG in said or OFF_TOPIC in said else 0)


def score_turn(task: ToolTask | None, request: list[dict[str, Any]], calls: list[dict[str, Any]], text: str,
               next_messages: list[dict[str, Any]]) -> tuple[int, str | None]:
    """(score, hint) of one turn; see the module docstring."""
    after_tool = bool(request) and request[-1].get("role") == "tool"
    if task is None or not task.needs_tool or after_tool:
        if task is not None and not task.needs_tool and calls:
            return -1, "This question needs no tool: answer it directly in one or two sentences."
        return _reaction_score(next_messages), None
    results = [str(m.get("content") or "") for m in next_messages if m.get("role") == "tool"]
    if calls:
        if results and not any(r.startswith("error:") for r in results) and task.answer in results:
            return 1, None
        return -1, task.call_text()
    if task.answered_by(text):
        return 1, None
    return -1, task.call_text()


async def reward(*, turn, next_state) -> tuple[int, str | None]:
    """The ``[hooks] reward`` of the tools scenario (module docstring)."""
    request = json.loads(turn.request_messages)
    calls = json.loads(turn.tool_calls) if turn.tool_calls else []
    nxt = json.loads(next_state.messages) if next_state is not None and next_state.messages else []
    return score_turn(find_task(_first_user(request)), request, calls, turn.text, nxt)
