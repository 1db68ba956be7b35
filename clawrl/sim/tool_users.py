"""Simulated users of the tool-use scenario, talking to the gateway through the real openai SDK.

A user asks one task (a tool task or a plain question) with the tools of ``clawrl.sim.tools``
offered (``tool_choice: "auto"``). When the reply calls tools, the user's client runs them and sends
the results back (the tool messages are that turn's next state); the model's answer to them is the
final answer. The user then reacts to the final answer - thanks when it states the task's answer
(a plain question: when it is on topic), "that's wrong." otherwise - which is the final answer's
next state; that last message asks for a single token, since nobody reads its answer (seeded like the
others: a rerun logs the same turns).

Evaluation asks held-out tasks the same way as ``side`` turns (served and logged, never trained on)
and scores, per task: the first reply calls the right tool with arguments whose result is the
task's answer (``tool_use``), it calls any tool (``call_rate``), the final answer states the answer
(``solved``); per plain question: the answer is on topic and calls no tool (``plain_quality``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from clawrl.sim.personas import OFF_TOPIC, THANKS, on_topic
from clawrl.sim.tools import SYSTEM_PROMPT, TOOLS, WRONG, ToolTask, run_tool


@dataclass
class ToolInteraction:
    session_id: str
    task: ToolTask
    first_reply: str  # the first reply's text, its tool calls rendered as name(arguments)
    calls: int  # tool calls in the first reply
    correct_call: bool  # one of them ran and returned the task's answer, none failed
    final_answer: str
    solved: bool  # tool task: the final answer states the answer; plain: on topic, without a call
    reaction: str


async def ask_task(client, task: ToolTask, *, session_id: str, train: bool, max_tokens: int, temperature: float,
                   seed: int) -> ToolInteraction:
    """One user and one task, as the module docstring describes."""
    meta = {"session_id": session_id, "turn_type": "main" if train else "side"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task.question}]

    async def reply(**extra: Any):
        r = await client.chat.completions.create(
            model="clawrl-policy", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=max_tokens,
            temperature=temperature, seed=seed, extra_body=meta, **extra)
        return r.choices[0].message

    first = await reply()
    calls = list(first.tool_calls or [])
    results = [run_tool(c.function.name, c.function.arguments) for c in calls]
    final = first.content or ""
    if calls:
        messages.append({"role": "assistant", "content": first.content,
                         "tool_calls": [c.model_dump(exclude_none=True) for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)]
        final = (await reply()).content or ""
    correct = bool(task.needs_tool and task.answer in results and not any(r.startswith("error:") for r in results))
    if task.needs_tool:
        solved = task.answered_by(final)
        reaction = THANKS if solved else WRONG
    else:
        topical = on_topic(final, task.keywords, task.question)
        solved = topical and not calls
        reaction = THANKS if topical else OFF_TOPIC
    if train:
        messages += [{"role": "assistant", "content": final}, {"role": "user", "content": reaction}]
        await client.chat.completions.create(model="clawrl-policy", messages=messages, tools=TOOLS, max_tokens=1,
                                             seed=seed, extra_body={"session_id": session_id, "session_done": True})
    shown = " ".join([first.content or ""] + [f"{c.function.name}({c.function.arguments})" for c in calls]).strip()
    return ToolInteraction(session_id, task, shown, len(calls), correct, final, solved, reaction)


async def tool_round(client, tasks: list[ToolTask], *, round_id: str, train: bool, max_tokens: int,
                     temperature: float, seed: int) -> list[ToolInteraction]:
    """One user per task, all at once; user i asks with seed ``seed + i``."""
    return list(await asyncio.gather(*(
        ask_task(client, t, session_id=f"{round_id}-{'u' if train else 'e'}{i:02d}", train=train,
                 max_tokens=max_tokens, temperature=temperature, seed=seed + i) for i, t in enumerate(tasks))))


def tool_scores(interactions: list[ToolInteraction]) -> dict[str, float]:
    """The scenario's rates (module docstring); ``score`` is ``tool_use``."""
    tools = [x for x in interactions if x.task.needs_tool]
    plain = [x for x in interactions if not x.task.needs_tool]

    def rate(xs: list[ToolInteraction], attr: str) -> float:
        return sum(bool(getattr(x, attr)) for x in xs) / len(xs) if xs else float("nan")

    return {"score": rate(tools, "correct_call"), "tool_use": rate(tools, "correct_call"),
            "call_rate": rate(tools, "calls"), "solved": rate(tools, "solved"),
            "plain_quality": rate(plain, "solved"), "false_call_rate": rate(plain, "calls")}
