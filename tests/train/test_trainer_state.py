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
from tests.utils.waiting import wait_until

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
    t._start_writer = lambda *a: None  # stopped right after step 2's checkpoint was complete
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


def test_the_next_step_trains_while_the_state_is_written_and_waits_only_before_its_own(tiny_dir, tmp_path,
                                                                                     monkeypatch):
    import threading

    import clawrl.train.trainer as trainer_mod

    release, seen, written = threading.Event(), [], {}
    write = trainer_mod.write_trainer_state

    def slow_write(ckpt_dir, master, optimizer):
        wait_until(release.is_set, "the next step to train")
        written[ckpt_dir.name] = optimizer
        write(ckpt_dir, master, optimizer)

    monkeypatch.setattr(trainer_mod, "write_trainer_state", slow_write)
    t = _trainer(tiny_dir, tmp_path / "ckpt", "float32")
    result = t.run("b1", BATCHES["b1"])
    v1 = tmp_path / "ckpt" / "v000001"
    assert (v1 / "model.safetensors").is_file() and read_step_result(v1).batch_id == "b1"
    assert not has_trainer_state(v1)  # complete and servable; its state still on the way
    assert result.metrics["checkpoint_write_s"] > 0
    moments_after_b1 = {k: v.clone() for k, v in t.backend.optimizer_state_dict()["exp_avg"].items()}

    step = t.backend.train_step

    def train_step_then_release(batch):
        out = step(batch)  # step 2 changed the optimizer's moments while v1's state was still unwritten
        seen.append(has_trainer_state(v1))
        threading.Timer(0.5, release.set).start()
        return out

    t.backend.train_step = train_step_then_release
    second = t.run("b2", BATCHES["b2"])
    assert seen == [False] and has_trainer_state(v1)  # the step waited for v1's state before its own copy
    assert second.metrics["state_wait_s"] >= 0.4 > result.metrics["state_wait_s"]
    t.wait_state()
    stored = written["v000001"]  # the copy taken after step 1, untouched by step 2
    assert stored["step"] == 1 and all(torch.equal(stored["exp_avg"][k], m) for k, m in moments_after_b1.items())
    assert not all(torch.equal(written["v000002"]["exp_avg"][k], m) for k, m in moments_after_b1.items())
    state = torch.load(tmp_path / "ckpt" / "v000002" / OPTIMIZER_FILE, weights_only=True)
    assert state["step"] == 2 and not has_trainer_state(v1)  # pruning keeps the newest state only


def test_a_failed_state_write_fails_a_step(tiny_dir, tmp_path, monkeypatch):
    import threading

    import clawrl.train.trainer as trainer_mod

    write, trained = trainer_mod.write_trainer_state, threading.Event()

    def full(*a):
        raise OSError(28, "full")

    t = _trainer(tiny_dir, tmp_path / "ckpt", "float32")
    monkeypatch.setattr(trainer_mod, "write_trainer_state", full)
    t.run("b1", BATCHES["b1"])
    t._state_thread.join()  # the write already failed: the next step fails before it trains
    with pytest.raises(RuntimeError, match=r"writing the trainer state of version 1 failed: .*full"):
        t.run("b2", BATCHES["b2"])
    assert not (tmp_path / "ckpt" / "v000002").exists() and t.version == 1

    def v2_fails_once_step_3_trained(ckpt_dir, *a):
        if ckpt_dir.name != "v000002":
            return write(ckpt_dir, *a)  # v3's own write works
        wait_until(trained.is_set, "step 3 to train")
        full()

    monkeypatch.setattr(trainer_mod, "write_trainer_state", v2_fails_once_step_3_trained)
    t.run("b2", BATCHES["b2"])  # v1's error was raised once; v2's write fails while step 3 trains
    step = t.backend.train_step
    t.backend.train_step = lambda batch: (step(batch), trained.set())[0]
    with pytest.raises(RuntimeError, match=r"writing the trainer state of version 2 failed: .*full"):
        t.run("b3", BATCHES["b3"])
    v3 = tmp_path / "ckpt" / "v000003"  # step 3 was saved and its state written before the error was raised
    assert t.run("b3", BATCHES["b3"]).step == 3 and read_step_result(v3).batch_id == "b3"
    t.wait_state()
    assert has_trainer_state(v3) and t.version == 3


def test_half_written_state_of_a_dead_writer_is_removed(tmp_path):
    v1 = tmp_path / "v000001"
    v1.mkdir()
    dead, live = v1 / ".optimizer.pt.999999999.tmp", v1 / f".master-weights.st.{os.getpid()}.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale_staging(tmp_path) == [dead]
    assert live.exists() and not dead.exists()
