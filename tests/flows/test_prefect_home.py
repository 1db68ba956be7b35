"""Which Prefect a `clawrl judge|train|replay` command records into: the API of a `clawrl up`
running on the same data root (found through its ``up.pids.json``, checked against a real Prefect
server's health endpoint), else the data root's own Prefect home, never the user's ``~/.prefect``."""

from __future__ import annotations

import json
import socket

import pytest

from clawrl.cli.common import use_data_root_prefect


@pytest.fixture
def clean_env(monkeypatch):
    """Neither variable set; whatever the code under test sets is undone afterwards."""
    for name in ("PREFECT_API_URL", "PREFECT_HOME"):
        monkeypatch.setenv(name, "")  # recorded, so the original value (or its absence) comes back
        monkeypatch.delenv(name)
    return monkeypatch


def _write_up(root, api: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "up.pids.json").write_text(json.dumps({"supervisor": 1, "prefect": 2, "prefect_api_url": api}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_running_clawrl_up_on_the_data_root_is_used(prefect_harness, make_settings, clean_env):
    import os

    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()  # the session's real Prefect server stands in for `clawrl up`'s
    s = make_settings()
    _write_up(s.storage.data_root, api)
    assert use_data_root_prefect(s) == api
    assert os.environ["PREFECT_API_URL"] == api
    assert os.environ["PREFECT_HOME"] == str(s.storage.data_root / "prefect")


def test_a_stale_up_file_falls_back_to_the_data_roots_prefect_home(make_settings, clean_env):
    import os

    s = make_settings()
    _write_up(s.storage.data_root, f"http://127.0.0.1:{_free_port()}/api")  # nothing listens there
    home = s.storage.data_root / "prefect"
    assert use_data_root_prefect(s) == str(home)
    assert "PREFECT_API_URL" not in os.environ
    assert os.environ["PREFECT_HOME"] == str(home) and home.is_dir()


def test_without_up_the_home_is_the_data_roots_and_an_explicit_api_wins(make_settings, clean_env):
    import os

    s = make_settings()
    assert use_data_root_prefect(s) == str(s.storage.data_root / "prefect")
    assert "PREFECT_API_URL" not in os.environ
    clean_env.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    _write_up(s.storage.data_root, "http://127.0.0.1:1/api")
    assert use_data_root_prefect(s) == "http://prefect.example:4200/api"
