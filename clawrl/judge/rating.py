"""Rate an answer that has no next state: the scorer of the promotion gate's replay evaluation.

A live turn is judged from what followed it (the user's reaction, a tool's result). An evaluation
answer, written by a candidate for a replayed request, has no such evidence, so the judge model is
asked a different question: how good is this answer to this conversation
(``prompts.build_rating_messages``: the PRM prompt's material without the next-state section). The
votes take the PRM's path (``parse_score`` on each, ``majority_vote`` over them); the score s in
{-1, 0, 1} becomes (s + 1) / 2 in [0, 1]. Votes that do not parse count as in a live verdict (no
majority: 0, i.e. 0.5). When every vote failed (backend errors) the rating raises: an answer the
judge could not rate is no evidence for either version.

Only a model judge can do this; the rule judge reads reactions and nothing else (a replay set's ``[gate]
evaluator`` replaces the judge instead, and the configuration refuses the rule judge without one).
"""

from __future__ import annotations

from typing import Any

from clawrl.judge.backends import JudgeBackend, JudgeBackendError
from clawrl.judge.context import answer_context
from clawrl.judge.parse import parse_score
from clawrl.judge.prompts import build_rating_messages
from clawrl.judge.voting import majority_vote


async def rate_answer(backend: JudgeBackend, messages: list[dict[str, Any]], answer: str, *, n: int,
                      temperature: float, max_tokens: int, budget_chars: int) -> float:
    """The judge's rating of ``answer`` to the request ``messages``, in [0, 1] (module docstring)."""
    prompt = build_rating_messages(answer_context(messages, answer), budget_chars)
    try:
        raw = await backend.complete(prompt, n=n, temperature=temperature, max_tokens=max_tokens)
    except Exception as e:  # noqa: BLE001 - a backend that raises despite the contract fails every vote
        raw = [e] * n
    if not raw or all(isinstance(r, Exception) for r in raw):
        why = " | ".join(sorted({f"{type(r).__name__}: {r}" for r in raw})) or "no completions"
        raise JudgeBackendError(f"the judge could not rate an evaluation answer: all {n} votes failed: {why}")
    score, _ = majority_vote([None if isinstance(r, Exception) else parse_score(r) for r in raw])
    return (score + 1) / 2
