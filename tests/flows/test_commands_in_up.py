"""`clawrl judge` and `clawrl train` beside a running `clawrl up`: they submit a run of up's deployment,
which up's flow server executes (the models it holds, its settings), wait for it and say where to watch
it, then what it did, from the tables. Here up's flow server is clawrl's in-process runner serving the
deployments on the session's real Prefect server, as `clawrl up` serves them, and `up.pids.json` names
that server."""

from __future__ import annotations

import json
import re
import threading

import pytest
from typer.testing import CliRunner

from clawrl.config import dump_toml
from clawrl.storage.writer import DataStore
from tests.utils.samples import write_samples
from tests.utils.turns import build_next_state, build_turn
from tests.utils.waiting import join, wait_until


@pytest.fixture
def up_flows(prefect_harness, make_settings, tmp_path, monkeypatch):
    """(settings, config path, {deployment name: id}, Prefect UI URL) with up's judge and train deployments
    served in a thread."""
    from prefect.settings import PREFECT_API_URL

    from clawrl.flows.inprocess import InProcessRunner
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.serve import build_deployments
    from clawrl.flows.train import train_flow
    from tests.flows.test_inprocess_runs import _clear

    for name in ("PREFECT_API_URL", "PREFECT_HOME"):  # what the command sets is undone afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2})
    conf = tmp_path / "up-config.toml"
    conf.write_text(dump_toml(s))
    judge, train, _ = build_deployments(str(conf), None, None)
    runner = InProcessRunner([(judge, judge_flow), (train, train_flow)])
    ids = dict(zip(("judge", "train"), runner.register()))
    _clear(ids.values())
    s.storage.data_root.mkdir(parents=True, exist_ok=True)
    (s.storage.data_root / "up.pids.json").write_text(json.dumps({"supervisor": 1,
                                                                  "prefect_api_url": PREFECT_API_URL.value()}))
    stop = threading.Event()
    server = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    server.start()
    try:
        yield s, conf, ids, PREFECT_API_URL.value().removesuffix("/api")
    finally:
        stop.set()
        join(server)  # it sees the stop at its next poll (InProcessRunner's POLL_S)
        _clear(ids.values())


def _runs(deployment_id) -> list:
    from tests.flows.test_inprocess_runs import _runs_of

    return _runs_of(deployment_id)


def test_judge_and_train_beside_up_submit_runs_of_its_deployments(up_flows):
    from clawrl.cli import app
    from clawrl.storage.catalog import run_query

    s, conf, ids, ui = up_flows
    ready = [build_turn([{"role": "user", "content": f"q{i}"}], session_id=f"s{i}") for i in range(2)]
    waiting = build_turn([{"role": "user", "content": "q9"}], session_id="s9")
    with DataStore(s.storage.data_root, background=False) as store:
        store.append([*ready, waiting, *(build_next_state(t, [{"role": "user", "content": "thanks"}]) for t in ready)])
        store.flush()
    cli = CliRunner()
    res = cli.invoke(app, ["judge", "-c", str(conf)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    [run] = _runs(ids["judge"])  # a run of up's deployment, executed by up's flow server
    assert run.state.is_completed() and run.parameters["config_path"] == str(conf)
    lines = res.stdout.splitlines()
    assert lines[1] == (f"submitted a run of judge/on-interval to the `clawrl up` running on {s.storage.data_root}, "
                        f"with its settings ({conf}); watch it at {ui}/runs/flow-run/{run.id}")
    fates = run_query(s.storage.data_root, "select fate, count(*) as n from turn_fate group by 1 order by 1").to_pylist()
    assert lines[2] == "judged 2 turns: " + ", ".join(f"{r['n']} {r['fate']}" for r in fates)

    res = cli.invoke(app, ["judge", "-c", str(conf)], env={"COLUMNS": "300"})  # nothing ready now: why, in words
    assert res.exit_code == 0 and len(_runs(ids["judge"])) == 2, res.output
    assert res.stdout.splitlines()[2] == ("judged 0 turns: none is ready; 1 main turn waits for its next state (the "
                                          "next message of its session), 2 judged before")

    # the judge run left a full batch and started a train run, as in `clawrl up`; this one finds the next
    wait_until(lambda: all(r.state.is_final() for r in _runs(ids["train"])), "the train run the judge started", poll_s=1.0)
    write_samples(s, 2)  # a full batch
    res = cli.invoke(app, ["train", "-c", str(conf)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    [first, train] = sorted(_runs(ids["train"]), key=lambda r: r.created)
    assert (first.name, train.name) == ("train-v1", "train-v2") and train.state.is_completed()
    lines = res.stdout.splitlines()
    assert lines[1] == (f"submitted a run of train/on-samples-ready to the `clawrl up` running on "
                        f"{s.storage.data_root}, with its settings ({conf}); watch it at {ui}/runs/flow-run/{train.id}")
    [ckpt] = run_query(s.storage.data_root, "select path from checkpoints where step = 2").to_pylist()
    assert re.fullmatch(rf"step 2: weight_version 2, checkpoint {re.escape(ckpt['path'])}: (the champion \(promoted "
                        r"by the gate\)|refused by the gate \(.*\), not served; the champion is version [01])",
                        lines[2]), lines[2]
