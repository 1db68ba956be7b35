"""A scripted model for tests that need specific model output (a tool call, a stop string).

A random-init test model never writes a ``<tool_call>`` block, so tests that need one use this
wrapper: the *text* is scripted, but every log-prob is real - the wrapped engine scores the scripted
tokens under the prompt with prefill-only prompt scoring, exactly as the OPD teacher path does.
Everything else (model_info, pause, weight updates) is the real engine's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator

from clawrl.engine.types import GenerateRequest, GenerateResult, SamplingParams


class ScriptedEngine:
    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.script: deque[str] = deque()
        self.requests: list[GenerateRequest] = []

    def __getattr__(self, name):  # everything not scripted is the real engine's
        return getattr(self.engine, name)

    async def _scripted(self, req: GenerateRequest, text: str) -> GenerateResult:
        t0 = time.perf_counter()
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        prompt = list(req.input_ids)
        scored = await self.engine.generate(GenerateRequest(
            input_ids=prompt + ids, sampling_params=SamplingParams(max_new_tokens=0),
            return_logprob=True, logprob_start_len=len(prompt) - 1))
        logprobs = [float(x) for x in scored.input_logprobs[1:]]
        assert len(logprobs) == len(ids)
        return GenerateResult(rid=req.rid, text=text, output_ids=ids, prompt_tokens=len(prompt),
                              completion_tokens=len(ids), weight_version=scored.weight_version,
                              finish_reason={"type": "stop", "matched": ids[-1]}, output_logprobs=logprobs,
                              weight_versions=[{"version": scored.weight_version, "start": 0, "end": len(ids)}],
                              e2e_latency=time.perf_counter() - t0)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.requests.append(req)
        if not self.script:
            return await self.engine.generate(req)
        return await self._scripted(req, self.script.popleft())

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        self.requests.append(req)
        if not self.script:
            async for r in self.engine.generate_stream(req):
                yield r
            return
        final = await self._scripted(req, self.script.popleft())
        for k in range(1, len(final.output_ids)):
            ids = final.output_ids[:k]
            yield GenerateResult(rid=final.rid, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                 output_ids=ids, prompt_tokens=final.prompt_tokens, completion_tokens=k,
                                 finish_reason=None, weight_version=final.weight_version,
                                 output_logprobs=final.output_logprobs[:k])
        yield final
