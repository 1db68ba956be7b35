"""The generate hook of a judge model that scores turns but never writes a usable hint
(tests/flows/test_doctor_runs.py): a PRM prompt gets a verdict ending in ``\\boxed{-1}``, anything else
- the hint prompts - the tiny random-init model's own text, as a weak model would answer."""

from __future__ import annotations

from clawrl.engine.types import GenerateRequest
from clawrl.judge.prompts import PRM_SYSTEM
from tests.utils.openclaw_hook import _scripted

VERDICT = "The user corrected the answer, so the turn was wrong. \\boxed{-1}"


async def generate(engine, request: GenerateRequest):
    if PRM_SYSTEM[:80] in engine.tokenizer.decode(request.input_ids):
        return _scripted(engine, request, VERDICT)
    return await engine.generate(request)
