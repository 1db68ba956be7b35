"""The Prefect and MLflow UIs on a demo run, rendered in headless Chromium: the pages a user opens show
the runs, the links between the two UIs and the curves over weight versions.

A two-step `clawrl demo` on the tiny model writes its run directory; `prefect server start` (on the
run's own Prefect home) and `mlflow server` (on the run's sqlite store) serve it; Chromium renders
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


def _serve(args: list[str], env: dict[str, str], health: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1.0)
    proc.kill()
    raise AssertionError(f"{args[0]} did not come up:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def demo_ui(tmp_path_factory, model_cache):
    """A two-step demo run and both UIs serving it: (run dir, Prefect URL, MLflow URL)."""
    tmp = tmp_path_factory.mktemp("ui")
    conf = tiny_demo_config(tmp, model_cache)
    run = tmp / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "clawrl.cli", "demo", "-c", str(conf), "--steps", "2", "--users", "4",
                          "--heldout", "4", "--eval-samples", "1", "--max-tokens", "8", "--run-dir", str(run)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    pf, ml = _port(), _port()
    prefect_url, mlflow_url = f"http://127.0.0.1:{pf}", f"http://127.0.0.1:{ml}"
    pf_env = {**env, "PREFECT_HOME": str(run / "prefect"), "PREFECT_UI_API_URL": f"{prefect_url}/api",
              "PREFECT_API_URL": f"{prefect_url}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    servers = [_serve(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(pf)], pf_env,
                      f"{prefect_url}/api/health", tmp / "prefect.log")]
    try:
        servers.append(_serve(["mlflow", "server", "--host", "127.0.0.1", "--port", str(ml), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{run / 'mlflow' / 'mlflow.db'}"], env,
                              f"{mlflow_url}/health", tmp / "mlflow.log"))
        yield run, prefect_url, mlflow_url
    finally:
        for p in servers:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_prefect_shows_the_runs_by_what_they_did_and_links_each_step_to_mlflow(demo_ui):
    run, prefect, _ = demo_ui
    runs = _render(f"{prefect}/runs", "prefect-runs")
    for name in ("train-v1", "train-v2", "learning-loop-persona-2-steps"):
        assert name in runs, runs[:2000]
    assert re.search(r"judge-\d{8}-\d{6}", runs), runs[:2000]
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
    for metric in ("loss", "kl", "heldout_score"):  # one chart each, over steps = weight versions
        assert f"policy ({metric})" in charts, charts[:3000]

    version = _render(f"{ml}/#/models/clawrl-policy/versions/2", "mlflow-model-version")
    assert "Source Run : step-0002" in version and "@ champion" in version, version[:2000]
    assert "checkpoint_sha256" in version and "Schema" in version, version[:2000]
    flow_run_id = runs["step-0002"].data.tags["prefect.flow_run_id"]  # and back to Prefect
    assert httpx.get(f"{prefect}/api/flow_runs/{flow_run_id}").json()["name"] == "train-v2"
