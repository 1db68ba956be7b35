"""A demo run brought up again: the demo keeps one data root and prints commands that work from anywhere,
`clawrl up` on other ports (its default ports taken) serves it with every link between the two UIs
leading to the right page, and the Prefect and MLflow UIs rendered in headless Chromium show the runs,
those links and the curves over weight versions.

A two-step `clawrl demo` on the tiny model, its data root set in the environment; `clawrl up -c
<run>/config.toml`, the command the demo prints, on ports of its own while this test holds the default
ones; Chromium renders each page (``--dump-dom`` after the page's scripts ran) and the test reads the
rendered text. The Chromium tests are skipped without one (Debian's package ``chromium``: `make ui-test`
installs it). With ``CLAWRL_UI_SCREENSHOTS=<dir>`` each page is also saved there as a PNG (docs/ui holds
the ones the README and docs/benchmarks.md show).
"""

from __future__ import annotations

import html
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from clawrl.config import PORT_OFFSETS
from clawrl.lineage import ui_page
from clawrl.ports import free_api_port, free_ports
from tests.utils.demo_config import tiny_demo_config
from tests.utils.up_process import stop
from tests.utils.waiting import run_to_end, wait_until

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
# the ports `clawrl up` opens by default: the Prefect UI, the MLflow UI, the trainer, the gateway, the judge,
# evaluation and canary engines
DEFAULT_PORTS = (4200, 5000, 30020, 30000, 30021, 30022, 30023)

pytestmark = pytest.mark.slow
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=(
    "no Chromium: `make ui-test` installs Debian's chromium and runs this test"))


def _render(url: str, name: str, budget_ms: int = 40_000, height: int = 1000) -> str:
    """The page's visible text once its scripts ran ``budget_ms`` of virtual time; a PNG of it too when asked.
    Charts render only inside the window: ``height`` makes room for all of a page's."""
    base = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size=1400,{height}",
            f"--virtual-time-budget={budget_ms}", "--run-all-compositor-stages-before-draw"]
    dom = run_to_end([*base, "--dump-dom", url]).stdout
    if shots := os.environ.get("CLAWRL_UI_SCREENSHOTS"):
        Path(shots).mkdir(parents=True, exist_ok=True)
        shot = run_to_end([*base, f"--screenshot={Path(shots) / (name + '.png')}", url])
        assert shot.returncode == 0, shot.stderr[-2000:]
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


def _hold_default_ports(stack: ExitStack) -> list[int]:
    """Listen on each default port that is free, as another program would: `clawrl up` must not need them."""
    held = []
    for port in DEFAULT_PORTS:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:  # taken already
            s.close()
            continue
        stack.callback(s.close)
        held.append(port)
    return held


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, model_cache):
    """`CLAWRL__STORAGE__DATA_ROOT=<run> clawrl demo -c <conf>` (two steps; the config names another data
    root, which the environment overrides): (run dir, the demo's finished process)."""
    tmp = tmp_path_factory.mktemp("ui")
    conf = tiny_demo_config(tmp, model_cache)
    run = tmp / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CLAWRL__STORAGE__DATA_ROOT": str(run), "COLUMNS": "100"}
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "demo", "-c", str(conf), "--steps", "2", "--users", "4",
                      "--heldout", "4", "--eval-samples", "1", "--max-tokens", "8"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run, out


@pytest.fixture(scope="module")
def demo_ui(demo_run, tmp_path_factory):
    """`clawrl up -c <run>/config.toml` (the command the demo prints) on its data, every port moved off its
    default while this test holds the defaults: (run dir, Prefect URL, MLflow URL). No further training
    while the pages are read: the batch size is set out of reach, so the versions the test names stay."""
    run, _ = demo_run
    api = free_api_port()  # its engines' ports (api + 10, 21, 22, 23) are free too
    pf, ml, tr = free_ports(3, avoid=[*DEFAULT_PORTS, api, *(api + o for o in PORT_OFFSETS.values())])
    prefect_url, mlflow_url = f"http://127.0.0.1:{pf}", f"http://127.0.0.1:{ml}"
    up_env = {**os.environ, "PYTHONPATH": str(REPO), "CLAWRL__SERVER__API_PORT": str(api),
              "CLAWRL__PPO__ROLLOUT_BATCH_SIZE": "1000000"}
    up_env.pop("CLAWRL__STORAGE__DATA_ROOT", None)  # the run's config names its data root
    log = tmp_path_factory.mktemp("up") / "up.log"
    with ExitStack() as stack:
        _hold_default_ports(stack)
        up = subprocess.Popen([sys.executable, "-m", "clawrl.cli", "up", "-c", str(run / "config.toml"),
                               "--prefect-port", str(pf), "--mlflow-port", str(ml), "--trainer-port", str(tr)],
                              cwd=REPO, env=up_env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: "all up" in log.read_text(), "clawrl up to say 'all up'", proc=up, log=log, poll_s=1.0)
            yield run, prefect_url, mlflow_url
        finally:
            stop(up)


