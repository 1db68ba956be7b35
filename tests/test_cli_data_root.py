"""Every command that reads the recorded data says first which data root it read and where that came
from, and `clawrl demo` keeps one data root per run, whatever names it."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from clawrl.cli import app
from clawrl.config import dump_toml, load_settings
from clawrl.judge.runner import build_judge_config_hash
from clawrl.records import CheckpointRecord, FateRecord
from clawrl.storage.writer import DataStore
from tests.utils.turns import build_turn

READERS = [["status"], ["doctor"], ["lineage", "0"], ["sql", "select 1 as one"]]


def _first_line(res) -> str:
    """The data root line: stdout's first line, or stderr's for `sql` (its stdout is the result alone)."""
    assert res.exit_code == 0, res.output
    lines = [line for line in (res.stdout.splitlines() + res.stderr.splitlines()) if line.startswith("data root ")]
    return lines[0]


@pytest.mark.parametrize("args", READERS, ids=lambda a: a[0])
def test_a_reading_command_names_the_data_root_and_where_it_came_from(tmp_path, args):
    conf, root = tmp_path / "c.toml", tmp_path / "from-file"
    conf.write_text(f'[storage]\ndata_root = "{root}"\n')
    for made in (root, tmp_path / "from-env"):
        made.mkdir()
    cli = CliRunner()
    assert _first_line(cli.invoke(app, [*args, "-c", str(conf)])) == f"data root {root} (from {conf})"
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path / "from-env")}
    assert _first_line(cli.invoke(app, [*args, "-c", str(conf)], env=env)) == \
        f"data root {tmp_path / 'from-env'} (from env CLAWRL__STORAGE__DATA_ROOT)"
    default = load_settings(env={}).storage.data_root  # ~/.clawrl, only read; on a fresh machine it may not exist,
    res = cli.invoke(app, args, env={"CLAWRL__STORAGE__DATA_ROOT": None})  # and the line says so after the name
    named = next(x for x in res.stdout.splitlines() + res.stderr.splitlines() if x.startswith("data root "))
    assert named.startswith(f"data root {default} (the default; -c CONFIG or CLAWRL__STORAGE__DATA_ROOT reads "
                            "another)")


@pytest.mark.parametrize("args", READERS[:3], ids=lambda a: a[0])  # sql answers from empty views, below its name
def test_a_reading_command_on_a_data_root_that_does_not_exist_says_so_in_one_line(tmp_path, args):
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path / "typo")}
    res = CliRunner().invoke(app, args, env=env)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"data root {tmp_path / 'typo'} (from env CLAWRL__STORAGE__DATA_ROOT) does not exist: " \
                         "nothing was recorded there\n"
    assert not (tmp_path / "typo").exists()  # reading made nothing


def test_a_flow_command_on_a_data_root_it_cannot_make_says_so_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path / "a-file" / "root")}
    res = CliRunner().invoke(app, ["train"], env=env)
    assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit)
    assert res.stderr.splitlines() == [f"storage error: data root {tmp_path / 'a-file' / 'root'} is not usable: cannot "
                                       f"create directory {tmp_path / 'a-file' / 'root' / 'tables'}: Not a directory"]


def test_train_says_which_data_root_has_no_full_batch(tmp_path):
    conf, root = tmp_path / "c.toml", tmp_path / "root"
    conf.write_text(f'[storage]\ndata_root = "{root}"\n[prm]\nbackend = "rule"\n[ppo]\nadvantage_estimator = "grpo"\n')
    res = CliRunner().invoke(app, ["train", "-c", str(conf)])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == f"data root {root} (from {conf})"
    assert "no full batch of trainable samples yet" in res.stdout


def test_status_and_doctor_json_say_which_data_root_they_read(tmp_path):
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path)}
    status = CliRunner().invoke(app, ["status"], env=env)
    assert status.stdout.splitlines()[0] == f"data root {tmp_path} (from env CLAWRL__STORAGE__DATA_ROOT)"
    assert json.loads(CliRunner().invoke(app, ["doctor", "--json"], env=env).stdout)["data_root"] == str(tmp_path)


def test_lineage_0_is_the_initial_weights_and_names_the_versions_trained_from_them(tmp_path):
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path), "CLAWRL__MODEL__NAME": "tiny"}
    res = CliRunner().invoke(app, ["lineage", "0"], env=env)
    assert res.exit_code == 0, res.output
    assert "weight_version 0 = the initial weights of tiny ([model] name)" in res.stdout
    assert "no version trained from it yet" in res.stdout
    with DataStore(tmp_path, background=False) as store:
        store.append([CheckpointRecord("1", 1, "b1", "0", "/c/v000001", "ab", None),
                      CheckpointRecord("2", 2, "b2", "1", "/c/v000002", "cd", None),
                      CheckpointRecord("3", 3, "b3", "0", "/c/v000003", "ef", None)])  # a replay-like branch
        store.flush()
    res = CliRunner().invoke(app, ["lineage", "0"], env=env)
    assert res.exit_code == 0, res.output
    assert "versions trained from it: 1, 3" in " ".join(res.stdout.split())


def test_the_demo_runs_where_the_environment_puts_the_data_root(tmp_path, monkeypatch):
    from clawrl.cli.demo import _run_root

    conf = tmp_path / "demo.toml"
    conf.write_text(f'[storage]\ndata_root = "{tmp_path / "file-root"}"\n')
    monkeypatch.delenv("CLAWRL__STORAGE__DATA_ROOT", raising=False)
    base = load_settings(conf)
    assert _run_root(base, conf, None).parent == tmp_path / "file-root" / "runs"  # a new run under the file's
    assert _run_root(base, conf, tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv("CLAWRL__STORAGE__DATA_ROOT", str(tmp_path / "X"))
    base = load_settings(conf)
    # the environment wins over every config file, the run's own too: the run's data root is X itself
    assert _run_root(base, conf, None) == tmp_path / "X"
    assert _run_root(base, conf, tmp_path / "X") == tmp_path / "X"
    with pytest.raises(typer.BadParameter, match="CLAWRL__STORAGE__DATA_ROOT = .* sets the data root of every command"):
        _run_root(base, conf, tmp_path / "elsewhere")


def test_reading_commands_take_the_runs_own_config_from_the_data_root(tmp_path):
    """A demo writes its settings to <data_root>/config.toml. With the data root named only in the
    environment, status and doctor read them (the run's judge config, its model) and say so; without
    them, the turns judged under another judge config are said to be, not counted as never judged."""
    root = tmp_path / "run"
    root.mkdir()
    run = load_settings(env={}, overrides={"storage.data_root": str(root), "model.name": "tiny",
                                           "prm.backend": "rule", "ppo.advantage_estimator": "grpo"})
    (root / "config.toml").write_text(dump_toml(run))
    chash = build_judge_config_hash(run)
    turns = [build_turn([{"role": "user", "content": "hi"}], session_id=f"s{i}") for i in range(3)]
    with DataStore(root, background=False) as store:
        store.append([*turns, *(FateRecord(t.turn_id, t.session_id, chash, "no_next_state") for t in turns)])
        store.flush()
    env, cli = {"CLAWRL__STORAGE__DATA_ROOT": str(root)}, CliRunner()
    res = cli.invoke(app, ["status"], env=env)
    assert res.exit_code == 0, res.output
    assert [line.rstrip() for line in res.stdout.splitlines()[:2]] == [
        f"data root {root} (from env CLAWRL__STORAGE__DATA_ROOT; settings from its config.toml)",
        f"clawrl status (judge config {chash})"]
    assert "judge config mismatch" not in res.stderr
    doctor = json.loads(cli.invoke(app, ["doctor", "--json"], env=env).stdout)
    assert doctor["judge_config_hash"] == chash
    assert doctor["findings"][1] == {"name": "judge_config", "ok": True, "summary": f"3 turns judged under this "
                                     f"judge config {chash}", "cause": "", "fix": "", "sql": ""}
    assert "initial weights of tiny" in cli.invoke(app, ["lineage", "0"], env=env).stdout
    (root / "config.toml").rename(root / "elsewhere.toml")  # read with the defaults: another judge config
    default = build_judge_config_hash(load_settings(env=env))
    res = cli.invoke(app, ["status"], env=env)
    assert res.exit_code == 0 and res.stdout.splitlines()[0] == f"data root {root} (from env " \
                                                                 "CLAWRL__STORAGE__DATA_ROOT)", res.output
    assert res.stderr.splitlines() == [
        f"judge config mismatch: 0 turns judged under this judge config {default}; under others: {chash} (3 turns); "
        "read with the config the run used (-c FILE; a demo's is <data_root>/config.toml), or judge the turns "
        "again under this one (`clawrl judge`)"]
    res = cli.invoke(app, ["doctor"], env=env)
    assert f"FAIL judge_config: 0 turns judged under this judge config {default}; under others: {chash} (3 turns)" \
        in res.stdout.splitlines()
    res = cli.invoke(app, ["status", "-c", str(root / "elsewhere.toml")], env=env)
    assert f"clawrl status (judge config {chash})" in res.stdout and not res.stderr


def test_lineage_says_what_the_gate_made_of_the_version(tmp_path):
    """`clawrl lineage latest` on a refused candidate says it was refused and is not served."""
    from datetime import datetime, timedelta, timezone

    from clawrl.records import BatchRecord, PromotionRecord

    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)

    def decided(i: int, action: str, version: str, champion: str, reason: str) -> PromotionRecord:
        return PromotionRecord(f"p{i}", action, version, champion, "gate", reason, "k", 4, None, None, None, None,
                               None, None, 0.05, 0.05, None, created_at=t0 + timedelta(seconds=i))

    with DataStore(tmp_path, background=False) as store:
        store.append([*(BatchRecord(f"b{v}", v, [], [], "grpo", "c", str(v - 1)) for v in (1, 2, 3)),
                      *(CheckpointRecord(str(v), v, f"b{v}", str(v - 1), f"/c/v00000{v}", "ab", None)
                        for v in (1, 2, 3)),
                      decided(1, "promote", "1", "0", "not worse beyond the tolerance 0.05: candidate 0.5 ..."),
                      decided(2, "promote", "2", "1", "not worse beyond the tolerance 0.05: candidate 0.6 ..."),
                      decided(3, "refuse", "3", "2", "worse by more than the tolerance 0.05: candidate 0.4 ...")])
        store.flush()
    env, cli = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path), "CLAWRL__MODEL__NAME": "tiny", "COLUMNS": "300"}, \
        CliRunner()

    def head(version: str) -> str:
        res = cli.invoke(app, ["lineage", version], env=env)
        assert res.exit_code == 0, res.output
        return res.stdout.splitlines()[1]

    assert head("latest") == ("weight_version 3 (from version 0 = tiny): refused by the gate (worse by more than the "
                              "tolerance 0.05), not served; the champion is version 2")
    assert head("2") == "weight_version 2 (from version 0 = tiny): the champion (promoted by the gate)"
    assert head("1") == "weight_version 1 (from version 0 = tiny): served as champion before; the champion is version 2"
    with DataStore(tmp_path, background=False) as store:
        store.append([PromotionRecord("p4", "rollback", "1", "2", "manual", "clawrl rollback", None, None, None, None,
                                      None, None, None, None, None, None, None, created_at=t0 + timedelta(seconds=4))])
        store.flush()
    assert head("1") == "weight_version 1 (from version 0 = tiny): the champion (rolled back to by hand)"
    assert head("2") == "weight_version 2 (from version 0 = tiny): rolled back from, not served; the champion is version 1"


@pytest.mark.parametrize("args", [["sync", "3"], ["mix", "3", "--alpha", "0.5", "--out", "m"], ["replay", "3"],
                                  ["replay", "3", "--format", "json"], ["promote", "3", "--engine-url", "http://x"]],
                         ids=lambda a: " ".join(a[:3:2]))
def test_commands_that_act_on_the_data_name_it_first_also_when_they_refuse(tmp_path, args):
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path)}
    res = CliRunner().invoke(app, args, env=env)
    assert res.exit_code == 2, res.output  # no checkpoint 3 here
    shown = res.stderr if "json" in args else res.stdout  # json: stdout is the report alone
    assert shown.splitlines()[0] == f"data root {tmp_path} (from env CLAWRL__STORAGE__DATA_ROOT)"
