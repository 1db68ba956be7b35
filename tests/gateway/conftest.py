import contextlib

import pytest


@pytest.fixture
def gateway_settings(make_settings):
    def make(**kw):
        base = {"server.open_mode": True, "ppo.max_new_tokens": 16, "ppo.temperature": 1.0}
        base.update({k.replace("__", "."): v for k, v in kw.items()})
        return make_settings(base)

    return make


@pytest.fixture
def gateway(gateway_settings, tiny_engine):
    """``start(engine=None, **settings)`` -> (settings, store, running gateway over real HTTP): the app
    on the tiny engine (or ``engine``) with a data store of its own."""
    from clawrl.gateway.routes import create_app
    from clawrl.storage.writer import DataStore
    from tests.utils.gateway_server import running_gateway

    stores = []

    def start(engine=None, **kw):
        s = gateway_settings(**kw)
        store = DataStore(s.storage.data_root)
        stores.append(store)
        app = create_app(s, engine=engine or tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)
        return s, store, running_gateway(app)

    yield start
    for store in stores:  # their table logs' threads end with the test (close is idempotent)
        with contextlib.suppress(Exception):  # a test that broke its disk on purpose has asserted what it must
            store.close()
