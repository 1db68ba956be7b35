"""Which waiting samples the next PPO step takes: oldest first, never staler than the cap.

Staleness of a sample = (current policy version) - (version that sampled it). Samples older than
``max_staleness`` versions are excluded with fate ``too_stale`` rather than trained on with an
importance ratio that truncated IS would have to clip away almost entirely (the reference has no
cap at all: a turn can wait forever and its ratio is still treated as 1). A sample of the version
serving now is never too stale: when the promotion gate refuses candidates, the policy moves on
while users are still served the champion, and nothing fresher than its samples can come (without
this, two refusals in a row with ``max_staleness = 1`` stop training for good).
"""

from __future__ import annotations

from typing import Any


def parse_version(label: str | int | None) -> int:
    """Our weight versions are step counts; SGLang's initial label 'default' means version 0."""
    try:
        return int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def staleness(sample_version: str | int, current_version: int) -> int:
    return current_version - parse_version(sample_version)


def select_batch(samples: list[dict[str, Any]], *, current_version: int, batch_size: int, max_staleness: int,
                 serving_version: int | None = None) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(the batch or None when fewer than ``batch_size`` fresh samples wait, the too-stale samples).

    ``samples`` must be oldest first; the batch is the first ``batch_size`` fresh ones by ``take_order``
    where samples have one (``clawrl.storage.queries.trainable_samples``: the oldest weight version
    first, never by time), else by their order, and keeps their order. Samples of
    ``serving_version`` (the champion serving now) are fresh whatever their staleness.
    """
    def fresh(s: dict[str, Any]) -> bool:
        return (staleness(s["weight_version"], current_version) <= max_staleness
                or (serving_version is not None and parse_version(s["weight_version"]) == serving_version))

    ok = [s for s in samples if fresh(s)]
    stale = [s for s in samples if not fresh(s)]
    if len(ok) < batch_size:
        return None, stale
    taken = {id(s) for s in sorted(ok, key=lambda s: s.get("take_order", 0))[:batch_size]}  # stable: ties keep order
    return [s for s in ok if id(s) in taken], stale
