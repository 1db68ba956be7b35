import asyncio

import pytest

from clawrl.engine.embedded import EmbeddedEngine


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    """One started tiny engine shared by the gateway tests (each test gets its own app and data root)."""
    engine = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def gateway_settings(make_settings):
    def make(**kw):
        base = {"server.open_mode": True, "ppo.max_new_tokens": 16, "ppo.temperature": 1.0}
        base.update({k.replace("__", "."): v for k, v in kw.items()})
        return make_settings(base)

    return make
