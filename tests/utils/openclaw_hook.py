"""The generate hook of the OpenClaw test (tests/test_openclaw.py): the tiny random-init model cannot
call tools or summarise, so this hook answers the turns that need it from a script and lets the
engine answer the rest. It reads the request as the agent sent it: the prompt ids decoded back to
the chat template's messages.

- OpenClaw's compaction summariser (its system prompt "You are a context summarization assistant",
  or a last message "The messages above are a conversation to summarize"): a fixed summary, another
  when it summarises the first part of a turn it splits ("This is the PREFIX of a turn").
- A request whose last real message is a tool result: a short answer naming the result.
- A user message that asks for the ``ls`` tool: a call of ``ls`` on the workspace.
- A user message that asks for a long story: a story that ends just past the three quarters of the
  context where OpenClaw compacts (its reserve is a quarter of the window), within ``max_tokens``.
- Anything else: the engine's own output, at most 8 tokens.

OpenClaw appends a block of its internal context (``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>``) as a
last user message to every request; it is skipped when looking for the last real message.
"""

from __future__ import annotations

import json

from clawrl.engine.types import GenerateRequest, GenerateResult, SamplingParams

SUMMARY = "Summary: the user greeted the assistant and had it list the workspace files with ls."
PREFIX_SUMMARY = "Summary of the turn so far: the user asked for a long story about the sea."
STORY = "The old boat left the harbour at dawn, and the sea was calm and grey. "
# OpenClaw compacts once a conversation passes its context window less a reserve of a quarter of it
COMPACT_AT = 0.75
AFTER_TOOL = "The workspace listing came back from the ls tool."
CALLS: list[str] = []  # what each call was answered with, in order (read by the test through the log)


def _messages(text: str) -> list[tuple[str, str]]:
    """(role, content) of each message in SmolLM2's ChatML rendering, the generation prompt left out."""
    out = []
    for seg in text.split("<|im_start|>")[1:]:
        role, _, rest = seg.partition("\n")
        out.append((role, rest.split("<|im_end|>")[0]))
    return out[:-1] if out and out[-1][0] == "assistant" and not out[-1][1] else out


def _scripted(engine, request: GenerateRequest, text: str, limit: int | None = None) -> GenerateResult:
    """``text`` as the engine's answer (its first ``limit`` tokens), ended by EOS."""
    tok = engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    if limit is not None:
        ids = ids[:limit]
        text = tok.decode(ids)
    ids.append(tok.eos_token_id)
    version = engine.weight_version
    return GenerateResult(rid=request.rid or "openclaw-hook", text=text, output_ids=ids,
                          prompt_tokens=len(request.input_ids), completion_tokens=len(ids),
                          finish_reason={"type": "stop", "matched": tok.eos_token_id}, weight_version=version,
                          output_logprobs=[0.0] * len(ids),
                          weight_versions=[{"version": version, "start": 0, "end": len(ids)}])


async def generate(engine, request: GenerateRequest):
    msgs = _messages(engine.tokenizer.decode(request.input_ids))
    real = [m for m in msgs if "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>" not in m[1]]
    system = " ".join(c for r, c in msgs if r == "system")
    role, content = real[-1] if real else ("", "")
    if "context summarization assistant" in system or "a conversation to summarize" in content:
        prefix = "This is the PREFIX of a turn" in content
        CALLS.append("prefix_summary" if prefix else "summary")
        return _scripted(engine, request, PREFIX_SUMMARY if prefix else SUMMARY)
    if role == "tool" or content.startswith("<tool_response>"):
        CALLS.append("after_tool")
        return _scripted(engine, request, AFTER_TOOL)
    if role == "user" and "ls tool" in content:
        CALLS.append("tool_call")
        call = {"name": "ls", "arguments": {"path": "."}}
        return _scripted(engine, request, f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    if role == "user" and "long story" in content:
        CALLS.append("story")
        length = int(COMPACT_AT * engine.max_context_len) - len(request.input_ids) + 64
        assert 0 < length < request.sampling_params.max_new_tokens, (length, request.sampling_params.max_new_tokens)
        return _scripted(engine, request, STORY * length, limit=length)
    CALLS.append("engine")
    sp = SamplingParams(**{**request.sampling_params.__dict__, "max_new_tokens": 8})
    return await engine.generate(GenerateRequest(input_ids=request.input_ids, sampling_params=sp,
                                                 return_logprob=True, top_logprobs_num=request.top_logprobs_num))
