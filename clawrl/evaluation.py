"""Score one weight version on a fixed evaluation set through an engine: the promotion gate's measurement.

Every prompt is answered ``samples`` times with fixed seeds (answer j of prompt i: seed ``seed + i *
samples + j``) and all requests are in flight at once, so the engine batches them; a prompt's score
is the mean of ``score(i, answer)`` over its answers. The same set, samples, seeds, budget and
temperature give the same requests for every version: scores of two versions pair up prompt by
prompt, and a decision made on them replays identically.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clawrl.chat import ChatAdapter, ChatMessage
from clawrl.engine.types import Engine, GenerateRequest, SamplingParams
from clawrl.hooks import HookError, import_path

Prompts = Sequence[Sequence[dict[str, Any]]]  # chat message lists
Scorer = Callable[[int, str], float]  # (prompt index, answer text) -> score in [0, 1]


@dataclass(frozen=True)
class EvalSet:
    """The prompts and their scorer (what ``[gate] evaluator`` returns), and what makes a run of it
    comparable with another (``key``)."""

    prompts: Prompts
    score: Scorer
    samples: int
    seed: int
    max_tokens: int
    temperature: float
    key: str


def load_eval_set(evaluator: str, *, size: int, samples: int, seed: int, max_tokens: int,
                  temperature: float) -> EvalSet:
    """The evaluation set of ``evaluator`` (import path of ``fn(size, seed) -> (prompts, score)``)."""
    fn = import_path(evaluator)
    if not callable(fn):
        raise HookError(f"[gate] evaluator = {evaluator!r} is not callable")
    prompts, score = fn(size=size, seed=seed)
    if not prompts or not callable(score):
        raise HookError(f"[gate] evaluator = {evaluator!r} must return (a non-empty list of prompts, a scorer)")
    blob = json.dumps({"evaluator": evaluator, "prompts": [list(p) for p in prompts], "samples": samples, "seed": seed,
                       "max_tokens": max_tokens, "temperature": temperature}, sort_keys=True)
    return EvalSet(prompts, score, samples, seed, max_tokens, temperature,
                   hashlib.sha256(blob.encode()).hexdigest()[:16])


async def answer_prompts(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet) -> list[list[str]]:
    """The answers of ``engine`` to every prompt, ``samples`` per prompt, by prompt."""
    def request(i: int, j: int, ids: list[int]) -> GenerateRequest:
        return GenerateRequest(input_ids=ids, sampling_params=SamplingParams(
            max_new_tokens=eval_set.max_tokens, temperature=eval_set.temperature,
            sampling_seed=eval_set.seed + i * eval_set.samples + j))

    rendered = [adapter.render([ChatMessage.model_validate(m) for m in p]) for p in eval_set.prompts]
    results = await asyncio.gather(*(engine.generate(request(i, j, ids)) for i, ids in enumerate(rendered)
                                     for j in range(eval_set.samples)))
    texts = [r.text for r in results]
    return [texts[i * eval_set.samples:(i + 1) * eval_set.samples] for i in range(len(rendered))]


async def evaluate_version(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet) -> tuple[list[float], float]:
    """(per-prompt scores, seconds) of the version ``engine`` serves now."""
    t0 = time.perf_counter()
    answers = await answer_prompts(engine, adapter, eval_set)
    scores = [sum(float(eval_set.score(i, a)) for a in texts) / len(texts) for i, texts in enumerate(answers)]
    bad = [s for s in scores if not 0.0 <= s <= 1.0]
    if bad:
        raise ValueError(f"evaluation scores must lie in [0, 1], got {bad[:3]}")
    return scores, time.perf_counter() - t0
