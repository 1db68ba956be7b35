"""The generate hook of the Codex CLI test (tests/test_codex.py): the tiny random-init model cannot
call Codex's shell tool, so this hook answers the turns that need it from a script and lets the
engine answer the rest. It reads the request as Codex sent it: the prompt ids decoded back to the
chat template's messages.

- Codex's compaction (its last message asks for a "CONTEXT CHECKPOINT COMPACTION"): a summary that
  names the files the command printed.
- A request whose last message is a tool result (Codex ran the command), or Codex's hand-off of that
  summary after a compaction: an answer that quotes the first file name.
- A user message that asks to list the files: a call of Codex's ``exec_command`` tool with ``ls``.
- Anything else: the engine's own output, at most 8 tokens.
"""

from __future__ import annotations

import json
import re

from clawrl.engine.types import GenerateRequest, SamplingParams
from tests.utils.openclaw_hook import _messages, _scripted

ANSWER = "I listed the files; the first one is {name}."
SUMMARY = "Handoff summary: the user asked to list the files; ls printed {names}."


async def generate(engine, request: GenerateRequest):
    msgs = _messages(engine.tokenizer.decode(request.input_ids))
    role, content = msgs[-1] if msgs else ("", "")
    names = re.findall(r"\b[\w-]+\.txt\b", "\n".join(c for r, c in msgs if r in ("tool", "user")))
    if "CONTEXT CHECKPOINT COMPACTION" in content:
        return _scripted(engine, request, SUMMARY.format(names=" and ".join(names)))
    if role == "tool" or content.startswith("<tool_response>") or SUMMARY[:20] in content:
        return _scripted(engine, request, ANSWER.format(name=names[0] if names else "missing"))
    if role == "user" and "list the files" in content:
        call = {"name": "exec_command", "arguments": {"cmd": "ls"}}
        return _scripted(engine, request, f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    sp = SamplingParams(**{**request.sampling_params.__dict__, "max_new_tokens": 8})
    return await engine.generate(GenerateRequest(input_ids=request.input_ids, sampling_params=sp,
                                                 return_logprob=True, top_logprobs_num=request.top_logprobs_num))
