"""Fixtures for storage tests: a turn factory, a temp data root, child-process scripts.

Child scripts get SCRIPT_HEADER (the same turn factory, without pytest) prepended.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from clawrl.records import TurnRecord

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=timezone.utc)


def _make_turn(i: int, *, session: str = "s0", turn_type: str = "main", created_at: datetime | None = None,
              n_prompt: int = 12, n_output: int = 5, seed: int | None = None) -> TurnRecord:
    rng = random.Random(i if seed is None else seed)
    created = created_at or T0 + timedelta(seconds=i)
    return TurnRecord(
        turn_id=f"turn-{i:06d}", session_id=session, turn_index=i, turn_type=turn_type, namespace="open",
        model="clawrl-policy", weight_version="v0",
        request_messages='[{"role": "user", "content": "hi \\u00e9 [red]"}]', request_tools=None,
        request_params='{"temperature": 0.7}',
        prompt_ids=[rng.randrange(50_000) for _ in range(n_prompt)],
        output_ids=[rng.randrange(50_000) for _ in range(n_output)],
        # Full float64 values, some large in magnitude: float32 storage would move these by ~1e-6.
        rollout_logprobs=[-rng.random() * 40 for _ in range(n_output)],
        text="ok", tool_calls=None, finish_reason="stop", created_at=created,
        completed_at=created + timedelta(milliseconds=250), latency_ms=250.0,
    )


@pytest.fixture
def make_turn():
    return _make_turn


@pytest.fixture
def data_root(tmp_path) -> Path:
    return tmp_path / "data"


# Prepended to scripts run in a child process: the same turn factory, without pytest.
SCRIPT_HEADER = textwrap.dedent('''
    import os, sys, random, time
    from datetime import datetime, timedelta, timezone
    from clawrl.records import TurnRecord
    from clawrl.storage.writer import DataStore
    T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)

    def make_turn(i):
        rng = random.Random(i)
        return TurnRecord(
            turn_id=f"turn-{i:06d}", session_id="s0", turn_index=i, turn_type="main", namespace="open",
            model="m", weight_version="v0", request_messages="[]", request_tools=None, request_params="{}",
            prompt_ids=[rng.randrange(50_000) for _ in range(64)], output_ids=[rng.randrange(50_000) for _ in range(16)],
            rollout_logprobs=[-rng.random() * 40 for _ in range(16)], text="ok", tool_calls=None,
            finish_reason="stop", created_at=T0 + timedelta(seconds=i), completed_at=T0 + timedelta(seconds=i),
            latency_ms=1.0)
''')


def _spawn(script: str, *args: str) -> subprocess.Popen:
    """Run SCRIPT_HEADER + script in a fresh interpreter; stdout is a pipe of text lines."""
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT_HEADER + textwrap.dedent(script), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
    )


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def run(script: str, *args: str) -> subprocess.Popen:
        procs.append(_spawn(script, *args))
        return procs[-1]

    yield run
    for p in procs:  # only the children this test started
        if p.poll() is None:
            p.kill()
        p.wait()
