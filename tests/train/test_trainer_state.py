"""The trainer's own state (optimizer, float32 master weights) is written after a step returns, off
the path to serving; a trainer that stopped before writing it resumes exactly by training the last
batch again from the state before it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from clawrl.checkpoint import MASTER_FILE, OPTIMIZER_FILE, has_trainer_state, read_step_result, remove_stale_staging
from clawrl.train.trainer import Trainer

from tests.train.test_lr_schedule import HP, _samples

BATCHES = {f"b{i}": _samples(i) for i in (1, 2, 3)}


def _trainer(tiny_dir, ckpts, dtype: str, samples_of=BATCHES.__getitem__) -> Trainer:
    return Trainer(base_model_dir=tiny_dir, checkpoints=ckpts, hp=HP, pad_id=2, dtype=dtype, samples_of=samples_of)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_trainer_stopped_before_writing_its_state_resumes_exactly(tiny_dir, tmp_path, dtype, caplog):
    straight = _trainer(tiny_dir, tmp_path / "straight", dtype)
    for b in ("b1", "b2", "b3"):
        straight.run(b, BATCHES[b])
    straight.wait_state()

    ckpts = tmp_path / "stopped"
    t = _trainer(tiny_dir, ckpts, dtype)
    t.run("b1", BATCHES["b1"])
    t.wait_state()
    t._write_state_later = lambda ckpt_dir: None  # stopped right after step 2's checkpoint was complete
    t.run("b2", BATCHES["b2"])
    v1, v2 = ckpts / "v000001", ckpts / "v000002"
    assert (has_trainer_state(v1), has_trainer_state(v2)) == (True, False)
    del t

    with pytest.raises(RuntimeError, match=r"v000002 has no trainer state .* batch b2"):
        _trainer(tiny_dir, ckpts, dtype, samples_of=None)
    with caplog.at_level(logging.WARNING, logger="clawrl.trainer"):
        resumed = _trainer(tiny_dir, ckpts, dtype)
    assert resumed.version == 2 and resumed.last.batch_id == "b2"
    assert "trained batch b2 again from v1 and wrote it" in caplog.text
    assert "gives other weights" not in caplog.text  # the recomputed weights hash as recorded
    # the state moved to v2 (the newest with it); v1's was pruned
    assert (has_trainer_state(v1), has_trainer_state(v2)) == (False, True)
    assert (v2 / MASTER_FILE).is_file() == (dtype == "bfloat16") and not (v1 / MASTER_FILE).exists()
    resumed.run("b3", BATCHES["b3"])
    resumed.wait_state()
    assert read_step_result(ckpts / "v000003").sha256 == read_step_result(tmp_path / "straight" / "v000003").sha256
    mine, theirs = (torch.load(d / "v000003" / OPTIMIZER_FILE, weights_only=True)
                    for d in (ckpts, tmp_path / "straight"))
    assert mine["step"] == theirs["step"] == 3
    assert all(torch.equal(mine["exp_avg_sq"][k], theirs["exp_avg_sq"][k]) for k in theirs["exp_avg_sq"])


def test_the_step_returns_before_the_state_is_written_and_the_next_step_waits_for_it(tiny_dir, tmp_path):
    import threading

    release = threading.Event()
    t = _trainer(tiny_dir, tmp_path / "ckpt", "float32")
    gather = t._gather_state

    def slow_gather():
        assert release.wait(60)
        return gather()

    t._gather_state = slow_gather
    result = t.run("b1", BATCHES["b1"])
    v1 = tmp_path / "ckpt" / "v000001"
    assert (v1 / "model.safetensors").is_file() and read_step_result(v1).batch_id == "b1"
    assert not has_trainer_state(v1)  # complete and servable; its state still on the way
    assert result.metrics["checkpoint_write_s"] > 0
    threading.Timer(0.5, release.set).start()
    second = t.run("b2", BATCHES["b2"])  # waits for v1's state before changing the optimizer
    assert second.metrics["state_wait_s"] >= 0.4 > result.metrics["state_wait_s"]
    t.wait_state()
    state = torch.load(tmp_path / "ckpt" / "v000002" / OPTIMIZER_FILE, weights_only=True)
    assert state["step"] == 2 and not has_trainer_state(v1)


def test_a_failed_state_write_fails_the_next_step(tiny_dir, tmp_path, monkeypatch):
    import clawrl.train.trainer as trainer_mod

    t = _trainer(tiny_dir, tmp_path / "ckpt", "float32")
    monkeypatch.setattr(trainer_mod, "write_trainer_state", lambda *a: (_ for _ in ()).throw(OSError(28, "full")))
    t.run("b1", BATCHES["b1"])
    with pytest.raises(RuntimeError, match=r"writing the trainer state of version 1 failed: .*full"):
        t.run("b2", BATCHES["b2"])
    assert not (tmp_path / "ckpt" / "v000002").exists()


def test_half_written_state_of_a_dead_writer_is_removed(tmp_path):
    v1 = tmp_path / "v000001"
    v1.mkdir()
    dead, live = v1 / ".optimizer.pt.999999999.tmp", v1 / f".master-weights.st.{os.getpid()}.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale_staging(tmp_path) == [dead]
    assert live.exists() and not dead.exists()
