"""Turn m parsed judge votes into one score, and m hint candidates into one hint.

The vote keeps *why* a score is 0, so "the judge always scores 0" can be diagnosed:
"majority" (a real verdict), "tie" (the parsed votes have no strict majority: 1 vs -1, or
1 / 0 / -1 spread) or "all_failed" (no vote parsed; the raw outputs show why).

A hint becomes text the OPD teacher is scored under, so a candidate is used only when
:func:`hint_problem` finds nothing wrong with it, whatever the judge backend: between
:data:`MIN_HINT_CHARS` and :data:`MAX_HINT_CHARS` long; no markup of the judge's answer format or of
a chat template (``boxed{``, hint markers, think tags, ``<|...|>`` tokens), which in a hint can only
have come from quoted conversation text; no prompt-injection phrases ("ignore previous
instructions", "system prompt", "you are now"); and, for a model judge, no run of
:data:`COPY_WORDS` words copied from the user's reply (a model judge writes the hint in its own
words; the rule judge's hint is, by construction, the user's correction with its lead-in removed,
so it is held to the other checks only).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

MIN_HINT_CHARS = 10  # the reference keeps hints longer than 10 characters: shorter ones carry no instruction
MAX_HINT_CHARS = 600  # a hint is an instruction, not a document
COPY_WORDS = 8  # a model judge's hint may not repeat this many consecutive words of the user's reply

_MARKUP = re.compile(r"boxed\s*\{|HINT_(?:START|END)|[<\[]/?think[>\]]|<\||\|>", re.IGNORECASE)
_INJECTION = re.compile(r"\b(?:ignore|disregard|forget)\b.{0,40}\b(?:instructions?|rules|prompt)\b|"
                        r"\bsystem prompt\b|\byou are now\b|\bnew instructions?\b", re.IGNORECASE)
_WORD = re.compile(r"\w+")


def majority_vote(votes: Sequence[int | None]) -> tuple[int, str]:
    """(score, reason): the value held by more than half of the parsed (non-None) votes.

    No parsed vote -> (0, "all_failed"); no value above half -> (0, "tie"). With the default
    m = 3 this equals "most common value, ties -> 0"; for larger m it is stricter than a plurality
    (2 of 4 parsed votes is not a majority)."""
    parsed = [v for v in votes if v is not None]
    if not parsed:
        return 0, "all_failed"
    value, count = Counter(parsed).most_common(1)[0]
    if 2 * count > len(parsed):
        return value, "majority"
    return 0, "tie"


def hint_problem(hint: str, *, user_texts: Sequence[str] = (), copy_check: bool = True) -> str | None:
    """Why ``hint`` (stripped) must not be used, or None (module docstring)."""
    if not MIN_HINT_CHARS <= len(hint) <= MAX_HINT_CHARS:
        return f"length {len(hint)} outside {MIN_HINT_CHARS}..{MAX_HINT_CHARS}"
    if (m := _MARKUP.search(hint)) is not None:
        return f"markup {m.group(0)!r}"
    if (m := _INJECTION.search(hint)) is not None:
        return f"instruction to the model {m.group(0)!r}"
    if copy_check:
        words = [w.lower() for w in _WORD.findall(hint)]
        runs = {tuple(words[i:i + COPY_WORDS]) for i in range(len(words) - COPY_WORDS + 1)}
        for text in user_texts:
            said = [w.lower() for w in _WORD.findall(text)]
            if any(tuple(said[i:i + COPY_WORDS]) in runs for i in range(len(said) - COPY_WORDS + 1)):
                return f"copies {COPY_WORDS}+ words of the user's reply"
    return None


def select_hint(candidates: Sequence[str | None], *, min_chars: int = MIN_HINT_CHARS,
                problem: Callable[[str], str | None] | None = None) -> str | None:
    """The longest usable candidate (the reference's choice: the most informative; the earlier vote
    of equals), or None. Candidates are stripped (None = a vote without a hint); those shorter than
    ``min_chars``, or in which ``problem`` (e.g. :func:`hint_problem`) finds something, are not usable."""
    usable = [h for h in (c.strip() for c in candidates if c is not None)
              if len(h) >= min_chars and (problem is None or problem(h) is None)]
    return max(usable, key=len, default=None)
