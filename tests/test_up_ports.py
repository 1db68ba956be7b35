"""`clawrl up` checks every port it is about to open before it starts anything, and a taken port is one
line naming the option or config key that moves it."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path

from typer.testing import CliRunner

from clawrl import supervisor
from clawrl.cli import app
from clawrl.config import dump_toml
from clawrl.ports import free_api_port, free_ports

ALL_ENGINES = {"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "gate.canary_share": 0.25}


def _listening(stack: ExitStack, port: int) -> None:
    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    s.bind(("127.0.0.1", port))
    s.listen()


def test_every_service_up_starts_listens_on_a_port_whose_key_is_known(make_settings):
    services = supervisor.plan(make_settings(ALL_ENGINES), Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000,
                               trainer_port=30020)
    listening = {s.name: s.listens for s in services if s.listens}
    assert set(listening) == {"prefect", "mlflow", "trainer", "gateway", "judge-engine", "eval-engine",
                              "canary-engine"} and set(listening) <= set(supervisor.PORT_KEYS)
    assert listening["eval-engine"] == ("127.0.0.1", 30022) and listening["judge-engine"][1] == 30021
    assert supervisor.PORT_KEYS["eval-engine"].startswith("--api-port / [server] api_port")


def test_taken_and_doubled_ports_are_named_by_their_own_keys(make_settings):
    api = free_api_port()
    ports = free_ports(2, avoid=[api + 10, api + 21, api + 22, api + 23])
    s = make_settings({**ALL_ENGINES, "server.api_port": api})
    services = supervisor.plan(s, Path("/conf/up.toml"), prefect_port=ports[0], mlflow_port=ports[1],
                               trainer_port=ports[0])  # the trainer on the Prefect port
    with ExitStack() as stack:
        assert supervisor.port_problems(services) == [
            f"port {ports[0]} is set for both prefect and trainer: choose another with --trainer-port"]
        _listening(stack, api + 22)
        _listening(stack, api)
        problems = supervisor.port_problems(services)
    assert f"eval-engine: port {api + 22} on 127.0.0.1 is in use by another process: choose another with " \
           "--api-port / [server] api_port (the engines' ports are api_port + 10, 21, 22, 23)" in problems
    assert f"gateway: port {api} on 127.0.0.1 is in use by another process: choose another with " \
           "--api-port / [server] api_port" in problems
    assert len(problems) == 3


def test_clawrl_up_with_a_taken_port_starts_nothing_and_names_the_key(make_settings, tmp_path):
    api = free_api_port()
    ports = [api, api + 22, *free_ports(3, avoid=[api + 10, api + 21, api + 22, api + 23])]
    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "server.api_port": api})
    conf = tmp_path / "up.toml"
    conf.write_text(dump_toml(s))
    with ExitStack() as stack:
        _listening(stack, ports[1])
        res = CliRunner().invoke(app, ["up", "-c", str(conf), "--prefect-port", str(ports[2]), "--mlflow-port",
                                       str(ports[3]), "--trainer-port", str(ports[4])])
    assert res.exit_code == 1, res.output
    assert "nothing started" in res.stderr and "choose another with --api-port / [server] api_port" in res.stderr, \
        res.stderr
    assert not (s.storage.data_root / "logs").exists() and not (s.storage.data_root / "mlflow").exists()


def test_clawrl_up_api_port_moves_the_gateway_and_the_engines_after_it(make_settings, tmp_path):
    """--api-port sets [server] api_port for this run, as serve's --port does: the gateway listens there
    and the engines' ports follow it. Shown by the ports up checks: with the config's own api_port
    free, the option's - and its evaluation engine's, + 22 - are the ones found taken."""
    api = free_api_port()
    config_api = api
    while abs(config_api - api) <= 23:  # the two ports' engines apart
        config_api = free_api_port()
    ports = free_ports(3, avoid=[p + d for p in (api, config_api) for d in (0, 10, 21, 22, 23)])
    s = make_settings({"prm.backend": "engine", "ppo.advantage_estimator": "grpo", "server.api_port": config_api})
    conf = tmp_path / "up.toml"
    conf.write_text(dump_toml(s))
    with ExitStack() as stack:
        _listening(stack, api)
        _listening(stack, api + 22)
        res = CliRunner().invoke(app, ["up", "-c", str(conf), "--api-port", str(api), "--prefect-port", str(ports[0]),
                                       "--mlflow-port", str(ports[1]), "--trainer-port", str(ports[2])])
    assert res.exit_code == 1, res.output
    assert f"gateway: port {api} on 127.0.0.1 is in use by another process: choose another with --api-port" \
        in res.stderr, res.stderr
    assert f"eval-engine: port {api + 22} on 127.0.0.1" in res.stderr and str(config_api) not in res.stderr
    assert not (s.storage.data_root / "logs").exists()
