"""The Prefect and MLflow UIs on a demo run, rendered in headless Chromium: the pages a user opens show
the runs, the links between the two UIs and the curves over weight versions.

A two-step `clawrl demo` on the tiny model writes its run directory; `clawrl up -c <run>/config.toml`, the
command the demo prints, serves it (its Prefect on the run's own Prefect home with the deployments, its
MLflow on the run's sqlite store); Chromium renders
each page (``--dump-dom`` after the page's scripts ran) and the test reads the rendered text. Skipped
without a Chromium (Debian's package ``chromium``: `make ui-test` installs it). With
``CLAWRL_UI_SCREENSHOTS=<dir>`` each page is also saved there as a PNG (docs/ui holds the ones the
README and docs/benchmarks.md show).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.demo_config import tiny_demo_config
from tests.utils.gateway_server import free_socket

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason=(
    "no Chromium: `make ui-test` installs Debian's chromium and runs this test"))]


def _port() -> int:
    s = free_socket()
    port = s.getsockname()[1]
    s.close()
    return port


def _render(url: str, name: str, budget_ms: int = 40_000, height: int = 1000) -> str:
    """The page's visible text once its scripts ran ``budget_ms`` of virtual time; a PNG of it too when asked.
    Charts render only inside the window: ``height`` makes room for all of a page's."""
    base = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size=1400,{height}",
            f"--virtual-time-budget={budget_ms}", "--run-all-compositor-stages-before-draw"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    if shots := os.environ.get("CLAWRL_UI_SCREENSHOTS"):
        Path(shots).mkdir(parents=True, exist_ok=True)
        subprocess.run([*base, f"--screenshot={Path(shots) / (name + '.png')}", url], capture_output=True,
                       timeout=180, check=True)
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


@pytest.fixture(scope="module")
def demo_ui(tmp_path_factory, model_cache):
    """A two-step demo run, then `clawrl up -c <run>/config.toml` (the command the demo prints) on its data:
    (run dir, Prefect URL, MLflow URL). No further training while the pages are read: the batch size is
    set out of reach, so the versions the test names stay what they are."""
    tmp = tmp_path_factory.mktemp("ui")
    conf = tiny_demo_config(tmp, model_cache)
    run = tmp / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "clawrl.cli", "demo", "-c", str(conf), "--steps", "2", "--users", "4",
                          "--heldout", "4", "--eval-samples", "1", "--max-tokens", "8", "--run-dir", str(run)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    pf, ml, tr = _port(), _port(), _port()
    prefect_url, mlflow_url = f"http://127.0.0.1:{pf}", f"http://127.0.0.1:{ml}"
    up_env = {**env, "CLAWRL__SERVER__API_PORT": str(_port()), "CLAWRL__PRM__ENGINE_PORT": str(_port()),
              "CLAWRL__PPO__ROLLOUT_BATCH_SIZE": "1000000"}
    log = tmp / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "clawrl.cli", "up", "-c", str(run / "config.toml"), "--prefect-port",
                           str(pf), "--mlflow-port", str(ml), "--trainer-port", str(tr)],
                          cwd=REPO, env=up_env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 420
        while "all up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1.0)
        yield run, prefect_url, mlflow_url
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()


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


def _mlflow_runs(run: Path) -> dict:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("clawrl")
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def test_mlflow_shows_training_runs_curves_over_versions_and_complete_version_pages(demo_ui):
    run, prefect, ml = demo_ui
    runs = _mlflow_runs(run)
    assert {"policy", "learning-loop", "step-0001", "step-0002"} <= set(runs), sorted(runs)
    exp = runs["policy"].info.experiment_id

    listing = _render(f"{ml}/#/experiments/{exp}/runs", "mlflow-training-runs")
    assert "Training runs" in listing and "policy" in listing and "learning-loop" in listing, listing[:2000]

    policy = runs["policy"].info.run_id
    charts = _render(f"{ml}/#/experiments/{exp}/runs/{policy}/model-metrics", "mlflow-policy-curves",
                     budget_ms=60_000, height=3400)
    for metric in ("loss", "reward_mean", "kl", "heldout_score"):  # one chart each, over steps = weight versions
        assert f"policy ({metric})" in charts, charts[:3000]

    version = _render(f"{ml}/#/models/clawrl-policy/versions/2", "mlflow-model-version")
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion

    with open_catalog(run, private=True) as con:
        champion = current_champion(con)  # the gate decides on the tiny model's answers: either way
    assert "Source Run : step-0002" in version and "@ candidate" in version, version[:2000]
    assert ("@ champion" in version) == (champion == "2"), (champion, version[:2000])
    assert "checkpoint_sha256" in version and "Schema" in version, version[:2000]
    flow_run_id = runs["step-0002"].data.tags["prefect.flow_run_id"]  # and back to Prefect
    assert httpx.get(f"{prefect}/api/flow_runs/{flow_run_id}").json()["name"] == "train-v2"
