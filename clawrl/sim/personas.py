"""Simulated users: personas with a preference a rule can check, and how they react to an answer.

A persona never states its preference up front (real users rarely do); it reacts in its next
message the way people do - "thanks!" when the answer suits it, a correction when it does not,
"that's not what I asked" when the answer is off topic. Those reactions are the next states the
judge reads, so the rule-based judge and the hindsight hint see exactly what a live user would send.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

WORD_RE = re.compile(r"[A-Za-zÀ-ÿ0-9']+")
FRENCH_WORDS = frozenset("le la les un une des est et de du en que qui pour pas dans avec sur ce il elle "
                         "nous vous sont au aux très plus".split())


def words(text: str) -> list[str]:
    return WORD_RE.findall(text)


@dataclass(frozen=True)
class Persona:
    name: str
    description: str
    check: Callable[[str], bool]  # does an answer satisfy the preference?
    correction: str  # what the user says when it does not (its instruction part becomes the hint)

    def satisfied(self, text: str) -> bool:
        return bool(text.strip()) and self.check(text)


def _concise(limit: int) -> Callable[[str], bool]:
    return lambda text: len(words(text)) <= limit


def _detailed(least: int) -> Callable[[str], bool]:
    return lambda text: len(words(text)) >= least


def _paragraphs(text: str) -> bool:
    return sum(1 for part in re.split(r"\n\s*\n", text) if part.strip()) >= 2


def _plain(text: str) -> bool:
    return "\n" not in text.strip()


def _signoff(text: str) -> bool:
    return text.rstrip().rstrip("!. ").lower().endswith("cheers")


def _lowercase(text: str) -> bool:
    return not any(c.isupper() for c in text)


def _bullets(text: str) -> bool:
    return sum(1 for line in text.splitlines() if line.lstrip().startswith(("- ", "* ", "• "))) >= 2


def _french(text: str) -> bool:
    ws = [w.lower() for w in words(text)]
    return len(ws) > 0 and sum(w in FRENCH_WORDS for w in ws) / len(ws) >= 0.15


PERSONAS: dict[str, Persona] = {
    "concise": Persona("concise", "wants answers of at most 25 words", _concise(25),
                       "no, that's too long. answer in at most 25 words please."),
    "signoff": Persona("signoff", "wants every answer to end with 'Cheers!'", _signoff,
                       "no, please end your answer with 'Cheers!'"),
    "lowercase": Persona("lowercase", "wants answers in lowercase only", _lowercase,
                         "no, write in lowercase letters only please."),
    "bullets": Persona("bullets", "wants answers as a bullet list", _bullets,
                       "no, answer as a bullet list with '- ' at the start of each line please."),
    "french": Persona("french", "wants answers in French", _french, "no, answer in French please."),
    # the users demo's panel: two pairs of opposite wishes the served model meets some of the time (SmolLM2-135M,
    # 48 tokens: 6% of its answers are concise, 90% detailed, 6% in paragraphs, 93% plain), where French, bullets
    # and the sign-off are met by none of them and so give its learner no contrast
    "detailed": Persona("detailed", "wants answers of at least 30 words", _detailed(30),
                        "no, that's too short. explain in at least 30 words please."),
    "paragraphs": Persona("paragraphs", "wants answers in two paragraphs or more", _paragraphs,
                          "no, split your answer into two paragraphs please."),
    "plain": Persona("plain", "wants one paragraph without line breaks", _plain,
                     "no, answer in one paragraph without line breaks please."),
}

THANKS = "thanks, that's great!"
OFF_TOPIC = "that's not what I asked."


def get_persona(name: str) -> Persona:
    try:
        return PERSONAS[name]
    except KeyError:
        raise ValueError(f"unknown persona {name!r}; valid: {', '.join(PERSONAS)}") from None


def on_topic(text: str, keywords: tuple[str, ...], question: str = "") -> bool:
    """The answer mentions the subject of the question: one of its keywords (prefix match, so
    'plant' matches 'plants') that the question itself does not contain - echoing the question
    back is not an answer. A collapsed policy that says the same line to every prompt fails."""
    asked = {w.lower() for w in words(question)}
    useful = [k for k in keywords if not any(a.startswith(k) for a in asked)] or list(keywords)
    ws = [w.lower() for w in words(text)]
    return any(w.startswith(k) for k in useful for w in ws)


def react(persona: Persona, text: str, keywords: tuple[str, ...], question: str = "") -> tuple[str, bool, bool]:
    """(the user's next message, satisfied the persona, on topic)."""
    topical = on_topic(text, keywords, question)
    liked = persona.satisfied(text)
    if not topical:
        return OFF_TOPIC, liked, topical
    if not liked:
        return persona.correction, liked, topical
    return THANKS, liked, topical
