"""`clawrl up` with the trainer as a torchrun job (two gloo processes on CPU, data parallel with the batch's
rows split): users' turns are judged, the two ranks train version 1, the gateway serves it, and replaying
that version in one process (`clawrl replay`) gives the same weights byte for byte (each replica's
micro-batch gradient, summed as one process sums them).

The flows run on a Prefect work pool with no worker of `clawrl up`'s own: `clawrl up --host 127.0.0.2`
binds Prefect, MLflow and the trainer to that address (not 127.0.0.1), and a separate `prefect worker`
process that knows only that address runs the judge and train runs.

Tensor parallel under torchrun is held to one process by tests/train/test_trainer_distributed.py (the
trainer service `clawrl up` starts, TP2 and DP2 against world size 1, and the torchrun command `clawrl up`
builds for each layout)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from clawrl.supervisor import Service, start, stop
from tests.train.test_megatron_backend import _assert_same_updated_weights
from tests.utils.up_process import REPO, Traffic, ports, up
from tests.utils.waiting import HANG_S, run_to_end, wait_until

LR = 1e-3
POOL = "clawrl-elsewhere"
HOST = "127.0.0.2"  # a loopback address other than 127.0.0.1: a service bound to the default is not reached


def _worker(prefect_port: int, tmp_path: Path) -> Service:
    """A process worker of POOL that knows nothing but the Prefect API at HOST (as on another machine), started
    in a process group of its own (its log: ``tmp_path/worker.log``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAWRL__", "MLFLOW_", "PREFECT_"))}
    env.update(PREFECT_API_URL=f"http://{HOST}:{prefect_port}/api", PREFECT_HOME=str(tmp_path / "worker-home"),
               PREFECT_WORKER_QUERY_SECONDS="2", PYTHONPATH=str(REPO))
    api = f"http://{HOST}:{prefect_port}/api"
    worker = Service("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type",
                                "process", "--name", "elsewhere"], f"{api}/health", api)
    start(worker, tmp_path, env)
    return worker


def _flow_runs(prefect_port: int, name: str) -> list[dict]:
    r = httpx.post(f"http://{HOST}:{prefect_port}/api/flow_runs/filter", timeout=30,
                   json={"flow_runs": {"name": {"any_": [name]}}})
    r.raise_for_status()
    return r.json()


@pytest.mark.slow
@pytest.mark.timeout(HANG_S)
def test_up_trains_on_two_ranks_like_one(tmp_path, model_cache):
    from safetensors.torch import load_file

    data = tmp_path / "data"
    p = ports(5)
    fresh = tmp_path / "models"  # the two ranks find the model missing and build it at once
    fresh.mkdir()
    for tok in model_cache.glob("smollm2-tokenizer-*"):  # the tokenizer the tiny models share, when built
        shutil.copytree(tok, fresh / tok.name)
    conf = tmp_path / "up.toml"
    conf.write_text(f"""
[model]
name = "tiny-qwen3"
dtype = "float32"
data_parallel = 2
[server]
open_mode = true
api_port = {p[0]}
host = "0.0.0.0"
[storage]
data_root = "{data}"
model_cache = "{fresh}"
[ppo]
backend = "megatron"
advantage_estimator = "grpo"
rollout_batch_size = 4
micro_batch_size = 2
max_new_tokens = 6
lr = {LR}
max_staleness = 100
[prm]
backend = "rule"
[gate]
size = 4
""")
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{p[0]}/v1"
    ckpt = data / "checkpoints" / "v000001"
    proc = up(conf, p, log, "--host", HOST, "--work-pool", POOL, "--no-local-worker")
    worker = None
    try:
        wait_until(lambda: httpx.get(base + "/models", timeout=10).status_code == 200, "the gateway", proc=proc, log=log)
        wait_until(lambda: (data / "up.pids.json").is_file() and "flows" in json.loads((data / "up.pids.json")
                                                                                       .read_text()),
                   "the flows registered", proc=proc, log=log)
        worker = _worker(p[1], tmp_path)
        with Traffic(base, "dp"):
            wait_until(lambda: (ckpt / "trainer.json").is_file(), "a first training step", proc=proc, log=log)
        # read now: the users' turns keep the trainer going, and three versions later pruning removes v1's weights
        original = {k: v.clone() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
        pids = json.loads((data / "up.pids.json").read_text())
        ranks = subprocess.run(["pgrep", "-P", str(pids["trainer"])], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2  # torchrun's two rank processes
        wait_until(lambda: int(httpx.get(base + "/models", timeout=10).json()["data"][0]["weight_version"]) >= 1,
                   "a trained version served", proc=proc, log=log)
        # submitted to the running up's Prefect; the replay trains in that flow's one process
        out = run_to_end([sys.executable, "-m", "clawrl.cli", "replay", "1", "-c", str(conf), "--format", "json"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        [train_run] = _flow_runs(p[1], "train-v1")
        pids = json.loads((data / "up.pids.json").read_text())
    finally:
        if worker is not None:
            stop(worker, 60)  # with the runs it started (its process group)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    # trained in a subprocess of the worker, through the trainer at HOST
    assert train_run["work_pool_name"] == POOL and train_run["state_type"] == "COMPLETED"
    assert "elsewhere" in (tmp_path / "worker.log").read_text()
    assert pids["prefect_api_url"] == f"http://{HOST}:{p[1]}/api" and "worker" not in pids
    trained = json.loads((ckpt / "trainer.json").read_text())
    assert trained["metrics"]["trainer_ranks"] == 2
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    [step] = report["steps"]
    assert step["trained_ranks"] == 2 and step["samples"] == 4
    # each replica's micro-batch gradient, summed as one process sums them
    assert step["identical"] is True and report["identical"] is True and step["max_abs_diff"] is None
    replayed = load_file(str(Path(report["final_path"]) / "model.safetensors"))
    _assert_same_updated_weights(replayed, original, lr=LR)
    from clawrl.models import resolve_model_dir

    initial = load_file(str(resolve_model_dir("tiny-qwen3", fresh) / "model.safetensors"))
    assert max(float((original[k] - v).abs().max()) for k, v in initial.items()) > 1e-4  # the step moved them
