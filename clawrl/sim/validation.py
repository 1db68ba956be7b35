"""The demo's ``[gate] evaluator``s: the validation questions, scored as a persona's simulated user would.

``clawrl.sim.validation:<persona>`` (concise, signoff, lowercase, bullets, french) returns the
questions of :func:`clawrl.sim.prompts.validation_questions` as chat prompts and a scorer that gives
an answer 1 when it satisfies the persona AND is on topic (the held-out score's rule), else 0.
"""

from __future__ import annotations

from collections.abc import Callable

from clawrl.sim.personas import get_persona, on_topic
from clawrl.sim.prompts import validation_questions

Evaluator = Callable[..., tuple[list[list[dict[str, str]]], Callable[[int, str], float]]]


def question_set(persona_name: str, questions: list[tuple[str, tuple[str, ...]]]):
    """(prompts, score) of ``questions`` as the persona's user asks and scores them."""
    persona = get_persona(persona_name)

    def score(i: int, answer: str) -> float:
        question, keywords = questions[i]
        return float(persona.satisfied(answer) and on_topic(answer, keywords, question))

    return [[{"role": "user", "content": q}] for q, _ in questions], score


def persona_evaluator(name: str) -> Evaluator:
    get_persona(name)  # an unknown name fails here, at import

    def evaluator(*, size: int, seed: int):
        return question_set(name, validation_questions(size, seed))

    return evaluator


concise = persona_evaluator("concise")
signoff = persona_evaluator("signoff")
lowercase = persona_evaluator("lowercase")
bullets = persona_evaluator("bullets")
french = persona_evaluator("french")
