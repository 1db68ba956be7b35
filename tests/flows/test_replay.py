"""Replay: a short loop re-trained from its logged samples gives byte-identical checkpoints; excluding
a session removes its samples from every replayed batch and says so in the lineage. A session is a
(namespace, session id) pair: excluding one API key's session leaves another key's session of the
same id in the replay, and the replay's lineage never names the excluded one."""

import dataclasses
import json
import random

import pytest
from typer.testing import CliRunner

from clawrl.config import dump_toml
from clawrl.ids import namespace_for_key
from clawrl.lineage import REPLAY_MODEL, client
from clawrl.records import SampleRecord
from clawrl.replay import parse_exclusion
from clawrl.storage.catalog import open_catalog, run_query
from clawrl.storage.queries import lineage_chain, session_namespaces, trainable_samples
from clawrl.storage.schemas import TABLES
from clawrl.storage.writer import DataStore
from tests.utils.turns import build_turn

ALPHA, BETA = namespace_for_key("alpha-key"), namespace_for_key("beta-key")  # two API keys' namespaces


def _samples(s, n, rng, sessions=None):
    """``n`` samples, the i-th of session ``sessions[i]`` ((namespace, session id); default
    ``session-{i % 3}`` with no namespace recorded)."""
    from clawrl.judge.runner import build_judge_config_hash

    chash = build_judge_config_hash(s)
    out = []
    for i in range(n):
        namespace, session_id = sessions[i] if sessions else (None, f"session-{i % 3}")
        out_ids = [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 8))] + [2]
        has_teacher = i % 3 == 0
        out.append(SampleRecord(
            sample_id=f"s{i:03d}-{rng.random():.6f}", turn_id=f"t{i}", session_id=session_id,
            judge_config_hash=chash, method="combine", prompt_ids=[1] + [rng.randrange(3, 40000) for _ in range(5)],
            output_ids=out_ids, rollout_logprobs=[-rng.uniform(6, 11) for _ in out_ids], reward=rng.choice([-1.0, 1.0]),
            has_teacher=has_teacher, teacher_logprobs=[-rng.uniform(6, 11) for _ in out_ids] if has_teacher else None,
            weight_version="0", namespace=namespace))
    return out


def _train(prefect_harness, make_settings, tmp_path, sessions=None):
    """Three PPO steps of 3 samples each (kl on, combine, a decaying lr), trained through the train flow."""
    from clawrl.flows.train import train_flow

    s = make_settings({"ppo.rollout_batch_size": 3, "ppo.lr": 1e-3, "ppo.kl_coef": 0.05, "ppo.micro_batch_size": 2,
                       "ppo.max_staleness": 10, "ppo.lr_decay_steps": 3,
                       "ppo.lr_min": 1e-4})
    conf = tmp_path / "loop.toml"
    conf.write_text(dump_toml(s))
    rng = random.Random(3)
    with DataStore(s.storage.data_root) as store:
        store.append(_samples(s, 9, rng, sessions))
    out = train_flow(config_path=str(conf), max_steps=5)
    assert [st["weight_version"] for st in out["steps"]] == ["1", "2", "3"]
    return s, conf


@pytest.fixture
def trained_loop(prefect_harness, make_settings, tmp_path):
    return _train(prefect_harness, make_settings, tmp_path)


# batch k trains samples 3k..3k+2: "shared" is a session id of both keys, in every batch
SHARED_ID_SESSIONS = [(ALPHA, "shared"), (BETA, "shared"), (ALPHA, "other"),
                      (BETA, "shared"), (ALPHA, "shared"), (BETA, "ops:7"),
                      (ALPHA, "shared"), (ALPHA, "other"), (BETA, "shared")]


@pytest.fixture
def shared_id_loop(prefect_harness, make_settings, tmp_path):
    """The loop of ``trained_loop`` on samples of two API keys, both using the session id "shared"."""
    return _train(prefect_harness, make_settings, tmp_path, SHARED_ID_SESSIONS)


