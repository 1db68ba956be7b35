"""Replay: a short loop re-trained from its logged samples gives byte-identical checkpoints; excluding
a session removes its samples from every replayed batch and says so in the lineage."""

import json
import random

import pytest
from typer.testing import CliRunner

from clawrl.config import dump_toml
from clawrl.lineage import REPLAY_MODEL, client
from clawrl.records import SampleRecord
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore


def _samples(s, n, rng):
    from clawrl.judge.runner import build_judge_config_hash

    chash = build_judge_config_hash(s)
    out = []
    for i in range(n):
        out_ids = [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 8))] + [2]
        has_teacher = i % 3 == 0
        out.append(SampleRecord(
            sample_id=f"s{i:03d}-{rng.random():.6f}", turn_id=f"t{i}", session_id=f"session-{i % 3}",
            judge_config_hash=chash, method="combine", prompt_ids=[1] + [rng.randrange(3, 40000) for _ in range(5)],
            output_ids=out_ids, rollout_logprobs=[-rng.uniform(6, 11) for _ in out_ids], reward=rng.choice([-1.0, 1.0]),
            has_teacher=has_teacher, teacher_logprobs=[-rng.uniform(6, 11) for _ in out_ids] if has_teacher else None,
            weight_version="0"))
    return out


@pytest.fixture
def trained_loop(prefect_harness, make_settings, tmp_path):
    """Three PPO steps of 3 samples each (kl on, combine, a linearly decaying lr), trained through
    the train flow."""
    from clawrl.flows.train import train_flow

    s = make_settings({"ppo.rollout_batch_size": 3, "ppo.lr": 1e-3, "ppo.kl_coef": 0.05, "ppo.micro_batch_size": 2,
                       "ppo.max_staleness": 10, "ppo.lr_schedule": "linear", "ppo.lr_decay_steps": 3,
                       "ppo.lr_min": 1e-4})
    conf = tmp_path / "loop.toml"
    conf.write_text(dump_toml(s))
    rng = random.Random(3)
    with DataStore(s.storage.data_root) as store:
        store.append(_samples(s, 9, rng))
    out = train_flow(config_path=str(conf), max_steps=5)
    assert [st["weight_version"] for st in out["steps"]] == ["1", "2", "3"]
    return s, conf


def test_replay_reproduces_checkpoint_bytes(trained_loop):
    from clawrl.flows.replay import replay_flow

    s, conf = trained_loop
    report = replay_flow(config_path=str(conf), version="3")
    assert report["exact"] and report["identical"] is True
    originals = [r["sha256"] for r in run_query(s.storage.data_root, "select sha256 from checkpoints order by step").to_pylist()]
    assert [st["replay_sha256"] for st in report["steps"]] == originals
    from clawrl.checkpoint import read_step_result

    lrs = [read_step_result(s.storage.data_root / "checkpoints" / f"v{v:06d}").metrics["lr"] for v in (1, 2, 3)]
    assert lrs == pytest.approx([1e-3, 7e-4, 4e-4])  # 1e-3 - 9e-4 * k/3: the schedule the replay re-ran
    replay_run = client(s.storage.data_root).get_run(report["mlflow_run_id"])
    assert replay_run.data.tags["kind"] == "exact" and replay_run.data.tags["identical"] == "True"
    assert replay_run.data.tags["replay_of_run"] == report["steps"][-1]["original_run_id"]


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
    assert report["excluded_sessions"] == ["session-1"] and report["identical"] is None
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
    assert mv.tags["excluded_sessions"] == "session-1" and mv.tags["exclusion_reason"] == "user asked to be forgotten"
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
