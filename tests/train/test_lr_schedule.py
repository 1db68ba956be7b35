"""The lr schedule: hand-computed values, config checks, and the trainer applying it per weight
version (so a restarted trainer and a replay use the same lr for the same step)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from clawrl.checkpoint import read_step_result
from clawrl.config import ConfigError, PPOSettings, load_settings
from clawrl.records import SampleRecord
from clawrl.train.base import PPOHyperParams, lr_at
from clawrl.train.trainer import Trainer

HP = PPOHyperParams.from_settings(PPOSettings(advantage_estimator="grpo", lr=1e-3, kl_coef=0.0), seed=0)


def sched(**kw) -> PPOHyperParams:
    return dataclasses.replace(HP, **kw)


def test_constant_without_decay_steps():
    assert HP.lr_decay_steps == 0
    assert [lr_at(HP, s) for s in (0, 5, 100)] == [1e-3, 1e-3, 1e-3]


def test_cosine_decay_then_floor():
    hp = sched(lr_decay_steps=4, lr_min=1e-4)
    # lr_min + (lr - lr_min)(1 + cos(pi k / 4)) / 2, then lr_min
    quarter, three_quarters = (1e-4 + 0.9e-3 * (1 + c) / 2 for c in (math.cos(math.pi / 4), -math.cos(math.pi / 4)))
    assert quarter == pytest.approx(8.682e-4, rel=1e-4)
    assert [lr_at(hp, s) for s in range(7)] == pytest.approx([1e-3, quarter, 5.5e-4, three_quarters, 1e-4, 1e-4, 1e-4])
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(hp, -1)


def test_decay_steps_come_from_the_settings_and_a_floor_above_the_peak_is_refused(monkeypatch):
    assert PPOHyperParams.from_settings(load_settings(env={}).ppo, seed=0).lr_decay_steps == 0  # constant
    monkeypatch.setenv("CLAWRL__PPO__LR_DECAY_STEPS", "8")
    monkeypatch.setenv("CLAWRL__PPO__LR_MIN", "1")
    with pytest.raises(ConfigError, match="lr_min"):
        load_settings()
    monkeypatch.setenv("CLAWRL__PPO__LR_MIN", "1e-6")
    s = load_settings()
    hp = PPOHyperParams.from_settings(s.ppo, seed=0)
    assert (hp.lr_decay_steps, hp.lr_min) == (8, 1e-6)
    assert lr_at(hp, 8) == 1e-6


def _samples(step: int) -> list[SampleRecord]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i, r in enumerate((1.0, -1.0, 1.0, -1.0)):
        out.append(SampleRecord(
            sample_id=f"s{step}-{i}", turn_id=f"t{step}-{i}", session_id="sess", judge_config_hash="h",
            method="grpo", prompt_ids=torch.randint(3, 5000, (4 + i,), generator=g).tolist(),
            output_ids=torch.randint(3, 5000, (5,), generator=g).tolist(),
            rollout_logprobs=[-10.8] * 5, reward=r, has_teacher=False, teacher_logprobs=None,
            weight_version=str(step)))
    return out


def test_trainer_applies_the_schedule_per_version_across_a_restart(tiny_dir, tmp_path):
    # cosine 1e-3 -> 0 over 2 steps: v1 at 1e-3, v2 at 5e-4, v3 at 0 (the weights must not move)
    hp = sched(lr_decay_steps=2, lr_min=0.0)
    ckpts = tmp_path / "ckpt"
    t = Trainer(base_model_dir=tiny_dir, checkpoints=ckpts, hp=hp, pad_id=2)
    t.run("b1", _samples(1))
    t.run("b2", _samples(2))
    del t
    t = Trainer(base_model_dir=tiny_dir, checkpoints=ckpts, hp=hp, pad_id=2)  # a restarted trainer
    assert t.version == 2
    t.run("b3", _samples(3))
    lrs = [read_step_result(ckpts / f"v{v:06d}").metrics["lr"] for v in (1, 2, 3)]
    assert lrs == pytest.approx([1e-3, 5e-4, 0.0])
    w2, w3 = (load_file(str(ckpts / f"v{v:06d}" / "model.safetensors")) for v in (2, 3))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # lr 0 reached AdamW: no parameter moved
    w1 = load_file(str(ckpts / "v000001" / "model.safetensors"))
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # lr 5e-4 did move them


def test_a_bf16_trainer_keeps_the_master_weights_of_its_newest_checkpoint_only(tiny_dir, tmp_path):
    """Served bf16 checkpoints: the float32 master weights go with the optimizer state (newest
    only), and a restarted trainer continues from them, not from the rounded served weights."""
    from clawrl.checkpoint import MASTER_FILE, OPTIMIZER_FILE

    ckpts = tmp_path / "ckpt"
    t = Trainer(base_model_dir=tiny_dir, checkpoints=ckpts, hp=sched(), pad_id=2, dtype="bfloat16")
    t.run("b1", _samples(1))
    t.run("b2", _samples(2))
    weights = t.state_dict()
    t.wait_state()  # the trainer state is written after the step returns
    v1, v2 = ckpts / "v000001", ckpts / "v000002"
    assert [(d / OPTIMIZER_FILE).is_file() for d in (v1, v2)] == [False, True]
    assert [(d / MASTER_FILE).is_file() for d in (v1, v2)] == [False, True]
    assert {t.dtype for t in load_file(str(v2 / "model.safetensors")).values()} == {torch.bfloat16}
    del t
    t = Trainer(base_model_dir=tiny_dir, checkpoints=ckpts, hp=sched(), pad_id=2, dtype="bfloat16")
    assert t.version == 2
    restarted = t.state_dict()
    assert all(torch.equal(restarted[k], weights[k]) for k in weights)
