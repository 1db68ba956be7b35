"""The docs a user reads stay short enough to read."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_results_page_stays_within_400_lines():
    """docs/benchmarks.md holds each benchmark's latest result; superseded runs live in git history."""
    lines = (DOCS / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines, over 400"
