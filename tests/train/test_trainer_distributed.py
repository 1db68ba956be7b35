"""The trainer service under torchrun, as `clawrl up` starts it when [model] tensor_parallel x data_parallel
> 1: two gloo processes on CPU, rank 0 serving the trainer API and the other rank following its steps.
One step on the same claimed batch at world size 1, TP2 and DP2 gives the same loss, KL, entropy and
pre-clip gradient norm and writes the same checkpoint (float32: every weight within lr / 20 and at most 1
element in 100,000 more than 1e-6 apart, as for Megatron vs torch), and asking again for the same batch
trains nothing (exactly once). tiny-qwen3 exercises every sharding (grouped qkv, gate/up halves,
row-parallel proj/fc2, untied vocab-parallel embedding and output) and the q/k-norm gradients that must be
summed over ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from clawrl.checkpoint import has_trainer_state
from clawrl.config import config_hash, dump_toml
from clawrl.judge.runner import build_judge_config_hash
from clawrl.storage.writer import DataStore
from clawrl.train.base import GRAD_CLIP
from clawrl.trainer_service import claim_batch, request_step
from tests.train.test_megatron_backend import _assert_same_updated_weights
from tests.utils.gateway_process import free_port
from tests.utils.samples import write_samples
from tests.utils.waiting import HANG_S, wait_until

REPO = Path(__file__).resolve().parents[2]


def _trainer(conf: Path, nproc: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "clawrl.cli", "trainer", "-c", str(conf), "--port",
                             str(port)], cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str, log: Path) -> None:
    wait_until(lambda: httpx.get(url + "/state", timeout=10).status_code == 200, "the trainer up", proc=proc, log=log,
               poll_s=0.5)


def _stop(proc: subprocess.Popen, log: Path) -> None:
    proc.terminate()
    wait_until(lambda: proc.poll() is not None, "the trainer to stop", proc=proc, log=log)


@pytest.mark.parametrize("tp, dp, launcher", [
    (1, 1, []), (2, 1, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]),
    (2, 2, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"])])
def test_up_starts_the_trainer_under_torchrun_with_one_process_per_rank(make_settings, tp, dp, launcher):
    from clawrl import supervisor

    s = make_settings({"ppo.backend": "megatron", "model.tensor_parallel": tp, "model.data_parallel": dp})
    [trainer] = [sv for sv in supervisor.plan(s, Path("/conf/up.toml"), prefect_port=4200, mlflow_port=5000,
                                               trainer_port=30020) if sv.name == "trainer"]
    assert trainer.argv == [sys.executable, *launcher, "-m", "clawrl.cli", "trainer", "-c", "/conf/up.toml",
                            "--host", "127.0.0.1", "--port", "30020"]
    assert trainer.health_url == "http://127.0.0.1:30020/state"  # rank 0 serves the API


@pytest.mark.slow
@pytest.mark.timeout(HANG_S)
def test_tp2_and_dp2_trainers_step_like_one_process(make_settings, tmp_path):
    from safetensors.torch import load_file

    base = {"ppo.backend": "megatron", "model.name": "tiny-qwen3", "model.dtype": "float32",
            "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 4, "ppo.micro_batch_size": 2,
            "ppo.lr": 1e-3, "ppo.kl_coef": 0.1}
    s = make_settings(base)
    write_samples(s, 4)
    with DataStore(s.storage.data_root) as store:
        batch_id, why = claim_batch(store, s.storage.data_root, judge_config_hash=build_judge_config_hash(s),
                                    batch_size=4, max_staleness=10, method="grpo", config_hash=config_hash(s),
                                    config_toml=dump_toml(s))
    assert batch_id is not None, why
    weights, metrics = {}, {}
    for name, layout in (("world1", {}), ("tp2", {"model.tensor_parallel": 2}), ("dp2", {"model.data_parallel": 2})):
        root = tmp_path / name
        shutil.copytree(s.storage.data_root, root)  # the same claimed batch in each run's data root
        conf = tmp_path / f"{name}.toml"
        conf.write_text(dump_toml(make_settings({**base, **layout, "storage.data_root": str(root)})))
        proc, url = _trainer(conf, 1 if not layout else 2, tmp_path / f"{name}.log")
        try:
            _wait(proc, url, tmp_path / f"{name}.log")
            step = request_step(url, batch_id)
            again = request_step(url, batch_id)  # exactly once: the stored result, no second step
            # the optimizer state follows the complete checkpoint from a background thread: wait for it
            # before stopping the trainer, which may stop before that thread is done
            wait_until(lambda: has_trainer_state(root / "checkpoints" / "v000001"), "the trainer state written",
                       proc=proc, log=tmp_path / f"{name}.log", poll_s=0.2)
        finally:
            _stop(proc, tmp_path / f"{name}.log")
        assert step["weight_version"] == "1" and again == step
        assert step["metrics"]["trainer_ranks"] == (1 if not layout else 2)
        ckpt = root / "checkpoints" / "v000001"
        assert sorted(p.name for p in ckpt.glob("*.pt")) == ["optimizer.pt"]  # one file, written by rank 0
        weights[name], metrics[name] = load_file(str(ckpt / "model.safetensors")), step["metrics"]
    assert metrics["world1"]["grad_norm"] > GRAD_CLIP  # clipped, so the TP-aware norm decides the step
    assert metrics["world1"]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step starts at the reference
    assert "lm_head.weight" in weights["tp2"]  # untied: gathered from both vocab shards
    for name in ("tp2", "dp2"):
        for key in ("loss", "policy_loss", "kl", "entropy", "tis_weight_mean"):
            assert metrics[name][key] == pytest.approx(metrics["world1"][key], abs=1e-5), (name, key)
        assert metrics[name]["grad_norm"] == pytest.approx(metrics["world1"]["grad_norm"], rel=1e-4)
        # the tolerance of Megatron vs torch in tests/train/test_megatron_backend.py: float32 rounding through AdamW
        _assert_same_updated_weights(weights[name], weights["world1"])
    from clawrl.models import resolve_model_dir

    initial = load_file(str(resolve_model_dir("tiny-qwen3", s.storage.models_dir) / "model.safetensors"))
    moved = max(float((weights["world1"][k] - v).abs().max()) for k, v in initial.items() if k in weights["world1"])
    assert moved > 1e-4  # the step changed the weights: the comparison above is not of untouched copies
