"""Shared fixtures: temp data roots, the tiny models, one engine and one Prefect harness for the session
(the offline environment and the model cache come from the repository's conftest.py).

Prefect's test harness is a session fixture that only flow tests request (it costs ~15 s to start).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clawrl.config import load_settings

PREFECT_STARTUP_S = 600  # the Prefect test server's start: ~15 s on a quiet 2-core machine, minutes on a busy one


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need CUDA: without it they are skipped, not failed (CI has no GPU)."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def make_settings(tmp_path, model_cache):
    """Settings with a temp data root and the shared model cache; keyword overrides as 'section.key'.
    The promotion gate evaluates a small set (4 prompts, answers of 8 tokens: the serving budget) unless a
    test says otherwise: it runs in every train flow, and most tests are about something else."""

    def make(overrides: dict | None = None, **kw):
        merged = {"storage.data_root": str(tmp_path / "data"), "storage.model_cache": str(model_cache),
                  "model.name": "tiny", "gate.size": 4, "ppo.max_new_tokens": 8}
        merged.update(overrides or {})
        merged.update({k.replace("__", "."): v for k, v in kw.items()})
        return load_settings(env={}, overrides=merged)

    return make


@pytest.fixture(scope="session")
def tiny_dir(model_cache) -> Path:
    from clawrl.models import resolve_model_dir

    return resolve_model_dir("tiny", model_cache)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(model_cache) -> Path:
    from clawrl.models import resolve_model_dir

    return resolve_model_dir("tiny-qwen3", model_cache)


@pytest.fixture(scope="session")
def smollm2_dir(model_cache) -> Path:
    from clawrl.models import resolve_model_dir

    return resolve_model_dir("smollm2-135m", model_cache)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    """One started tiny engine (float32, CPU, weight_version "0") shared by the session's tests.
    Tests must not change its weights; tests that update weights build their own engine."""
    import asyncio

    from clawrl.engine.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, dtype="float32", device="cpu", max_batch_size=16, max_context_len=2048,
                            weight_version="0", served_model_name="tiny")
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One Prefect test server for the session (startup ~15 s on 2 cores, several times that beside other
    test runs; the default timeout is too short)."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    # Prefect counts only its own 0.1 s sleeps between health checks against this, so the wall time is
    # longer still; it does not notice a server that died, hence a bound rather than tests.utils.waiting.CAP_S
    with prefect_test_harness(server_startup_timeout=PREFECT_STARTUP_S):
        yield
