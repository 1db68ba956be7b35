import pytest


@pytest.fixture
def gateway_settings(make_settings):
    def make(**kw):
        base = {"server.open_mode": True, "ppo.max_new_tokens": 16, "ppo.temperature": 1.0}
        base.update({k.replace("__", "."): v for k, v in kw.items()})
        return make_settings(base)

    return make
