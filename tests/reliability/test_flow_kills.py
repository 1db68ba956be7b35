"""SIGKILL the judge flow and the train flow at every step boundary, restart them, and compare with
an uninterrupted run over the same turns: every turn judged exactly once, every sample consumed
exactly once, and byte-identical checkpoints (sha256 of model.safetensors).

Each kill is a real process killed by SIGKILL: a child forked from a pre-imported parent
(tests/utils/fork_runner.py) swaps the flow's ``_crash_point`` seam (or, mid-checkpoint, the
writing of the staged checkpoint's marker) for ``os.kill(os.getpid(), SIGKILL)`` at one point. The
next child, or the final in-process run, is the restart. Kills are chained on one data root, each
child getting one step further, so one judge pass and four PPO steps cover every point while the
uninterrupted reference run is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from clawrl.config import dump_toml, load_settings
from clawrl.lineage import EXPERIMENT, REGISTERED_MODEL, client, experiment_id
from clawrl.checkpoint import KEEP_FILE, file_sha256
from clawrl.storage.catalog import open_catalog, run_query
from clawrl.storage.queries import trainable_samples
from clawrl.storage.writer import DataStore
from tests.utils.fork_runner import shared_fork_runner
from tests.utils.turns import T0, build_next_state, build_turn, generate_turn
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability]

JUDGE_POINTS = ["found", "verdict_written", "fate_written", "judged", "counted", "emitted"]
TRAIN_POINTS = ["claimed", "trained", "logged", "recorded", "gated", "synced", "mid_checkpoint"]

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "How many legs has a spider?",
             "What is 2 + 2?", "Spell 'cat' backwards.", "Which planet is red?", "Say hello in Spanish.",
             "What is ice made of?"]
PRAISE, CORRECTION = "thanks, that's great!", "no, that's wrong, answer in one word"

JUDGE_CHILD = """
    import os, signal
    import clawrl.flows.judge as fj
    fj._crash_point = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == {point!r} else None
    fj.judge_flow(config_path={conf!r})
