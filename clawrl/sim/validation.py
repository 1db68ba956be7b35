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


def persona_evaluator(name: str) -> Evaluator:
    persona = get_persona(name)

    def evaluator(*, size: int, seed: int):
        questions = validation_questions(size, seed)

        def score(i: int, answer: str) -> float:
            question, keywords = questions[i]
            return float(persona.satisfied(answer) and on_topic(answer, keywords, question))

        return [[{"role": "user", "content": q}] for q, _ in questions], score

    return evaluator


concise = persona_evaluator("concise")
signoff = persona_evaluator("signoff")
lowercase = persona_evaluator("lowercase")
bullets = persona_evaluator("bullets")
french = persona_evaluator("french")
