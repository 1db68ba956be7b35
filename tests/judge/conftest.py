"""A started tiny engine shared by the judge tests."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    """The tiny model in the embedded engine, started once for all judge tests (float32, CPU)."""
    from clawrl.engine.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, dtype="float32", device="cpu", max_batch_size=8, max_context_len=2048,
                            weight_version="0", served_model_name="tiny")
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())
