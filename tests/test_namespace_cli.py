"""The commands that take --namespace, on a data root of many namespaces: `clawrl status` in namespace mode is one
line per namespace, the busiest ten and how many more; a malformed or unknown namespace, or --namespace on a run
of the shared policy, is one line saying what a namespace is and listing the data root's; a version the
namespace never had is one line too. (The trained path is tests/e2e/test_namespace_trust.py.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from clawrl.cli import app
from clawrl.config import dump_toml, load_settings
from clawrl.records import make_turn_id
from clawrl.storage.writer import DataStore
from tests.utils.turns import build_turn

NAMESPACES = [f"key-{i:016x}" for i in range(12)]  # namespace i has 12 - i turns: the first is the busiest


@pytest.fixture
def many(tmp_path):
    """The config file of a data root where 12 namespaces have turns (no adapter trained yet)."""
    s = load_settings(env={}, overrides={"storage.data_root": str(tmp_path / "data"), "ppo.adapters": "namespace"})
    turns = [dataclasses.replace(build_turn([{"role": "user", "content": "hi"}], session_id=f"s{i}", turn_index=j),
                                 namespace=ns, turn_id=make_turn_id(ns, f"s{i}", j))
             for i, ns in enumerate(NAMESPACES) for j in range(12 - i)]
    with DataStore(s.storage.data_root) as store:
        store.append(turns)
    conf = tmp_path / "clawrl.toml"
    conf.write_text(dump_toml(s))
    return conf


def _cli(conf, *args: str):
    return CliRunner().invoke(app, [*args, "-c", str(conf)], env={"COLUMNS": "200"})


def test_status_shows_the_ten_busiest_namespaces_and_how_many_more(many):
    out = _cli(many, "status")
    assert out.exit_code == 0, out.output
    shown = re.findall(r"^\s*(key-[0-9a-f]{16})\s+(\d+)\s+0\s+0\s+base\s+-\s*$", out.stdout, re.M)
    assert shown == [(ns, str(12 - i)) for i, ns in enumerate(NAMESPACES[:10])]
    assert "clawrl status: 12 namespaces, an adapter each (rollout_batch_size 32)" in out.stdout
    assert "and 2 more namespaces\n" in out.stdout and NAMESPACES[10] not in out.stdout


@pytest.mark.parametrize("args", [["status"], ["doctor"], ["lineage", "1"], ["promote", "1"], ["rollback"],
                                  ["replay", "1"]], ids=lambda a: a[0])
def test_a_bad_or_unknown_namespace_is_one_line_listing_the_data_roots(many, args):
    listed = ", ".join(NAMESPACES[:5]) + " and 7 more (`clawrl status` lists them)"
    what = "(a namespace is 'key-' and the first 16 hex digits of the SHA-256 of an API key, or 'open' in open mode)"
    out = _cli(many, *args, "--namespace", "alice")
    assert out.exit_code == 2 and out.stderr == f"not a namespace: 'alice' {what}; the data root's: {listed}\n"
    out = _cli(many, *args, "--namespace", "key-ffffffffffffffff")
    root = many.parent / "data"
    assert out.exit_code == 2 and out.stderr == (f"no namespace in {root}: 'key-ffffffffffffffff' {what}; the data "
                                                 f"root's: {listed}\n")


def test_namespace_options_on_a_shared_run_and_versions_never_trained_are_one_line(many, tmp_path):
    shared = tmp_path / "shared.toml"
    shared.write_text(many.read_text().replace('adapters = "namespace"', 'adapters = "shared"'))
    out = _cli(shared, "status", "--namespace", NAMESPACES[0])
    assert out.exit_code == 2 and out.stderr.startswith("--namespace is about a namespace's own adapter ([ppo] "
                                                        "adapters = 'namespace'); the run on ")
    out = _cli(many, "promote", "3", "--namespace", NAMESPACES[0])
    assert out.exit_code == 2 and out.stderr == (f"no adapter version '{NAMESPACES[0]}@v3' of namespace "
                                                 f"{NAMESPACES[0]} is recorded in {many.parent / 'data'}\n")
    out = _cli(many, "rollback", "--namespace", NAMESPACES[0])
    assert out.exit_code == 2 and out.stderr == (f"nothing to roll back to: {NAMESPACES[0]} is served "
                                                 f"{NAMESPACES[0]}@v0, its base alone\n")
    out = _cli(many, "lineage", "two", "--namespace", NAMESPACES[0])
    assert out.exit_code == 2 and out.stderr.startswith(f"not a version of {NAMESPACES[0]}'s adapter: 'two'")
    out = _cli(many, "replay", "latest", "--namespace", NAMESPACES[0])
    assert out.exit_code == 2 and out.stderr == (f"replay failed: version 'latest': expected a version of "
                                                 f"{NAMESPACES[0]}'s adapter (1, 2, ..., or 'latest')\n")
