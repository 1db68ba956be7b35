"""`clawrl demo --scenario users` end to end on the tiny model, as a user runs it: four users with their own keys
and personas, two rounds trained two ways (one shared policy, one adapter per user), and what it reports."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawrl.adapters import ADAPTER_CONFIG, ADAPTER_FILE, ADAPTERS_DIR
from clawrl.cli import app
from clawrl.lineage import client, experiment_id
from clawrl.sim.panel import DEFAULT_PANEL, user_namespace
from clawrl.storage.catalog import run_query
from tests.utils.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("shared", "per-user")


def tiny_users_config(directory: Path, model_cache: Path) -> Path:
    """conf/demo-users.toml on the tiny model, with a 4-question gate set."""
    text = (ROOT / "conf" / "demo-users.toml").read_text()
    assert 'name = "smollm2-135m"' in text and "\nsize = 8 " in text, "conf/demo-users.toml changed: update this"
    conf = directory / "users.toml"
    conf.write_text(text.replace('name = "smollm2-135m"', 'name = "tiny"').replace("\nsize = 8 ", "\nsize = 4 ")
                    + f'\n[storage]\ndata_root = "{directory}"\nmodel_cache = "{model_cache}"\n')
    return conf


def table_rows(stdout: str, n_users: int) -> list[list[str]]:
    """The cells of the per-round table: round, own turns, then a 'shared/per-user' pair per user."""
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in stdout.splitlines() if line.startswith("│")]
    return [c for c in cells if len(c) == 2 + n_users and c[0].isdigit()]


def logged(data_root: Path, arm: str) -> dict[str, dict[int, float]]:
    """The arm's MLflow run of the demo: metric -> {round: value}."""
    c = client(data_root)
    [run] = c.search_runs([experiment_id(c, data_root)], filter_string=f"tags.arm = '{arm}'")
    assert run.data.tags["scenario"] == "users"
    return {k: {m.step: m.value for m in c.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def test_the_users_demo_trains_one_shared_policy_and_one_adapter_per_user_on_the_same_turns(
        prefect_harness, tmp_path, model_cache):
    """Two rounds of 4 users asking 2 questions each: the shared arm trains one policy (batches of 8, no
    adapter anywhere), the per-user arm one PEFT adapter per user's namespace (batches of 2, two versions
    each); every turn of both arms is under one of the 4 users' namespaces; the table, the JSON and the MLflow
    runs name every user for both arms with the same numbers. The tiny model never answers on topic (score
    0), but its 8 tokens are always short enough for 'concise' and never a bullet list: the persona rates
    logged say so."""
    from prefect.settings import PREFECT_API_URL

    conf = tiny_users_config(tmp_path, model_cache)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "200"}
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "demo", "--scenario", "users", "-c", str(conf),
                      "--steps", "2", "--turns", "2", "--heldout", "3", "--eval-samples", "1", "--max-tokens", "8",
                      "--run-dir", str(run)], cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    panel = list(DEFAULT_PANEL)
    namespaces = {user_namespace(p) for p in panel}
    assert len(namespaces) == 4

    for arm in ARMS:
        assert (run / arm / "config.toml").is_file()
        turns = run_query(run / arm, "select namespace, count(*) as n from turns group by all").to_pylist()
        # per user: 2 rounds x 2 questions x (answer + closing reply) + 3 evaluations x 3 held-out questions
        assert sorted((t["namespace"], t["n"]) for t in turns) == sorted((ns, 2 * 2 * 2 + 3 * 3) for ns in namespaces)
    adapters = run / "per-user" / "checkpoints" / ADAPTERS_DIR
    assert {d.name for d in adapters.iterdir()} == namespaces
    for ns in namespaces:
        versions = sorted(d.name for d in (adapters / ns).iterdir() if d.is_dir())
        assert versions == ["v000001", "v000002"], versions
        for v in versions:
            assert (adapters / ns / v / ADAPTER_CONFIG).is_file() and (adapters / ns / v / ADAPTER_FILE).is_file()
    assert not (run / "shared" / "checkpoints" / ADAPTERS_DIR).exists()
    batches = run_query(run / "shared", "select step, len(session_ids) as n from batches order by step").to_pylist()
    assert batches == [{"step": 1, "n": 8}, {"step": 2, "n": 8}]  # one policy, everyone's round

    header = next(line for line in out.stdout.splitlines() if "own turns" in line)
    assert all(p in header for p in panel), header
    rows = table_rows(out.stdout, len(panel))
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("1", "2"), ("2", "4")], out.stdout
    report = json.loads((run / "reports" / "users.json").read_text())
    assert (run / "reports" / "users_learning_curve.png").stat().st_size > 10_000
    for i, arm in enumerate(ARMS):
        metrics = logged(run / arm, arm)
        for p in panel:
            shown = [float(r[2 + panel.index(p)].split("/")[i]) for r in rows]
            assert shown == [round(metrics[f"{p}_score"][k], 3) for k in range(3)], (arm, p, shown)
            assert shown == [round(r["scores"][p], 3) for r in report["rows"][arm]]
        assert metrics["concise_persona_rate"] == {0: 1.0, 1: 1.0, 2: 1.0}
        assert metrics["detailed_persona_rate"] == {0: 0.0, 1: 0.0, 2: 0.0}  # 8 tokens: never 30 words
        assert metrics["turns"] == {0: 0.0, 1: 2.0, 2: 4.0}
    assert set(report["summary"]) == set(panel) and "per-user_turns_to_shared_final" in report["summary"]["detailed"]


@pytest.mark.parametrize("personas,says", [
    ("concise,nosuch", "Invalid value for --personas: unknown persona 'nosuch'; valid: concise, signoff, lowercase, "
                       "bullets, french, detailed, paragraphs, plain"),
    ("concise,french,concise", "Invalid value for --personas: persona concise named twice: each user of the panel "
                               "has a persona of its own"),
])
def test_the_users_demo_refuses_a_bad_panel_before_it_starts(tmp_path, personas, says):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["demo", "--scenario", "users", "--personas", personas, "--run-dir", str(run)])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
    assert not run.exists()