"""

TRAIN_CHILD = """
    import os, signal
    import clawrl.checkpoint as ck
    import clawrl.flows.train as ft
    from prefect.client.orchestration import get_client

    def kill(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if {point!r} == "mid_checkpoint":  # weights, optimizer and hash are in the staging dir, trainer.json is not
        ck.asdict = kill
    else:
        ft._crash_point = lambda name: kill() if name == {point!r} else None
    with get_client(sync_client=True) as c:  # the killed run's `trainer` slot: as if its lease expired
        try:
            c.delete_global_concurrency_limit_by_name("trainer")
        except Exception:
            pass
    ft.train_flow(config_path={conf!r}, max_steps=10)
"""


def _settings(root: Path, model_cache: Path):
    s = load_settings(env={}, overrides={
        "storage.data_root": str(root), "storage.model_cache": str(model_cache), "model.name": "tiny",
        "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo", "ppo.lr": 1e-3, "ppo.micro_batch_size": 2,
        "prm.backend": "rule"})
    conf = root / "clawrl.toml"
    conf.write_text(dump_toml(s))
    return s, conf


def _write_turns(root: Path, engine) -> int:
    """8 turns the rule judge scores +-1 (4 batches of 2), one it scores 0, one closed without a
    next state, one side turn: 11 turns, each with its own time so 'oldest first' is well defined."""
    records = []
    for i, question in enumerate(QUESTIONS + ["What's the weather?", "Tell me a joke."]):
        turn = generate_turn(engine, [{"role": "user", "content": question}], session_id=f"s{i}", seed=i,
                             max_new_tokens=6)
        turn = replace(turn, created_at=T0 + timedelta(seconds=i), completed_at=T0 + timedelta(seconds=i))
        reply = {8: "what about tomorrow?", 9: None}.get(i, PRAISE if i % 2 else CORRECTION)
        records += [turn, build_next_state(turn, None if reply is None else [{"role": "user", "content": reply}])]
    side = build_turn([{"role": "user", "content": "ping"}], session_id="hb", turn_type="side")
    records.append(replace(side, created_at=T0 + timedelta(seconds=20), completed_at=T0 + timedelta(seconds=20)))
    with DataStore(root) as store:
        store.append(records)
    return 11


def _recover(root: Path) -> None:
    """Convert what killed writers left in the write-ahead log (what any restarted writer does)."""
    DataStore(root, background=False).close()


def _q(root: Path, sql: str) -> list[dict]:
    return run_query(root, sql).to_pylist()


def _reset_trainer_limit() -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            c.delete_global_concurrency_limit_by_name("trainer")
        except Exception:
            pass


def _ck_state(root: Path) -> dict:
    """Checkpoint rows, sha256 of the weights files still on disk, and the MLflow side, per version."""
    rows = _q(root, "SELECT weight_version, step, batch_id, sha256 FROM checkpoints ORDER BY step")
    ckdir = root / "checkpoints"
    dirs = sorted(d for d in ckdir.iterdir() if d.name != KEEP_FILE) if ckdir.is_dir() else []  # the gate's list
    files = {d.name: file_sha256(d / "model.safetensors") for d in dirs if (d / "model.safetensors").is_file()}
    c = client(root)
    runs = [r for r in c.search_runs([experiment_id(c, root, EXPERIMENT)]) if r.data.tags.get("kind") != "policy"]
    return {"rows": rows, "files": files, "dirs": [d.name for d in dirs],
            "run_batches": sorted(r.data.tags["batch_id"] for r in runs),
            "model_versions": len(c.search_model_versions(f"name = '{REGISTERED_MODEL}'")),  # trained versions
            "batches": _q(root, "SELECT step, sample_ids FROM batches ORDER BY step")}


@pytest.fixture(scope="module")
def flows_env(prefect_harness, tmp_path_factory, tiny_engine, model_cache):
    """The turns (one template data root), the zygote, and the uninterrupted reference run."""
    from prefect.settings import PREFECT_API_URL

    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    base = tmp_path_factory.mktemp("flow-kills")
    # the zygote imports in the background while the reference runs here
    runner = shared_fork_runner({**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}, base / "logs")
    template = base / "template"
    n_turns = _write_turns(template, tiny_engine)
    ref = base / "reference"
    shutil.copytree(template, ref)
    s, conf = _settings(ref, model_cache)
    t0 = time.monotonic()
    judged = judge_flow(config_path=str(conf))
    trained = train_flow(config_path=str(conf), max_steps=10)
    reference = {"judged": judged, "steps": trained["steps"], "seconds": time.monotonic() - t0,
                 "fates": _q(ref, "SELECT turn_id, fate FROM turn_fate ORDER BY turn_id"),
                 "verdicts": _q(ref, "SELECT turn_id, score, hint FROM verdicts ORDER BY turn_id"),
                 "samples": _q(ref, "SELECT sample_id, turn_id, reward FROM samples ORDER BY sample_id"),
                 "ck": _ck_state(ref)}
    assert [st["weight_version"] for st in trained["steps"]] == ["1", "2", "3", "4"]
    return {"base": base, "template": template, "runner": runner, "reference": reference, "turns": n_turns,
            "model_cache": model_cache}


@pytest.fixture(scope="module")
def judged_after_kills(flows_env):
    """A copy of the turns judged by a judge flow SIGKILLed at each of its steps in turn, then run
    to the end in this process; with what each kill left behind."""
    from clawrl.flows.judge import judge_flow

    root = flows_env["base"] / "judge-kills"
    shutil.copytree(flows_env["template"], root)
    s, conf = _settings(root, flows_env["model_cache"])
    left: dict[str, dict] = {}
    for point in JUDGE_POINTS:
        code, out = flows_env["runner"].run(JUDGE_CHILD.format(point=point, conf=str(conf)), f"judge-{point}")
        assert code == -9, f"judge flow not killed at {point!r} (exit {code}):\n{out[-3000:]}"
        _recover(root)
        with open_catalog(root) as con:
            attempts = con.sql("SELECT turn_id FROM verdict_attempts").fetchall()
            fated = {r[0] for r in con.sql("SELECT turn_id FROM turn_fate").fetchall()}
            uncommitted = {r[0] for r in attempts} - fated
            chash = flows_env["reference"]["judged"]["judge_config_hash"]
            usable = {r["turn_id"] for r in trainable_samples(con, chash).to_pylist()}
            sampled = {r[0] for r in con.sql("SELECT turn_id FROM samples").fetchall()}
        left[point] = {"fates": len(fated), "verdicts": len(attempts), "uncommitted": uncommitted,
                       "uncommitted_samples": uncommitted & sampled, "trainable_uncommitted": uncommitted & usable}
    final = judge_flow(config_path=str(conf))
    return {"root": root, "conf": conf, "left": left, "final": final}


@pytest.mark.timeout(HANG_S)
def test_judge_flow_killed_at_every_step_judges_each_turn_exactly_once(flows_env, judged_after_kills):
    root, left, ref = judged_after_kills["root"], judged_after_kills["left"], flows_env["reference"]
    # each kill happened where it says: nothing before the first turn, an uncommitted verdict, ...
    assert left["found"]["verdicts"] == 0 and left["found"]["fates"] == 0
    assert left["verdict_written"]["uncommitted"], left["verdict_written"]  # a verdict whose fate was never written
    assert left["verdict_written"]["trainable_uncommitted"] == set()  # its sample is not trainable before the fate
    assert left["fate_written"]["fates"] > left["verdict_written"]["fates"]
    assert left["judged"]["fates"] == flows_env["turns"] and left["judged"]["uncommitted"] == set()
    assert judged_after_kills["final"]["judged"] == 0  # the restart finds nothing left to judge

    counts = _q(root, """SELECT (SELECT count(*) FROM turns) AS turns,
        (SELECT count(*) FROM turn_fate) AS fates, (SELECT count(DISTINCT turn_id) FROM turn_fate) AS fated,
        (SELECT count(*) FROM verdicts) AS verdicts, (SELECT count(DISTINCT turn_id) FROM verdicts) AS judged,
        (SELECT count(*) FROM verdict_attempts) AS attempts,
        (SELECT count(*) FROM samples) AS samples, (SELECT count(DISTINCT sample_id) FROM samples) AS sample_ids""")[0]
    assert counts["fates"] == counts["fated"] == counts["turns"] == flows_env["turns"]  # one fate per turn
    assert counts["verdicts"] == counts["judged"] == 9  # one verdict per judged main turn (8 +-1, 1 zero)
    assert counts["attempts"] >= counts["verdicts"] + len(left["verdict_written"]["uncommitted"])  # superseded kept
    assert counts["samples"] == counts["sample_ids"] == 8
    # the same decisions as the uninterrupted run
    assert _q(root, "SELECT turn_id, fate FROM turn_fate ORDER BY turn_id") == ref["fates"]
    assert _q(root, "SELECT turn_id, score, hint FROM verdicts ORDER BY turn_id") == ref["verdicts"]
    assert _q(root, "SELECT sample_id, turn_id, reward FROM samples ORDER BY sample_id") == ref["samples"]
    print(f"\njudge kills: {len(JUDGE_POINTS)} ({', '.join(JUDGE_POINTS)}); turns {counts['turns']}, fates "
          f"{counts['fates']}, verdicts {counts['verdicts']} (+{counts['attempts'] - counts['verdicts']} superseded "
          f"attempts kept), samples {counts['samples']}; duplicates 0, lost 0")


@pytest.mark.timeout(HANG_S)
def test_train_flow_killed_at_every_step_trains_the_uninterrupted_checkpoints(flows_env, judged_after_kills):
    from clawrl.flows.train import train_flow

    root = flows_env["base"] / "train-kills"
    shutil.copytree(judged_after_kills["root"], root)
    s, conf = _settings(root, flows_env["model_cache"])
    ckdir = root / "checkpoints"
    seen = {}
    for point in TRAIN_POINTS:
        code, out = flows_env["runner"].run(TRAIN_CHILD.format(point=point, conf=str(conf)), f"train-{point}")
        assert code == -9, f"train flow not killed at {point!r} (exit {code}):\n{out[-3000:]}"
        _recover(root)
        st = _ck_state(root)
        seen[point] = {"batches": len(st["batches"]), "rows": len(st["rows"]), "dirs": st["dirs"],
                       "runs": len(st["run_batches"])}
    # where each kill landed: batch 1 claimed -> trained -> logged -> recorded (once its checkpoint row exists,
    # a restart goes on to the next batch), batch 2 gated, batch 3 synced, batch 4 mid-save
    assert seen["claimed"] == {"batches": 1, "rows": 0, "dirs": [], "runs": 0}
    assert seen["trained"] == {"batches": 1, "rows": 0, "dirs": ["v000001"], "runs": 0}
    assert seen["logged"] == {"batches": 1, "rows": 0, "dirs": ["v000001"], "runs": 1}
    assert seen["recorded"] == {"batches": 1, "rows": 1, "dirs": ["v000001"], "runs": 1}
    assert seen["gated"] == {"batches": 2, "rows": 2, "dirs": ["v000001", "v000002"], "runs": 2}
    assert seen["synced"] == {"batches": 3, "rows": 3, "dirs": ["v000001", "v000002", "v000003"], "runs": 3}
    staged = [d for d in seen["mid_checkpoint"]["dirs"] if d.startswith(".v000004.")]
    assert seen["mid_checkpoint"]["batches"] == 4 and seen["mid_checkpoint"]["rows"] == 3 and len(staged) == 1
    assert (ckdir / staged[0] / "model.safetensors").is_file() and not (ckdir / "v000004").exists()

    _reset_trainer_limit()
    out = train_flow(config_path=str(conf), max_steps=10)  # the restart: resumes batch 4, the last
    assert [st["weight_version"] for st in out["steps"]] == ["4"]

    got, ref = _ck_state(root), flows_env["reference"]["ck"]
    used = [sid for b in got["batches"] for sid in b["sample_ids"]]
    assert len(used) == len(set(used)) == 8  # every sample consumed exactly once
    assert [b["sample_ids"] for b in got["batches"]] == [b["sample_ids"] for b in ref["batches"]]  # same batches
    assert [r["weight_version"] for r in got["rows"]] == ["1", "2", "3", "4"]
    assert got["dirs"] == ["v000001", "v000002", "v000003", "v000004"]  # the half-written v4 was cleaned up
    assert got["run_batches"] == sorted(r["batch_id"] for r in got["rows"]) and got["model_versions"] == 4
    # byte-identical weights, step by step, to the run that was never killed
    assert [r["sha256"] for r in got["rows"]] == [r["sha256"] for r in ref["rows"]]
    # weights on disk: the newest and the champions a rollback reaches (ROLLBACK_DEPTH 3 before the champion);
    # v1, killed after its row was recorded and before its gate, never became a champion here, so its weights
    # were pruned as an old version's are: the rest are the uninterrupted run's bytes
    assert set(ref["files"]) == {"v000001", "v000002", "v000003", "v000004"}
    assert got["files"] == {v: sha for v, sha in ref["files"].items() if v != "v000001"}
    for d, sha in got["files"].items():  # the files are the bytes the trainer recorded
        assert sha == next(r["sha256"] for r in got["rows"] if f"v{int(r['weight_version']):06d}" == d)
    marker = json.loads((ckdir / "v000004" / "trainer.json").read_text())
    print(f"\ntrain kills: {len(TRAIN_POINTS)} ({', '.join(TRAIN_POINTS)}); batches {len(got['batches'])}, "
          f"samples consumed {len(used)} (each once), checkpoints {len(got['rows'])}, MLflow runs "
          f"{len(got['run_batches'])}, versions identical to the uninterrupted run {len(got['rows'])}/4 "
          f"(v4 sha256 {marker['sha256'][:12]})")
