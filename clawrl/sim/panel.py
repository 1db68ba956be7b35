"""A panel of simulated users, each with a persona and an API key of its own (`clawrl demo --scenario users`).

Every user asks questions of the same training pool, each in an order of its own drawn from the seed and
its persona's name, so a run asks the same questions in the same order whatever is trained on the answers
(the shared policy or one adapter per user). Its key is ``demo-user-<persona>``: the gateway puts its turns
in the namespace of that key, and :func:`persona_of_namespace` finds the persona back from it (the gate's
evaluator uses it to score a user's adapter by that user's wishes). After the run, :func:`summarize` compares
the arms per user and :func:`metrics_of` makes an arm's rows MLflow points.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from clawrl.ids import namespace_for_key
from clawrl.sim.personas import PERSONAS

DEFAULT_PANEL = ("concise", "detailed", "paragraphs", "plain")  # two pairs of opposite wishes (personas.py)
KEY_PREFIX = "demo-user-"


def parse_panel(text: str) -> list[str]:
    """The personas of a comma-separated list, in its order; ValueError for an unknown or repeated one
    (two users of one persona would be one namespace's wish twice, not a second user)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no persona in {text!r}; valid: {', '.join(PERSONAS)}")
    for name in names:
        if name not in PERSONAS:
            raise ValueError(f"unknown persona {name!r}; valid: {', '.join(PERSONAS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"persona {', '.join(repeated)} named twice: each user of the panel has a persona of its own")
    return names


def user_key(persona: str) -> str:
    """The API key the user of ``persona`` sends (loopback only: the demo's gateway serves nobody else)."""
    return KEY_PREFIX + persona


def user_namespace(persona: str) -> str:
    return namespace_for_key(user_key(persona))


def persona_of_namespace(namespace: str, panel: Sequence[str]) -> str:
    """The persona of ``panel`` whose key has ``namespace``; ValueError when none has it."""
    for name in panel:
        if user_namespace(name) == namespace:
            return name
    raise ValueError(f"namespace {namespace!r} is none of the panel's users ({', '.join(panel)})")


def user_questions(pool: Sequence, persona: str, round_no: int, n: int, seed: int) -> list:
    """The ``n`` questions the user of ``persona`` asks in round ``round_no`` (1-based): the next ``n`` of its
    own seeded order of ``pool`` (wrapping around), continuing where its last round ended."""
    if n < 1 or round_no < 1:
        raise ValueError(f"round_no and n must be >= 1, got {round_no} and {n}")
    order = list(pool)
    random.Random(f"{seed}-{persona}").shuffle(order)  # a str seed: the same order in every process
    start = (round_no - 1) * n
    return [order[(start + i) % len(order)] for i in range(n)]


def turns_needed(scores: Sequence[float], turns: Sequence[int], level: float) -> int | None:
    """The user's own turns trained on when its held-out score first reached ``level`` (``scores[i]``
    measured after ``turns[i]`` of them), None if it never did."""
    return next((t for s, t in zip(scores, turns) if s >= level - 1e-9), None)


def summarize(rows: dict[str, list[dict[str, Any]]], panel: list[str]) -> dict[str, dict[str, Any]]:
    """Per user: its base score, each arm's final and best score, and the turns each arm needed: its own
    turns trained on when the arm first reached its best, and when the per-user arm first reached the
    shared arm's final score (when both ran)."""
    out: dict[str, dict[str, Any]] = {}
    for p in panel:
        u: dict[str, Any] = {"base": next(iter(rows.values()))[0]["scores"][p]}
        for arm, arm_rows in rows.items():
            scores, turns = [r["scores"][p] for r in arm_rows], [r["turns"] for r in arm_rows]
            u[f"{arm}_final"], u[f"{arm}_best"] = scores[-1], max(scores)
            # None: never above the base
            u[f"{arm}_turns_to_best"] = turns_needed(scores, turns, max(scores)) if max(scores) > scores[0] else None
        if "shared" in rows and "per-user" in rows:  # None: never, or the shared arm ended no higher than the base
            mine = rows["per-user"]
            u["per-user_turns_to_shared_final"] = None if u["shared_final"] <= u["base"] else turns_needed(
                [r["scores"][p] for r in mine], [r["turns"] for r in mine], u["shared_final"])
        out[p] = u
    return out


def metrics_of(arm_rows: list[dict[str, Any]], panel: list[str]) -> list[dict[str, Any]]:
    """An arm's rows as MLflow points: ``<persona>_score`` (and its rates) per round, and their mean."""
    flat = []
    for r in arm_rows:
        point = {"step": r["round"], "turns": r["turns"], "mean_score": sum(r["scores"].values()) / len(panel)}
        for p in panel:
            point.update({f"{p}_score": r["scores"][p], f"{p}_persona_rate": r["persona_rates"][p],
                          f"{p}_on_topic_rate": r["on_topic_rates"][p]})
        flat.append(point)
    return flat
