"""Simulated users talking to the gateway through the real openai SDK, and the held-out evaluation.

A training round: each user asks one question (a ``main`` turn), reads the answer, and replies as
its persona would (thanks / a correction / "that's not what I asked"). The reply is sent as the
session's next request with ``session_done``, so it becomes the first turn's next state; it asks for
a single token, since nobody reads that answer.

The evaluation asks the held-out questions as ``side`` turns (served and logged, never trained on)
with fixed seeds, and scores the first response: persona satisfied AND on topic.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from clawrl.sim.personas import Persona, react


@dataclass
class Interaction:
    session_id: str
    question: str
    answer: str
    satisfied: bool
    on_topic: bool
    reaction: str


async def user_round(client, persona: Persona, questions: list[tuple[str, tuple[str, ...]]], *, round_id: str,
                     train: bool, max_tokens: int, temperature: float, seed: int) -> list[Interaction]:
    """One user per question, all at once; user i asks with seed ``seed + i``. A training round's
    users answer with the persona's reaction (module docstring); an evaluation round's do not."""
    async def one(i: int, question: str, keywords: tuple[str, ...]) -> Interaction:
        sid = f"{round_id}-{'u' if train else 'e'}{i:02d}"
        messages = [{"role": "user", "content": question}]
        r = await client.chat.completions.create(
            model="clawrl-policy", messages=messages, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
            extra_body={"session_id": sid, "turn_type": "main" if train else "side"})
        answer = r.choices[0].message.content or ""
        reaction, liked, topical = react(persona, answer, keywords, question)
        if not train:
            return Interaction(sid, question, answer, liked, topical, "")
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": reaction}]
        await client.chat.completions.create(model="clawrl-policy", messages=messages, max_tokens=1, seed=seed + i,
                                             extra_body={"session_id": sid, "session_done": True})
        return Interaction(sid, question, answer, liked, topical, reaction)

    return list(await asyncio.gather(*(one(i, q, k) for i, (q, k) in enumerate(questions))))


def score(interactions: list[Interaction]) -> dict[str, float]:
    """score = fraction satisfying the persona AND on topic; the two rates beside it."""
    n = max(1, len(interactions))
    return {
        "score": sum(x.satisfied and x.on_topic for x in interactions) / n,
        "persona_rate": sum(x.satisfied for x in interactions) / n,
        "on_topic_rate": sum(x.on_topic for x in interactions) / n,
        "mean_words": sum(len(x.answer.split()) for x in interactions) / n,
    }


def kl_to_reference(policy_logprobs: list[list[float]], reference_logprobs: list[list[float]]) -> float:
    """Per-token mean of lp - ref_lp over the served answers' tokens: the k1 estimate of
    KL(policy || reference), exact in expectation when the answers were sampled at temperature 1
    (at a lower serving temperature it measures the same drift on the answers users actually got)."""
    num = sum(sum(a - b for a, b in zip(lp, ref)) for lp, ref in zip(policy_logprobs, reference_logprobs))
    den = sum(len(lp) for lp in policy_logprobs)
    return num / den if den else math.nan


def summarize_round(interactions: list[Interaction]) -> dict[str, Any]:
    return {**score(interactions), "reactions": dict(Counter(x.reaction for x in interactions))}