def test_the_demo_keeps_one_data_root_and_prints_commands_that_work_from_anywhere(demo_run, tmp_path):
    run, out = demo_run
    stdout = out.stdout
    assert f"run data in {run}\n" in stdout and (run / "tables" / "turns").is_dir(), stdout[:2000]
    assert {Path(c) for c in re.findall(r" -c (\S+)", stdout)} == {run / "config.toml"}, stdout[-2000:]
    assert f"data root {run} (from env CLAWRL__STORAGE__DATA_ROOT; settings from its config.toml)" in stdout
    turns = re.search(r"turns \(main / side\)\s*│\s*(\d+)", stdout)
    assert turns and int(turns.group(1)) > 0, stdout[-3000:]
    # Prefect's lines about each run went to the log, not the terminal
    flows_log = (run / "logs" / "flows.log").read_text()
    assert "Finished in state Completed()" in flows_log and "Finished in state" not in out.stderr, out.stderr[-2000:]
    assert "step  2: served_score" in out.stderr  # the loop's own lines stay
    # the status command it prints, from another directory, without the environment: the same data
    [status_cmd] = [line.strip() for line in stdout.splitlines() if re.search(r"clawrl status -c ", line)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL__")}
    again = run_to_end(shlex.split(status_cmd), cwd=tmp_path, env={**env, "COLUMNS": "100"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[0] == f"data root {run} (from {run / 'config.toml'})"
    assert re.search(r"turns \(main / side\)\s*│\s*(\d+)", again.stdout).group(1) == turns.group(1)


def _mlflow_runs(run: Path) -> dict:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("clawrl")
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def _decisions(run: Path) -> tuple[dict[str, str], str]:
    """({weight version: the gate's action}, the champion): the gate decides on the tiny model's answers,
    either way."""
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion, promotion_log

    with open_catalog(run, private=True) as con:
        return {r["weight_version"]: r["action"] for r in promotion_log(con) if r["source"] == "gate"}, \
            current_champion(con)


def _model_version(mlflow_url: str, weight_version: str) -> dict:
    found = httpx.get(f"{mlflow_url}/api/2.0/mlflow/model-versions/search",
                      params={"filter": f"name = 'clawrl-policy' and tags.weight_version = '{weight_version}'"}).json()
    [mv] = found["model_versions"]
    return mv


def _opens(url: str) -> bool:
    """The UI answers 200 to a browser opening ``url`` (a page request: both UIs answer API clients with
    404 on a page path)."""
    return httpx.get(url, headers={"Accept": "text/html"}, follow_redirects=True).status_code == 200


def test_every_link_between_the_uis_leads_to_the_right_page_on_ups_ports(demo_ui):
    """The demo wrote its links while its own temporary Prefect ran; `clawrl up` on other ports points
    them at the UIs it runs: each artifact's MLflow links and each MLflow run's Prefect link answer 200
    and name the version they belong to. A refused version's artifact says so; while the initial weights
    are the champion, their model version carries the alias."""
    run, prefect, ml = demo_ui
    decided, champion = _decisions(run)
    runs = _mlflow_runs(run)
    for version in ("1", "2"):
        [artifact] = httpx.post(f"{prefect}/api/artifacts/filter",
                                json={"artifacts": {"key": {"any_": [f"train-v{version}"]}}}).json()
        links = re.findall(r"\]\((http[^)\s]+)\)", artifact["data"])
        assert len(links) == 2 and all(u.startswith(f"{ml}/#/") for u in links), links
        assert all(_opens(u) for u in links)
        assert all(u.endswith("?workflowType=machine_learning") for u in links), links  # the model-training view
        run_id = re.search(r"/runs/([0-9a-f]{32})\?", links[0]).group(1)
        got = httpx.get(f"{ml}/api/2.0/mlflow/runs/get", params={"run_id": run_id}).json()["run"]
        assert got["info"]["run_name"] == f"step-000{version}"
        mv_number = re.search(r"/models/clawrl-policy/versions/(\d+)", links[1]).group(1)
        assert mv_number == _model_version(ml, version)["version"] == version  # model version N is weight version N
        said = "**refused** by the promotion gate" if decided[version] == "refuse" else "promoted: serves"
        assert said in artifact["data"], (decided, artifact["data"])
        step_run = runs[f"step-000{version}"].data.tags  # and from MLflow back to Prefect
        url = step_run["prefect.flow_run_url"]
        assert url.startswith(f"{prefect}/") and _opens(url), url
        flow_run = httpx.get(f"{prefect}/api/flow_runs/{step_run['prefect.flow_run_id']}").json()
        assert flow_run["name"] == f"train-v{version}" and url.endswith(flow_run["id"])
    model = httpx.get(f"{ml}/api/2.0/mlflow/registered-models/get", params={"name": "clawrl-policy"}).json()
    model = model["registered_model"]
    assert {t["key"]: t["value"] for t in model["tags"]}["champion_weight_version"] == champion
    aliases = {a["alias"]: a["version"] for a in model.get("aliases", [])}
    assert aliases.get("champion") == (None if champion == "0" else champion), (champion, aliases)


@needs_chromium
def test_prefect_shows_the_runs_by_what_they_did_and_links_each_step_to_mlflow(demo_ui):
    run, prefect, _ = demo_ui
    runs = _render(f"{prefect}/runs", "prefect-runs")
    for name in ("train-v1", "train-v2", "learning-loop-persona-2-steps"):
        assert name in runs, runs[:2000]
    assert re.search(r"judge-\d{8}-\d{6}", runs), runs[:2000]
    deployments = _render(f"{prefect}/deployments", "prefect-deployments")  # the same UI: `clawrl up`'s too
    for name in ("on-interval", "on-samples-ready", "on-demand"):
        assert name in deployments, deployments[:2000]
    [artifact] = httpx.post(f"{prefect}/api/artifacts/filter",
                            json={"artifacts": {"key": {"any_": ["train-v1"]}}}).json()
    page = _render(f"{prefect}/artifacts/artifact/{artifact['id']}", "prefect-train-v1-artifact")
    step1 = _mlflow_runs(run)["step-0001"].info.run_id
    assert "Weight version 1 (from 0, batch" in page and "model version of clawrl-policy" in page, page[:2000]
    assert f"MLflow run {step1}" in page, page[:2000]
    assert "refused by the promotion gate" in page or "promoted: serves as the champion" in page, page[:2000]
    flow_run = _render(_mlflow_runs(run)["step-0002"].data.tags["prefect.flow_run_url"], "prefect-train-v2")
    assert "train-v2" in flow_run and "Completed" in flow_run, flow_run[:2000]  # MLflow's link back, on up's port


@needs_chromium
def test_mlflow_shows_training_runs_curves_over_versions_and_complete_version_pages(demo_ui):
    run, prefect, ml = demo_ui
    runs = _mlflow_runs(run)
    assert {"policy", "learning-loop", "step-0001", "step-0002"} <= set(runs), sorted(runs)
    exp = runs["policy"].info.experiment_id

    # the model-training view (the runs, the model registry), not the GenAI one that put them under "Evaluation"
    listing = _render(ui_page(ml, f"experiments/{exp}/runs"), "mlflow-training-runs")
    assert "Model registry" in listing and "policy" in listing and "learning-loop" in listing, listing[:2000]
    assert "Evaluation runs" not in listing and "Training runs" not in listing, listing[:2000]

    policy = runs["policy"].info.run_id
    charts = _render(ui_page(ml, f"experiments/{exp}/runs/{policy}/model-metrics"), "mlflow-policy-curves",
                     budget_ms=60_000, height=3400)
    # one chart each, over steps = weight versions: the candidates' held-out scores and the served one
    for metric in ("loss", "reward_mean", "kl", "candidate_score", "served_score", "served_on_topic_rate"):
        assert f"policy ({metric})" in charts, charts[:3000]

    decided, champion = _decisions(run)
    version = _render(ui_page(ml, "models/clawrl-policy/versions/2"), "mlflow-model-version")
    assert "Source Run : step-0002" in version and "@ candidate" in version, version[:2000]
    assert ("@ champion" in version) == (champion == "2"), (champion, version[:2000])
    assert "checkpoint_sha256" in version and "Schema" in version, version[:2000]
    assert "Weight version 2, trained from version 1" in version, version[:2000]  # model version 2 = weight version 2
    step2 = runs["step-0002"]  # its description: the link back to Prefect, rendered (a tag shows as cut-short text)
    page = _render(ui_page(ml, f"experiments/{exp}/runs/{step2.info.run_id}"), "mlflow-step-run")
    assert f"Made by the Prefect flow run {step2.data.tags['prefect.flow_run_id']}" in page, page[:2000]
