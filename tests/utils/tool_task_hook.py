"""The generate hook of the tools-scenario loop test (tests/test_tools_scenario.py): the tiny
random-init model never calls a tool, so this hook plays a policy with a known skill level - it
answers calculator tasks with the right call, unit conversions with a call of a unit the converter
does not know, and leaves country lookups and plain questions to the engine. After tool results it
states the first result. Requests are read back from the prompt ids, as the OpenClaw hook does.
"""

from __future__ import annotations

import json

from clawrl.sim.tool_reward import find_task
from tests.utils.openclaw_hook import _messages, _scripted


async def generate(engine, request):
    msgs = _messages(engine.tokenizer.decode(request.input_ids))
    role, content = msgs[-1] if msgs else ("", "")
    if role == "tool":
        result = content.removeprefix("<tool_response>").split("</tool_response>")[0].strip()
        return _scripted(engine, request, f"The answer is {result}.")
    task = find_task(content) if role == "user" else None
    if task is not None and task.tool == "calculator":
        return _scripted(engine, request, task.call_text())
    if task is not None and task.tool == "convert_units":
        args = {**json.loads(task.arguments), "to_unit": "parsec"}
        return _scripted(engine, request, f'<tool_call>\n{json.dumps({"name": task.tool, "arguments": args})}\n'
                                          '</tool_call>')
    return await engine.generate(request)
