"""Per-namespace adapters ([ppo] adapters = "namespace"): a namespace's step trains its own LoRA adapter on its own
samples, saves it in PEFT's format with its optimizer state beside it, and a restarted trainer continues exactly;
another namespace's steps in between change nothing of it; the KL reference is the base."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from clawrl.adapters import ADAPTER_CONFIG, ADAPTER_FILE, adapter_dir, complete_adapters, read_served
from clawrl.checkpoint import OPTIMIZER_FILE, read_step_result
from clawrl.config import PPOSettings
from clawrl.records import SampleRecord
from clawrl.train.base import PPOHyperParams
from clawrl.train.batch import collate_samples
from clawrl.train.adapters import NamespaceTrainer

HP = PPOHyperParams.from_settings(PPOSettings(advantage_estimator="grpo", lr=1e-3, kl_coef=0.0), seed=0)
SEVEN = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def samples(namespace: str, seed: int, n: int = 4) -> list[SampleRecord]:
    g = torch.Generator().manual_seed(seed)
    return [SampleRecord(sample_id=f"{namespace}-{seed}-{i}", turn_id=f"t{seed}{i}", session_id=f"s{i % 2}",
                         judge_config_hash="h", method="grpo",
                         prompt_ids=torch.randint(3, 5000, (4 + i,), generator=g).tolist(),
                         output_ids=torch.randint(3, 5000, (5,), generator=g).tolist(), rollout_logprobs=[-10.8] * 5,
                         reward=1.0 if i % 2 else -1.0, has_teacher=False, teacher_logprobs=None, weight_version="0",
                         namespace=namespace) for i in range(n)]


def trainer(tiny_dir, checkpoints, hp=HP, **kw) -> NamespaceTrainer:
    return NamespaceTrainer(base_model_dir=tiny_dir, checkpoints=checkpoints, hp=hp, pad_id=2, rank=4, **kw)


def test_a_namespace_step_writes_a_peft_adapter_that_peft_loads_to_the_trained_logprobs(tiny_dir, tmp_path):
    from peft import PeftModel

    t = trainer(tiny_dir, tmp_path)
    batch = samples("key-aaaa", 1)
    step = t.run("b1", batch, version=1)
    d = adapter_dir(tmp_path, "key-aaaa", 1)
    assert (step.weight_version, step.parent_version, step.path, step.step) == ("key-aaaa@v1", "key-aaaa@v0", str(d), 1)
    assert step.sessions == [["key-aaaa", "s0"], ["key-aaaa", "s1"]]
    assert sorted(p.name for p in d.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_FILE, OPTIMIZER_FILE, "trainer.json"])
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], set(config["target_modules"])) == \
        ("LORA", 4, 32.0, SEVEN)
    weights = load_file(str(d / ADAPTER_FILE))
    assert len(weights) == 2 * 7 * 2  # A and B of seven projections in each of the two layers
    assert all(v.dtype == torch.float32 for v in weights.values())
    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    tokens = collate_samples(batch, 2)
    with torch.no_grad():
        base_lp = torch.log_softmax(base(input_ids=tokens.input_ids).logits[:, :-1], -1)
        peft = PeftModel.from_pretrained(base, str(d)).eval()
        lp = torch.log_softmax(peft(input_ids=tokens.input_ids).logits[:, :-1], -1)
    gather = lambda x: x.gather(-1, tokens.input_ids[:, 1:, None]).squeeze(-1) * tokens.response_mask  # noqa: E731
    trained = t.backend.compute_logprobs(tokens)
    torch.testing.assert_close(gather(lp), trained * tokens.response_mask, atol=1e-5, rtol=0)
    assert not torch.allclose(gather(lp), gather(base_lp))  # the adapter changed the model


def test_the_kl_reference_is_the_base_with_the_adapter_off(tiny_dir, tmp_path):
    t = trainer(tiny_dir, tmp_path, dataclasses.replace(HP, kl_coef=0.05))
    assert t.backend.reference is None  # no second copy of the model
    tokens = collate_samples(samples("open", 1), 2)
    before = t.backend.compute_logprobs(tokens)
    step = t.run("b1", samples("open", 1), version=1)
    assert step.metrics["kl"] == 0.0  # the first step starts at the base: B = 0
    t.run("b2", samples("open", 2), version=2)
    assert not torch.equal(t.backend.compute_logprobs(tokens), before)
    assert torch.equal(t.backend.compute_logprobs(tokens, reference=True), before)


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_a_restarted_trainer_continues_exactly_and_other_namespaces_change_nothing(tiny_dir, tmp_path, device, dtype):
    straight = trainer(tiny_dir, tmp_path / "straight", device=device, dtype=dtype)
    for v in (1, 2, 3):
        straight.run(f"a{v}", samples("key-aaaa", v), version=v)

    ckpts = tmp_path / "interleaved"
    first = trainer(tiny_dir, ckpts, device=device, dtype=dtype)
    first.run("a1", samples("key-aaaa", 1), version=1)
    first.run("b1", samples("key-bbbb", 7), version=1)  # another namespace trains between A's steps
    first.run("a2", samples("key-aaaa", 2), version=2)
    del first
    restarted = trainer(tiny_dir, ckpts, device=device, dtype=dtype)  # model, optimizer and adapters from disk
    restarted.run("b2", samples("key-bbbb", 8), version=2)
    third = restarted.run("a3", samples("key-aaaa", 3), version=3)

    want = read_step_result(adapter_dir(tmp_path / "straight", "key-aaaa", 3))
    assert third.sha256 == want.sha256  # byte for byte the adapter of three straight steps
    assert third.metrics["adapter_steps"] == 3.0
    assert [v for v, _ in complete_adapters(ckpts, "key-aaaa")] == [3, 2, 1]
    assert [v for v, _ in complete_adapters(ckpts, "key-bbbb")] == [2, 1]
    mine = torch.load(adapter_dir(ckpts, "key-aaaa", 3) / OPTIMIZER_FILE, weights_only=True)
    theirs = torch.load(adapter_dir(tmp_path / "straight", "key-aaaa", 3) / OPTIMIZER_FILE, weights_only=True)
    assert mine["step"] == theirs["step"] == 3
    assert all(torch.equal(mine["exp_avg_sq"][k], theirs["exp_avg_sq"][k]) for k in theirs["exp_avg_sq"])
    # only the newest version keeps its optimizer state; nothing is served yet
    assert not (adapter_dir(ckpts, "key-aaaa", 2) / OPTIMIZER_FILE).exists()
    assert read_served(ckpts, "key-aaaa") is None


def test_a_batch_trains_once_and_a_batch_of_two_namespaces_or_an_old_version_is_refused(tiny_dir, tmp_path):
    t = trainer(tiny_dir, tmp_path)
    first = t.run("b1", samples("open", 1), version=1)
    assert t.run("b1", samples("open", 1), version=1) == first  # exactly once: the stored result
    assert [v for v, _ in complete_adapters(tmp_path, "open")] == [1]
    with pytest.raises(ValueError, match="holds samples of 2 namespaces"):
        t.run("b2", samples("open", 2)[:2] + samples("key-aaaa", 2)[2:], version=2)
    with pytest.raises(ValueError, match="would make version 1 of open's adapter, but version 1 exists"):
        t.run("b3", samples("open", 3), version=1)


def test_pruning_keeps_the_newest_weights_and_those_rollbacks_need(tiny_dir, tmp_path):
    from clawrl.adapters import namespace_dir
    from clawrl.checkpoint import keep_weights_of

    t = trainer(tiny_dir, tmp_path, keep_weights=2)
    keep_weights_of(namespace_dir(tmp_path, "open"), ["1"])  # the gate's champion line reaches back to v1
    for v in (1, 2, 3, 4):
        t.run(f"b{v}", samples("open", v), version=v)
    kept = [v for v, d in complete_adapters(tmp_path, "open") if (d / ADAPTER_FILE).is_file()]
    assert kept == [4, 3, 1]  # the newest two and v1; v2's weights went, its trainer.json stays
    assert read_step_result(adapter_dir(tmp_path, "open", 2)).batch_id == "b2"


def test_the_trainer_service_trains_a_namespaces_batch_once_and_refuses_a_shared_one(make_settings, tmp_path):
    """`clawrl trainer` (a process of its own, as `clawrl up` starts it) with [ppo] adapters = "namespace"."""
    import httpx

    from clawrl.config import dump_toml
    from clawrl.records import BatchRecord
    from clawrl.storage.writer import DataStore
    from clawrl.trainer_service import claim_adapter_batch, request_step
    from tests.train.test_trainer_distributed import _stop, _trainer, _wait

    s = make_settings({"ppo.adapters": "namespace", "ppo.lora_rank": 4, "ppo.rollout_batch_size": 4,
                       "ppo.advantage_estimator": "grpo", "ppo.kl_coef": 0.0})
    conf = tmp_path / "adapters.toml"
    conf.write_text(dump_toml(s))
    root = s.storage.data_root
    with DataStore(root) as store:
        store.append([dataclasses.replace(r, judge_config_hash=_chash(s)) for r in samples("key-aaaa", 1)])
        batch_id, _ = claim_adapter_batch(store, root, "key-aaaa", judge_config_hash=_chash(s), batch_size=4,
                                          max_staleness=4, method="grpo", config_hash="c", config_toml="")
        store.append(BatchRecord("shared-1", 1, ["x"], ["s"], "grpo", "c", "0"))
    proc, url = _trainer(conf, 1, tmp_path / "trainer.log")
    try:
        _wait(proc, url, tmp_path / "trainer.log")
        assert httpx.get(url + "/state").json() == {"weight_version": "0", "last": None}
        step = request_step(url, batch_id)
        assert (step["weight_version"], step["path"]) == ("key-aaaa@v1", str(adapter_dir(root / "checkpoints",
                                                                                           "key-aaaa", 1)))
        assert request_step(url, batch_id) == step  # exactly once
        with pytest.raises(RuntimeError, match="batch shared-1 trains the shared policy, and this trainer trains "
                                               r"per-namespace adapters \(\[ppo\] adapters\)"):
            request_step(url, "shared-1")
    finally:
        _stop(proc, tmp_path / "trainer.log")


def _chash(settings) -> str:
    from clawrl.judge.runner import build_judge_config_hash

    return build_judge_config_hash(settings)
