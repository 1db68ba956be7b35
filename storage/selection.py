"""Which waiting samples the next PPO step takes: oldest first, never staler than the cap.

Staleness of a sample = (current policy version) - (version that sampled it). Samples older than
``max_staleness`` versions are excluded with fate ``too_stale`` rather than trained on with an
importance ratio that truncated IS would have to clip away almost entirely (the reference has no
cap at all: a turn can wait forever and its ratio is still treated as 1).
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


def select_batch(samples: list[dict[str, Any]], *, current_version: int, batch_size: int,
                 max_staleness: int) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(the batch or None when fewer than ``batch_size`` fresh samples wait, the too-stale samples).

    ``samples`` must be oldest first; the batch is the oldest ``batch_size`` fresh ones.
    """
    fresh = [s for s in samples if staleness(s["weight_version"], current_version) <= max_staleness]
    stale = [s for s in samples if staleness(s["weight_version"], current_version) > max_staleness]
    return (fresh[:batch_size] if len(fresh) >= batch_size else None), stale