def test_replay_reproduces_checkpoint_bytes(trained_loop):
    from clawrl.flows.replay import replay_flow

    s, conf = trained_loop
    report = replay_flow(config_path=str(conf), version="3")
    assert report["exact"] and report["identical"] is True
    originals = [r["sha256"] for r in run_query(s.storage.data_root, "select sha256 from checkpoints order by step").to_pylist()]
    assert [st["replay_sha256"] for st in report["steps"]] == originals
    from clawrl.checkpoint import read_step_result

    lrs = [read_step_result(s.storage.data_root / "checkpoints" / f"v{v:06d}").metrics["lr"] for v in (1, 2, 3)]
    # cosine from 1e-3 to 1e-4 over 3 steps: 1e-4 + 9e-4 (1 + cos(pi k / 3)) / 2 = 1e-3, 7.75e-4, 3.25e-4
    assert lrs == pytest.approx([1e-3, 7.75e-4, 3.25e-4])  # the schedule the replay re-ran
    replay_run = client(s.storage.data_root).get_run(report["mlflow_run_id"])
    assert replay_run.data.tags["kind"] == "exact" and replay_run.data.tags["identical"] == "True"
    assert replay_run.data.tags["replay_of_run"] == report["steps"][-1]["original_run_id"]


def test_replay_command_prints_each_step_and_the_verdict(trained_loop):
    """What a user reads from `clawrl replay 3` on an 80-column terminal: a row per step with its batch, the
    original digest and "same" where the replay reproduced it, then the verdict."""
    s, conf = trained_loop
    res = _cli("replay", "3", "--config", conf)
    assert res.exit_code == 0, res.output
    originals = [r["sha256"] for r in run_query(s.storage.data_root, "select sha256 from checkpoints "
                                                                     "order by step").to_pylist()]
    rows = [line.split() for line in res.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert len(rows) == 3 and "…" not in res.stdout  # nothing cut to an ellipsis
    batches = [r["batch_id"] for r in run_query(s.storage.data_root, "select batch_id from checkpoints "
                                                                     "order by step").to_pylist()]
    for row, digest, batch in zip(rows, originals, batches):
        assert row[1] == batch[:8] and row[3:] == ["3", digest[:10], "same"]
    assert "checkpoints byte-identical: yes" in res.stdout
    [replay_dir] = list((s.storage.data_root / "replays").iterdir())
    assert f"its lineage: clawrl lineage 3 --replay {replay_dir.name}" in res.stdout


def test_a_bad_replay_request_is_told_before_any_work(trained_loop, monkeypatch):
    """A version never trained, a word, an unknown --set key: one line naming the value, exit 2, and neither
    a Prefect flow started nor a replay directory written."""
    import clawrl.flows.replay as flow_module

    s, conf = trained_loop
    monkeypatch.setattr(flow_module, "replay_flow", lambda **kw: pytest.fail("the flow started"))
    for args, message in (
            (["7"], "replay failed: cannot replay to version 7: the recorded steps up to it are 1..3 (the newest "
                    "version is 3)"),
            (["three"], "replay failed: version 'three': expected a weight version (1, 2, ...), 'latest' or an "
                        "MLflow run id"),
            (["2", "--set", "ppo.nosuch=1"], "unknown key [ppo] nosuch"),
            (["2", "--set", "ppo.lr"], "replay failed: --set 'ppo.lr': expected SECTION.KEY=VALUE")):
        res = _cli("replay", *args, "--config", conf)
        assert res.exit_code == 2 and message in " ".join(res.output.split()), (args, res.output)
        assert "Traceback" not in res.output
    assert not (s.storage.data_root / "replays").exists()


def test_replaying_a_run_without_steps_says_so(make_settings):
    from clawrl.replay import check_replay

    s = make_settings({})
    with pytest.raises(ValueError, match="nothing to replay: no training step is recorded in"):
        check_replay(s, "latest")
    with pytest.raises(ValueError, match=r"version 1: the recorded steps up to it are none \(no version trained"):
        check_replay(s, "1")


def test_replay_table_shows_piecewise_digests_by_their_hex_and_differences_where_measured():
    """Checkpoints over 64 MiB record "sha256-tree:<hex>": the table shows the hex, not the prefix."""
    from rich.console import Console

    from clawrl.cli.training import _replay_table

    tree = "sha256-tree:" + "ab" * 32
    steps = [{"step": 1, "batch_id": "b" * 16, "replay_batch_id": "r" * 16, "samples": 4, "excluded_samples": 1,
              "original_sha256": tree, "replay_sha256": tree, "identical": True},
             {"step": 2, "batch_id": "c" * 16, "replay_batch_id": "s" * 16, "samples": 3, "excluded_samples": 0,
              "original_sha256": tree, "replay_sha256": "sha256-tree:" + "cd" * 32, "identical": False,
              "max_abs_diff": 0.00125}]
    console = Console(width=80, record=True)
    console.print(_replay_table({"replay_id": "r1", "source_version": "2", "steps": steps,
                                 "excluded_sessions": [["open", "s"]]}))
    rows = [line.split() for line in console.export_text().splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert rows == [["1", "bbbbbbbb", "rrrrrrrr", "4", "ababababab", "same", "1", "-"],
                    ["2", "cccccccc", "ssssssss", "3", "ababababab", "cdcdcdcdcd", "0", "0.00125"]]


def test_unlearning_replay_excludes_the_session_everywhere(trained_loop):
    s, conf = trained_loop
    res = CliRunner().invoke(__import__("clawrl.cli", fromlist=["app"]).app,
                             ["replay", "3", "--config", str(conf), "--exclude-session", "session-1",
                              "--reason", "user asked to be forgotten", "--format", "json"])
    assert res.exit_code == 0, res.output
    [replay_dir] = list((s.storage.data_root / "replays").iterdir())
    report = json.loads((replay_dir / "replay.json").read_text())
    printed = json.loads(res.stdout)  # --format json: stdout is the report alone (logs go to stderr)
    assert printed["replay_id"] == report["replay_id"] and printed["steps"] == report["steps"]
    assert report["excluded_sessions"] == [["open", "session-1"]] and report["identical"] is None
    assert sum(st["excluded_samples"] for st in report["steps"]) == 3  # every sample of session-1, no other
    # no replayed batch saw the session: every trained sample's session is recorded in the checkpoints' markers
    trained_on = []
    for st in report["steps"]:
        assert st["samples"] + st["excluded_samples"] == 3
    for marker in sorted((replay_dir / "checkpoints").glob("v*/trainer.json")):
        trained_on.append(json.loads(marker.read_text())["batch_id"])
    assert len(trained_on) == len([st for st in report["steps"] if st["samples"]])
    c = client(s.storage.data_root)
    [mv] = c.search_model_versions(f"name = '{REPLAY_MODEL}'")
    assert mv.tags["excluded_sessions"] == "open:session-1"
    assert mv.tags["exclusion_reason"] == "user asked to be forgotten"
    assert mv.tags["kind"] == "unlearning"
    # the replayed weights differ from the original's (they never saw session-1)
    original_final = run_query(s.storage.data_root, "select sha256 from checkpoints where step = 3").to_pylist()[0]["sha256"]
    assert report["steps"][-1]["replay_sha256"] != original_final


def test_counterfactual_replay_with_another_learning_rate(trained_loop):
    from clawrl.flows.replay import replay_flow

    s, conf = trained_loop
    [v2] = run_query(s.storage.data_root, "select mlflow_run_id from checkpoints where step = 2").to_pylist()
    report = replay_flow(config_path=str(conf), version=v2["mlflow_run_id"], set_overrides=["ppo.lr=5e-4"])
    assert report["source_version"] == "2"  # the version the MLflow run trained
    assert report["overrides"] == {"ppo.lr": 5e-4} and report["identical"] is None
    assert len(report["steps"]) == 2 and all(st["replay_sha256"] for st in report["steps"])
    run = client(s.storage.data_root).get_run(report["mlflow_run_id"])
    assert run.data.params["set.ppo.lr"] == "0.0005" and run.data.tags["kind"] == "counterfactual"


def test_counterfactual_that_breaks_the_config_is_refused_by_name(trained_loop):
    from clawrl.config import ConfigError
    from clawrl.flows.replay import replay_flow

    _, conf = trained_loop
    with pytest.raises(ConfigError, match="lr_min"):  # lr below the schedule's floor
        replay_flow(config_path=str(conf), version="2", set_overrides=["ppo.lr=1e-5"])
    with pytest.raises(ValueError, match="no checkpoint was trained by MLflow run 'f{32}'"):
        replay_flow(config_path=str(conf), version="f" * 32)


def _cli(*args):
    from clawrl.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_an_exclusion_names_one_namespace_and_session():
    holders = {"shared": [ALPHA, BETA], "x:y": [ALPHA], "y": [BETA]}
    assert parse_exclusion(f"{ALPHA}:shared", holders) == (ALPHA, "shared")
    assert parse_exclusion(f"{BETA}:shared", holders) == (BETA, "shared")
    assert parse_exclusion("x:y", holders) == (ALPHA, "x:y")  # "x" holds no "y": a bare id with a ':'
    assert parse_exclusion(f"{ALPHA}:x:y", holders) == (ALPHA, "x:y")  # split at the first ':' only
    assert parse_exclusion("y", holders) == (BETA, "y")  # one namespace uses it: unambiguous
    with pytest.raises(ValueError, match=f"used in 2 namespaces \\({ALPHA}, {BETA}\\).*NAMESPACE:SESSION_ID, "
                                         f"e.g. --exclude-session {ALPHA}:shared"):
        parse_exclusion("shared", holders)
    with pytest.raises(ValueError, match=f"namespace '{ALPHA}' has no session 'y'; it is in {BETA}"):
        parse_exclusion(f"{ALPHA}:y", holders)
    with pytest.raises(ValueError, match="no session 'nope' in any namespace"):
        parse_exclusion("nope", holders)


def test_samples_without_a_namespace_take_their_turns(tmp_path):
    """Samples written before samples recorded a namespace (files without the column, or NULL in it)
    belong to their turn's namespace, and to "open" when they have no turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    turn = dataclasses.replace(build_turn([{"role": "user", "content": "hi"}], session_id="shared"),
                               turn_id="turn-beta", namespace=BETA)
    sample = dict(judge_config_hash="h", method="grpo", prompt_ids=[1], output_ids=[2], rollout_logprobs=[-0.5],
                  reward=1.0, has_teacher=False, teacher_logprobs=None, weight_version="0")
    old = [SampleRecord("old-beta", "turn-beta", "shared", **sample), SampleRecord("old-none", "t-x", "solo", **sample)]
    with DataStore(data, background=False) as store:
        store.append(turn)
        store.flush()
    old_schema = TABLES["samples"].schema.remove(TABLES["samples"].schema.get_field_index("namespace"))
    rows = [{k: v for k, v in dataclasses.asdict(r).items() if k in old_schema.names} for r in old]
    (data / "tables" / "samples" / "date=2024-01-01").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=old_schema),
                   data / "tables" / "samples" / "date=2024-01-01" / "part-old.parquet")

    def namespaces():
        with open_catalog(data, private=True) as con:
            by_sample = {r["sample_id"]: r["namespace"] for r in trainable_samples(con, "h").to_pylist()}
            return by_sample, session_namespaces(con, ["shared", "solo", "missing"])

    assert namespaces() == ({"old-beta": BETA, "old-none": "open"}, {"shared": [BETA], "solo": ["open"]})
    with DataStore(data, background=False) as store:  # a newer file: the column exists, NULL in the old rows
        store.append([SampleRecord("new-alpha", "t-a", "shared", **sample, namespace=ALPHA),
                      SampleRecord("new-null", "turn-beta", "shared", **sample)])
        store.flush()
    assert namespaces() == ({"old-beta": BETA, "old-none": "open", "new-alpha": ALPHA, "new-null": BETA},
                            {"shared": [ALPHA, BETA], "solo": ["open"]})


def test_unlearning_one_key_session_keeps_the_other_key_session_of_that_id(shared_id_loop):
    s, conf = shared_id_loop
    data = s.storage.data_root
    originals = run_query(data, "select batch_id, session_ids, session_namespaces from batches order by step").to_pylist()
    assert [sorted(zip(b["session_namespaces"], b["session_ids"])) for b in originals] == [
        sorted(set(SHARED_ID_SESSIONS[3 * k:3 * k + 3])) for k in range(3)]  # the train flow records the pairs

    ambiguous = _cli("replay", "3", "--config", conf, "--exclude-session", "shared")
    assert ambiguous.exit_code == 2 and not (data / "replays").exists()
    assert f"session id 'shared' is used in 2 namespaces ({ALPHA}, {BETA})" in ambiguous.output
    assert f"--exclude-session {ALPHA}:shared" in ambiguous.output

    res = _cli("replay", "3", "--config", conf, "--exclude-session", f"{ALPHA}:shared", "--format", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["excluded_sessions"] == [[ALPHA, "shared"]] and report["final_version"] == "3"
    assert [st["excluded_samples"] for st in report["steps"]] == [1, 1, 1]  # samples 0, 4 and 6
    assert [st["samples"] for st in report["steps"]] == [2, 2, 2]  # beta's "shared" samples stay
    replay_ids = [st["replay_batch_id"] for st in report["steps"]]
    assert len(set(replay_ids)) == 3 and not set(replay_ids) & {b["batch_id"] for b in originals}
    root = data / "replays" / report["replay_id"]
    kept = [set(SHARED_ID_SESSIONS[3 * k:3 * k + 3]) - {(ALPHA, "shared")} for k in range(3)]
    for k in range(3):  # each checkpoint names the replay's batch and only the sessions that trained it
        marker = json.loads((root / "checkpoints" / f"v{k + 1:06d}" / "trainer.json").read_text())
        assert marker["batch_id"] == replay_ids[k]
        assert marker["sessions"] == sorted(map(list, kept[k]))
    batches = run_query(root, "select * from batches order by step").to_pylist()
    assert [b["batch_id"] for b in batches] == replay_ids
    assert [b["source_batch_id"] for b in batches] == [b["batch_id"] for b in originals]
    assert [set(zip(b["session_namespaces"], b["session_ids"])) for b in batches] == kept
    [counts] = run_query(root, f"""select count(*) as n, count(*) filter (where session_id = 'shared') as shared,
                                   count(*) filter (where namespace = '{ALPHA}' and session_id = 'shared') as excluded
                                   from samples""").to_pylist()
    assert counts == {"n": 6, "shared": 3, "excluded": 0}

    with open_catalog(root, private=True) as con:
        chain = lineage_chain(con, "3")
    assert [c["batch_id"] for c in chain] == replay_ids[::-1]
    assert {tuple(p) for c in chain for p in c["sessions"]} == set.union(*kept)
    assert not {"t0", "t4", "t6"} & {t for c in chain for t in c["turn_ids"]}  # the excluded turns
    shown = _cli("lineage", "3", "--config", conf, "--replay", report["replay_id"])
    assert shown.exit_code == 0, shown.output
    assert f"{ALPHA}:shared" not in shown.output and shown.output.count(f"session {BETA}:shared") == 3
    assert shown.output.count(f"session {ALPHA}:other") == 2 and f"session {BETA}:ops:7" in shown.output
    original = _cli("lineage", "3", "--config", conf)  # the training run's own lineage still names it
    assert original.exit_code == 0 and original.output.count(f"session {ALPHA}:shared") == 3
    missing = _cli("lineage", "3", "--config", conf, "--replay", "../..")
    assert missing.exit_code == 2 and "no replay '../..'" in missing.output
