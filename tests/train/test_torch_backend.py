"""TorchBackend on the tiny (2-layer, 64-wide) model: learning direction, micro-batch
equivalence, frozen reference, LoRA merge, byte-identical deterministic checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.config import PPOSettings
from clawrl.records import Method, SampleRecord
from clawrl.train.base import GRAD_CLIP, PPOHyperParams
from clawrl.train.batch import collate_samples
from clawrl.train.torch_backend import TorchBackend

PAD = 2
HP = PPOHyperParams.from_settings(PPOSettings(advantage_estimator="grpo", lr=1e-3, kl_coef=0.0), seed=0)


def make_batch(seed=0, rewards=(1.0, -1.0, 1.0, -1.0), teacher=False):
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i, r in enumerate(rewards):
        P, T = 3 + 2 * i, 6 - i  # ragged: exercises padding and per-micro-batch trimming
        recs.append(SampleRecord(
            sample_id=f"s{i}", turn_id=f"t{i}", session_id="sess", judge_config_hash="h", method="combine",
            prompt_ids=torch.randint(3, 5000, (P,), generator=g).tolist(),
            output_ids=torch.randint(3, 5000, (T,), generator=g).tolist(),
            rollout_logprobs=(-10.8 - 0.1 * torch.rand(T, generator=g)).tolist(),  # ~ uniform over 49k
            reward=r, has_teacher=teacher and i % 2 == 0,
            teacher_logprobs=[-9.0] * T if teacher and i % 2 == 0 else None, weight_version="v0"))
    return collate_samples(recs, pad_id=PAD)


def seq_mean_logprob(lp, batch):
    return (lp * batch.response_mask).sum(-1) / batch.response_mask.sum(-1)


def test_one_step_moves_logprobs_with_the_reward(tiny_dir):
    backend = TorchBackend(tiny_dir, HP)
    batch = make_batch()
    before_params = {k: v.clone() for k, v in backend.hf_state_dict().items()}
    before = seq_mean_logprob(backend.compute_logprobs(batch), batch)
    metrics = backend.train_step(batch)
    after = seq_mean_logprob(backend.compute_logprobs(batch), batch)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["ratio_mean"] == pytest.approx(1.0)  # one epoch: pi == pi_old during the step
    assert metrics["num_tokens"] == 6 + 5 + 4 + 3
    delta = (after - before).tolist()
    assert delta[0] > 0 and delta[2] > 0  # R = +1: the sampled tokens became more likely
    assert delta[1] < 0 and delta[3] < 0  # R = -1: less likely
    changed = [k for k, v in backend.hf_state_dict().items() if not torch.equal(v, before_params[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed


def test_micro_batches_give_the_full_batch_update(tiny_dir):
    hp = dataclasses.replace(HP, advantage_estimator=Method.COMBINE, kl_coef=0.1, lr=1e-5)
    batch = make_batch(teacher=True)
    results = []
    for mbs in (4, 1):
        backend = TorchBackend(tiny_dir, dataclasses.replace(hp, micro_batch_size=mbs))
        grads = []
        backend.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, b=backend: grads.append([p.grad.clone() for p in b.params]))
        metrics = backend.train_step(batch)
        results.append((grads[0], [p.detach().clone() for p in backend.params], metrics))
    (g4, w4, m4), (g1, w1, m1) = results
    for a, b in zip(g4, g1):
        # float32 sums in another order: agree to 1e-5 of the tensor's largest gradient (measured:
        # 2.2e-6 on the tied embedding, |g| up to 0.75; below 1e-6 everywhere else)
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    # Adam's first step is lr * g / (|g| + 1e-8): float noise on a gradient near 0 moves that
    # weight by up to lr, so compare where |g| > 1e-6 (and Adam is scale-invariant, which is why
    # the gradients above are the real check of the loss scaling)
    for a, b, g in zip(w4, w1, g4):
        sure = g.abs() > 1e-6
        assert sure.float().mean() > 0.5
        torch.testing.assert_close(a[sure], b[sure], atol=1e-6, rtol=0)
    for key in ("loss", "policy_loss", "entropy", "advantage_mean", "tis_weight_mean"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-6), key


def test_one_pass_keeps_the_ratio_at_1_and_the_reference_frozen(tiny_dir):
    hp = dataclasses.replace(HP, kl_coef=0.1)
    backend = TorchBackend(tiny_dir, hp)
    batch = make_batch()
    initial = backend.compute_logprobs(batch)
    first = backend.train_step(batch)
    assert first["kl"] < 1e-6  # the policy starts at the reference
    second = backend.train_step(batch)
    # the old log-probs are the pass's own (detached): r = exp(0) = 1 at every token, in every step
    assert second["ratio_min"] == second["ratio_max"] == 1.0 and second["clip_frac"] == 0.0
    assert second["kl"] > 1e-4  # the first step moved the policy away from the reference
    assert torch.equal(backend.compute_logprobs(batch, reference=True), initial)
    assert not torch.equal(backend.compute_logprobs(batch), initial)


def test_compute_logprobs_matches_hf_log_softmax(tiny_dir):
    backend = TorchBackend(tiny_dir, dataclasses.replace(HP, micro_batch_size=3))
    batch = make_batch()
    ours = backend.compute_logprobs(batch)
    # independent path: HF with full logits and log_softmax, one unpadded row at a time
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    for i in range(len(batch)):
        n = int(batch.attention_mask[i].sum())
        with torch.no_grad():
            logits = hf(input_ids=batch.input_ids[i : i + 1, :n]).logits[0, :-1]
        ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[i, 1:n, None]).squeeze(-1)
        out = batch.response_mask[i, : n - 1].bool()
        torch.testing.assert_close(ours[i, : n - 1][out], ref[out], atol=1e-5, rtol=0)
        assert ours[i, n - 1 :].abs().sum() == 0  # nothing past the sequence end
    # the vocabulary projection starts at each micro-batch's first response position: rows 0-2
    # start at P-1 = 2 (row 0, P=3), row 3 alone at P-1 = 8 -> earlier positions stay 0
    assert ours[:3, :2].abs().sum() == 0 and ours[3, :8].abs().sum() == 0 and ours[3, 8] != 0


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_backends_write_byte_identical_checkpoints(tiny_dir, tmp_path):
    hp = dataclasses.replace(HP, advantage_estimator=Method.COMBINE, kl_coef=0.01, micro_batch_size=2)
    batch = make_batch(teacher=True)
    paths = []
    for name in ("a", "b"):
        backend = TorchBackend(tiny_dir, hp, deterministic=True)
        backend.train_step(batch)
        paths.append(backend.save_checkpoint(tmp_path / name))
    a, b = (p / "model.safetensors" for p in paths)
    assert _sha256(a) == _sha256(b)
    assert _sha256(a) != _sha256(tiny_dir / "model.safetensors")  # the step changed the weights
    names = {p.name for p in paths[0].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind
    source_cfg = json.loads((tiny_dir / "config.json").read_text())
    assert json.loads((paths[0] / "config.json").read_text()) == source_cfg  # architecture, use_cache kept
    # the checkpoint is a loadable HF model holding the trained weights
    reloaded = TorchBackend(paths[0], hp)
    torch.testing.assert_close(reloaded.compute_logprobs(batch), backend.compute_logprobs(batch),
                               atol=1e-6, rtol=0)
    with pytest.raises(FileExistsError, match="never overwritten"):
        backend.save_checkpoint(paths[0])


def test_lora_trains_adapters_and_merges_them_into_hf_weights(tiny_dir):
    hp = dataclasses.replace(HP, kl_coef=0.01)
    backend = TorchBackend(tiny_dir, hp, lora_rank=4, lora_alpha=8.0)
    batch = make_batch()
    initial = backend.compute_logprobs(batch)
    base_keys = set(AutoModelForCausalLM.from_pretrained(str(tiny_dir)).state_dict())
    assert all("lora_" in n for n, p in backend.model.named_parameters() if p.requires_grad)
    backend.train_step(batch)
    trained = backend.compute_logprobs(batch)
    assert not torch.equal(trained, initial)
    assert torch.equal(backend.compute_logprobs(batch, reference=True), initial)  # adapters off = initial
    state = backend.hf_state_dict()
    assert set(state) == base_keys  # HF names, no lora_/base_layer keys
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    plain.load_state_dict(state)
    with torch.no_grad():
        logits = plain(input_ids=batch.input_ids).logits[:, :-1]
    merged_lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask
    torch.testing.assert_close(merged_lp * mask, trained * mask, atol=1e-5, rtol=0)


def test_non_finite_gradient_raises_and_leaves_weights(tiny_dir):
    backend = TorchBackend(tiny_dir, HP)
    before = backend.hf_state_dict()
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        backend.train_step(make_batch(rewards=(float("nan"), 1.0, 1.0, 1.0)))
    after = backend.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in backend.params)


def test_grad_clip_bounds_the_gradient_the_optimizer_sees(tiny_dir):
    backend = TorchBackend(tiny_dir, HP)
    seen = []
    backend.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in backend.params]))))
    metrics = backend.train_step(make_batch())
    assert metrics["grad_norm"] > GRAD_CLIP == 1.0  # the pre-clip norm is reported
    assert seen[0].item() == pytest.approx(1.0, rel=1e-4)  # scaled down to the clip


def test_group_norm_subtracts_the_prompt_group_mean(tiny_dir):
    batch = make_batch(rewards=(1.0, -1.0, 1.0))
    batch.group_ids = torch.tensor([0, 0, 1])  # as if rows 0 and 1 answered the same prompt
    backend = TorchBackend(tiny_dir, dataclasses.replace(HP, group_norm=True))
    metrics = backend.train_step(batch)
    # group {+1, -1}: mean 0 -> A = +1 on 6 tokens, -1 on 5; singleton {+1} -> A = 0 on 4 tokens
    # token-mean advantage = (6 - 5 + 0) / 15
    assert metrics["advantage_mean"] == pytest.approx(1 / 15)
    assert metrics["num_groups"] == 2


def test_hyperparams_are_the_settings(tiny_dir):
    ppo = PPOSettings(lr=3e-5, lr_decay_steps=8, group_by="batch", advantage_estimator="grpo")
    hp = PPOHyperParams.from_settings(ppo, seed=7)
    values = dataclasses.asdict(hp)
    assert (values.pop("seed"), values.pop("opd_clip"), values.pop("group_norm")) == (7, 0.0, True)  # a baseline group
    assert values == {k: getattr(ppo, k) for k in values}
    assert PPOHyperParams.from_settings(PPOSettings(), seed=0).group_norm is False
    # top-k OPD clips its per-token term to [-1, 1]; the sampled-token term is not clipped
    from clawrl.config import OPDSettings

    assert PPOHyperParams.from_settings(ppo, 7, OPDSettings(top_k=4)).opd_clip == 1.0
    assert PPOHyperParams.from_settings(ppo, 7, OPDSettings()).opd_clip == 0.0
    # the fixed optimizer: AdamW, betas 0.9 / 0.98, no weight decay
    [group] = TorchBackend(tiny_dir, hp).optimizer.param_groups
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-5, (0.9, 0.98), 0.0)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_train_bench_reports_ppo_and_bound_rows(model_cache, backend):
    from clawrl.bench.train import run_train_bench

    rows = run_train_bench(("tiny-qwen3",), cache_dir=model_cache, batch_size=2, seq_len=16, warmup=0, repeats=1,
                           backend=backend)
    assert [r["what"] for r in rows] == ["hf_step", "ppo_step", "ppo_step_judge_ref", "ppo_step_no_ref", "ref_forward"]
    assert [r["backend"] for r in rows] == ["hf", backend, backend, backend, backend]
    assert rows[0]["vs_bound"] == 1.0 and rows[4]["vs_bound"] is None and rows[2]["vs_bound"] > 0
    assert {r["mfu"] for r in rows} == {None}  # MFU is a GPU figure
    for r in rows:  # 2 x 16 tokens per step, from the best run
        assert r["seconds"] <= r["seconds_median"]
        assert r["tokens_per_s"] == pytest.approx(32 / r["seconds"], rel=0.05)  # seconds is rounded


def test_resume_from_checkpoint_and_optimizer_state_continues_exactly(tiny_dir, tmp_path):
    hp = dataclasses.replace(HP, kl_coef=0.05)
    first, second = make_batch(seed=0), make_batch(seed=1)
    running = TorchBackend(tiny_dir, hp)
    running.train_step(first)
    ckpt = running.save_checkpoint(tmp_path / "v1")
    torch.save(running.optimizer_state_dict(), tmp_path / "optimizer.pt")  # as the trainer stores it
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert state["step"] == 1 and set(state["exp_avg"]) == set(running.param_names)
    continued = running.train_step(second)

    resumed = TorchBackend(ckpt, hp, reference_dir=tiny_dir)  # KL stays anchored at the base model
    resumed.load_optimizer_state_dict(state)
    after_resume = resumed.train_step(second)
    assert continued["kl"] > 0 and after_resume["kl"] == continued["kl"]
    ours, theirs = running.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # bit-exact continuation on CPU
    with pytest.raises(ValueError, match="optimizer state format"):
        resumed.load_optimizer_state_dict({"format": "clawrl-megatron-adamw-hf-v1", "exp_avg": {}})


def test_a_bf16_trainer_writes_served_bf16_weights_and_resumes_from_its_float32_master(tiny_dir, tmp_path):
    """model.safetensors holds what the engine serves (bfloat16, half the bytes); the float32 master
    weights beside it, under a name no model loader reads, are what a resumed trainer continues from."""
    from safetensors.torch import load_file

    from clawrl.checkpoint import MASTER_FILE, WEIGHTS_FILE, write_trainer_state
    from clawrl.engine.weights import load_checkpoint_tensors
    from clawrl.models import load_causal_lm

    hp = dataclasses.replace(HP, kl_coef=0.05)
    first, second = make_batch(seed=0), make_batch(seed=1)
    running = TorchBackend(tiny_dir, hp, dtype="bfloat16")
    running.train_step(first)
    ckpt = running.save_checkpoint(tmp_path / "v1")
    assert not (ckpt / MASTER_FILE).exists()  # what the engine loads, alone
    state = running.optimizer_state_dict()
    write_trainer_state(ckpt, running.master_weights(), state)  # the trainer's state, as the trainer stores it
    served, master = load_file(str(ckpt / WEIGHTS_FILE)), load_file(str(ckpt / MASTER_FILE))
    weights = running.hf_state_dict()
    assert set(served) == set(master) == set(weights) - {"lm_head.weight"}  # tied: the embedding
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert all(torch.equal(master[k], weights[k]) and torch.equal(served[k], weights[k].bfloat16()) for k in served)
    assert any(not torch.equal(served[k].float(), master[k]) for k in served)  # bf16 alone would not resume exactly
    fp32_bytes = sum(t.numel() * 4 for t in master.values())
    assert (ckpt / WEIGHTS_FILE).stat().st_size < 0.51 * fp32_bytes + 4096
    continued = running.train_step(second)

    resumed = TorchBackend(ckpt, hp, dtype="bfloat16", reference_dir=tiny_dir)
    assert all(torch.equal(a, b) for a, b in zip(resumed.hf_state_dict().values(), weights.values()))
    resumed.load_optimizer_state_dict(state)
    assert resumed.train_step(second)["loss"] == continued["loss"]
    ours, theirs = running.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the engine reads model.safetensors alone (a second file of the same keys would be refused)
    engine_view = load_checkpoint_tensors(ckpt, load_causal_lm(tiny_dir, dtype="bfloat16"))
    assert all(torch.equal(engine_view[k], served[k]) for k in served)


def test_the_live_state_dict_is_the_weights_a_step_leaves_with_the_tie_kept_as_one_tensor(tiny_dir):
    backend = TorchBackend(tiny_dir, HP)
    live = backend.live_state_dict()
    assert live["lm_head.weight"] is live["model.embed_tokens.weight"]  # tiny ties them: one object
    assert list(live) == list(backend.hf_state_dict())
    backend.train_step(make_batch())
    assert backend.live_state_dict() is live  # found once; the optimizer updated the same tensors in place
    copies = backend.hf_state_dict()
    assert all(torch.equal(live[k], copies[k]) for k in copies)
    assert live["model.embed_tokens.weight"].data_ptr() != copies["model.embed_tokens.weight"].data_ptr()


def _with_reference(batch, values, rows):
    """The batch as if its samples in ``rows`` had brought ``values`` as their judge-time reference log-probs."""
    has = torch.zeros(len(batch), dtype=torch.bool)
    has[list(rows)] = True
    return dataclasses.replace(batch, ref_logprobs=values * has[:, None] * batch.response_mask, has_ref=has)


def test_reference_logprobs_brought_by_the_samples_replace_the_reference_forward(tiny_dir):
    hp = dataclasses.replace(HP, kl_coef=0.1)
    backend = TorchBackend(tiny_dir, hp)
    batch = make_batch()
    computed = backend.compute_logprobs(batch, reference=True)
    # all brought: the step uses them as they are (shifted by 0.5 nats, so a forward would show)
    brought = _with_reference(batch, computed - 0.5, rows=range(4))
    torch.testing.assert_close(backend.reference_logprobs(brought), (computed - 0.5) * batch.response_mask)
    # rows 1 and 3 brought none: a reference forward fills exactly those rows
    mixed = backend.reference_logprobs(_with_reference(batch, computed - 0.5, rows=(0, 2)))
    torch.testing.assert_close(mixed[[0, 2]], (computed[[0, 2]] - 0.5) * batch.response_mask[[0, 2]])
    mask = batch.response_mask[[1, 3]]  # only response positions are part of the contract
    torch.testing.assert_close(mixed[[1, 3]] * mask, computed[[1, 3]] * mask, atol=1e-6, rtol=0)
    # none brought: the forward, as before
    torch.testing.assert_close(backend.reference_logprobs(batch), computed)
    assert not bool(batch.has_ref.any())  # samples without ref_logprobs bring none


def test_a_step_on_judge_time_reference_logprobs_equals_the_step_that_computes_them(tiny_dir):
    hp = dataclasses.replace(HP, kl_coef=0.1)
    batch = make_batch()

    def moved() -> TorchBackend:  # one step on other samples moves the policy off the reference: KL > 0
        backend = TorchBackend(tiny_dir, hp)
        backend.train_step(make_batch(seed=1))
        return backend

    own, brought = moved(), moved()
    exact = _with_reference(batch, own.compute_logprobs(batch, reference=True), rows=range(4))
    m_own, m_brought = own.train_step(batch), brought.train_step(exact)
    assert m_own["reference_from_judge"] == 0.0 and m_brought["reference_from_judge"] == 1.0
    assert m_own["kl"] > 1e-4
    for key in ("loss", "kl", "policy_loss", "grad_norm"):
        assert m_brought[key] == pytest.approx(m_own[key], rel=1e-5, abs=1e-7), key
    # a reference 1 nat lower everywhere makes the policy look further from it: larger KL
    far = moved().train_step(
        _with_reference(batch, own.compute_logprobs(batch, reference=True) - 1.0, rows=range(4)))
    assert far["kl"] > m_own["kl"] + 0.1


def test_a_topk_opd_step_follows_the_topk_gap_not_the_sampled_token_gap(tiny_dir):
    """Top-k OPD: G_t = sum_j p~(j) (teacher(j) - policy(j)) over the policy's top-k, clipped to
    [-1, 1]. Sample 0's teacher gives the top-k more mass (G = +0.5), sample 1's less (G = -2 -> -1);
    their sampled-token teacher log-probs say the opposite and must not be read."""
    g = torch.Generator().manual_seed(3)
    recs = []
    for i, (student, teacher, sampled) in enumerate([([-1.0, -2.0], [-0.5, -1.5], -20.0),
                                                     ([-1.0, -2.0], [-3.0, -4.0], -0.01)]):
        T = 5
        recs.append(SampleRecord(
            sample_id=f"s{i}", turn_id=f"t{i}", session_id="sess", judge_config_hash="h",
            method="on_policy_distillation", prompt_ids=torch.randint(3, 5000, (4,), generator=g).tolist(),
            output_ids=torch.randint(3, 5000, (T,), generator=g).tolist(), rollout_logprobs=[-10.8] * T, reward=0.0,
            has_teacher=True, teacher_logprobs=[sampled] * T, weight_version="v0",
            topk_ids=[[1, 2]] * T, student_topk_logprobs=[student] * T, teacher_topk_logprobs=[teacher] * T))
    batch = collate_samples(recs, pad_id=PAD)
    assert batch.student_topk_logprobs.shape == (2, 8, 2) and batch.has_topk.tolist() == [True, True]
    hp = dataclasses.replace(HP, advantage_estimator=Method.OPD, opd_clip=1.0)
    backend = TorchBackend(tiny_dir, hp)
    before = seq_mean_logprob(backend.compute_logprobs(batch), batch)
    metrics = backend.train_step(batch)
    after = seq_mean_logprob(backend.compute_logprobs(batch), batch)
    assert metrics["topk_fraction"] == 1.0
    assert metrics["advantage_mean"] == pytest.approx((0.5 - 1.0) / 2)  # clipped: +0.5 and -1 on 5 tokens each
    delta = (after - before).tolist()
    assert delta[0] > 0 and delta[1] < 0
