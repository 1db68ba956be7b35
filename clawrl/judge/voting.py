"""Turn m parsed judge votes into one score, and m hint candidates into one hint.

The vote keeps *why* a score is 0, so "the judge always scores 0" can be diagnosed:
"majority" (a real verdict), "tie" (the parsed votes have no strict majority: 1 vs -1, or
1 / 0 / -1 spread) or "all_failed" (no vote parsed; the raw outputs show why).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

MIN_HINT_CHARS = 10  # the reference keeps hints longer than 10 characters: shorter ones carry no instruction


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


HINT_POLICIES: dict[str, Callable[[list[str]], str]] = {
    "longest": lambda hints: max(hints, key=len),  # the reference's: the most informative (first of equals)
    "first": lambda hints: hints[0],
    "shortest": lambda hints: min(hints, key=len),  # least room for the hint to leak the answer wholesale
}


def select_hint(candidates: Sequence[str | None], policy: str = "longest", *,
                min_chars: int = MIN_HINT_CHARS) -> str | None:
    """One hint among the accepted candidates (None = a vote without a usable hint), or None.

    Candidates are stripped; those shorter than ``min_chars`` are not usable. Unknown ``policy``
    raises ValueError naming the valid ones."""
    try:
        choose = HINT_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown hint policy {policy!r}; valid: {', '.join(sorted(HINT_POLICIES))}") from None
    usable = [h.strip() for h in candidates if h is not None and len(h.strip()) >= min_chars]
    return choose(usable) if usable else None
