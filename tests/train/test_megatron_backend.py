"""The Megatron backend against the torch backend (same batch, same seed: same loss, same updated
weights), the CPU shims, the SDPA core attention, vocab-parallel log-probs by hand, and checkpoints
that transformers loads. Tensor and data parallel 2 against one process: tests/train/test_trainer_distributed.py."""

from __future__ import annotations

import math

import pytest
import torch

from clawrl.config import PPOSettings
from clawrl.records import SampleRecord
from clawrl.train.base import GRAD_CLIP, PPOHyperParams
from clawrl.train.batch import collate_samples

# megatron-core 0.16.1 warns about Transformer Engine/Apex being absent and deprecated arguments
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron", "ignore::UserWarning:megatron",
                                        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

def _hp(**overrides) -> PPOHyperParams:
    ppo = PPOSettings(**{"advantage_estimator": "combine", "lr": 1e-3, "micro_batch_size": 2, "kl_coef": 0.1,
                         "w_opd": 0.5, **overrides})
    return PPOHyperParams.from_settings(ppo, seed=0)


def _batch(vocab: int, seed: int = 0):
    """5 samples of different lengths (3 micro-batches of 2, 2, 1), rewards +1/-1/0, a teacher on
    some; rollout log-probs near the tiny models' ~log(1/49152) = -10.8, so TIS weights vary."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, t) in enumerate([(3, 5), (6, 2), (4, 9), (8, 3), (5, 6)]):
        ids = torch.randint(0, vocab, (p + t,), generator=g).tolist()
        teacher = (-torch.rand(t, generator=g) * 12).tolist() if i % 2 == 0 else None
        samples.append(SampleRecord(
            sample_id=f"s{i}", turn_id=f"t{i}", session_id="x", judge_config_hash="", method="combine",
            prompt_ids=ids[:p], output_ids=ids[p:], rollout_logprobs=(-9.8 - 2 * torch.rand(t, generator=g)).tolist(),
            reward=[1.0, -1.0, 0.0, 1.0, -1.0][i], has_teacher=teacher is not None, teacher_logprobs=teacher,
            weight_version="0"))
    return collate_samples(samples, pad_id=2)


def _assert_same_updated_weights(a: dict, b: dict, lr: float = 1e-3) -> None:
    """Same weights after AdamW steps at ``lr``, up to float32 rounding.

    AdamW's first step is lr * g / (|g| + eps), whose slope at |g| ~ eps = 1e-8 is
    lr / (4 eps) = 2.5e4: a gradient element that is a near-total cancellation (|g| ~ 1e-8,
    rounding ~1e-9) can land ~2e-5 apart although the gradients agree to 1e-9. So: every weight
    within lr / 20, and at most 1 element in 100,000 more than 1e-6 apart."""
    assert set(a) == set(b)
    diffs = torch.cat([(w - b[k]).abs().flatten() for k, w in a.items()])
    assert diffs.max().item() < lr / 20
    assert (diffs > 1e-6).sum().item() <= diffs.numel() // 100_000


@pytest.fixture(scope="module")
def megatron_tp1():
    from clawrl.train.megatron_shims import init_megatron, shutdown_megatron

    runtime = init_megatron(1, seed=0)
    yield runtime
    shutdown_megatron(runtime)


# --------------------------------------------------------------------------------------------
# the key test: both backends, one batch


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_both_backends_give_same_loss_and_updated_weights(megatron_tp1, tiny_dir, tiny_qwen3_dir, name):
    from clawrl.train.megatron_backend import MegatronBackend
    from clawrl.train.megatron_model import load_hf_state_dict
    from clawrl.train.torch_backend import TorchBackend

    model_dir = {"tiny": tiny_dir, "tiny-qwen3": tiny_qwen3_dir}[name]
    hp = _hp()
    batch = _batch(49152)
    tb = TorchBackend(model_dir, hp)
    mb = MegatronBackend(model_dir, hp)
    # two steps: the second starts off the reference, so its KL term is not 0
    for step in range(2):
        m_torch, m_mcore = tb.train_step(batch), mb.train_step(batch)
        # float32 on CPU, same formulas; only the summation order inside GEMMs and reductions differs
        for key in ("loss", "policy_loss", "kl", "entropy", "tis_weight_mean"):
            assert abs(m_torch[key] - m_mcore[key]) < 1e-5, (step, key, m_torch[key], m_mcore[key])
        assert m_torch["grad_norm"] > GRAD_CLIP  # the clipped path is the one compared
        assert m_torch["grad_norm"] == pytest.approx(m_mcore["grad_norm"], rel=1e-4)  # a sum of 6.4M squares
    assert m_torch["kl"] > 1e-4
    assert m_torch["num_tokens"] == m_mcore["num_tokens"] == 25.0  # 5 + 2 + 9 + 3 + 6 output tokens
    torch_backend_weights, mcore_weights = tb.hf_state_dict(), mb.hf_state_dict()
    initial = load_hf_state_dict(model_dir)
    assert set(mcore_weights) == set(torch_backend_weights)
    moved = max((torch_backend_weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 5e-4  # AdamW moves a weight by up to ~lr = 1e-3 per step: the comparison is not vacuous
    _assert_same_updated_weights(torch_backend_weights, mcore_weights)  # seen: 2.4e-5 max, 8 of 6.4M > 1e-6


def test_reference_model_stays_at_initial_weights(megatron_tp1, tiny_qwen3_dir):
    from clawrl.train.megatron_backend import MegatronBackend

    mb = MegatronBackend(tiny_qwen3_dir, _hp())
    batch = _batch(49152, seed=1)
    ref_before, policy_before = mb.compute_logprobs(batch, reference=True), mb.compute_logprobs(batch)
    assert torch.equal(ref_before, policy_before)
    mb.train_step(batch)
    assert torch.equal(mb.compute_logprobs(batch, reference=True), ref_before)
    changed = (mb.compute_logprobs(batch) - policy_before).abs() * batch.response_mask
    assert changed.max() > 1e-4
    # past each sequence's end the log-probs are 0, as in the torch backend
    assert policy_before[1, 7:].abs().sum() == 0  # sample 1 has 6 + 2 = 8 tokens: 7 next-token positions


def test_no_reference_without_kl(megatron_tp1, tiny_dir):
    from clawrl.train.megatron_backend import MegatronBackend

    mb = MegatronBackend(tiny_dir, _hp(kl_coef=0.0))
    assert mb.reference is None
    # attention "auto" on the CPU: Megatron's own local attention (SDPA is what it picks on CUDA)
    assert type(mb.model.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    with pytest.raises(ValueError, match="kl_coef > 0"):
        mb.compute_logprobs(_batch(49152), reference=True)


def test_cuda_device_or_bf16_without_cuda_is_refused(tiny_dir):
    from clawrl.train.megatron_backend import MegatronBackend

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only machine's refusal")
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        MegatronBackend(tiny_dir, _hp(), device="cuda")
    with pytest.raises(ValueError, match="runs float32 on CPU"):
        MegatronBackend(tiny_dir, _hp(), dtype="bfloat16")


# --------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_loads_in_transformers_with_the_trained_weights(megatron_tp1, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawrl.train.megatron_backend import MegatronBackend

    mb = MegatronBackend(tiny_dir, _hp(kl_coef=0.0))
    batch = _batch(49152, seed=2)
    mb.train_step(batch)
    out = mb.save_checkpoint(tmp_path / "step-1")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    state = mb.hf_state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key  # tied lm_head included, like HF's state_dict
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size == 49152
    with torch.no_grad():
        logits = loaded(input_ids=batch.input_ids).logits[:, :-1]
    hf_lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ours = mb.compute_logprobs(batch)
    assert ((hf_lp - ours).abs() * batch.attention_mask[:, 1:]).max() < 1e-4
    with pytest.raises(FileExistsError):
        mb.save_checkpoint(out)


def test_resume_from_checkpoint_and_optimizer_state_continues_exactly(megatron_tp1, tiny_qwen3_dir, tmp_path):
    from clawrl.train.megatron_backend import MegatronBackend

    hp = _hp()
    first, second = _batch(49152, seed=4), _batch(49152, seed=5)
    a = MegatronBackend(tiny_qwen3_dir, hp)
    a.train_step(first)
    ckpt = a.save_checkpoint(tmp_path / "v1")
    opt = a.optimizer_state_dict()
    assert opt["step"] == 1 and set(opt["exp_avg"]) == set(a.hf_state_dict())  # untied: lm_head too
    assert opt["exp_avg_sq"]["model.norm.weight"].shape == (64,)

    b = MegatronBackend(ckpt, hp, reference_dir=tiny_qwen3_dir)
    b.load_optimizer_state_dict(opt)
    # the reference is the base model, not the checkpoint it resumed from
    assert torch.equal(b.compute_logprobs(second, reference=True), a.compute_logprobs(second, reference=True))
    ma, mb = a.train_step(second), b.train_step(second)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    wa, wb = a.hf_state_dict(), b.hf_state_dict()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key  # bit-identical: same weights, moments and step count
    with pytest.raises(ValueError, match="optimizer state format"):
        b.load_optimizer_state_dict({"format": "torch", "exp_avg": {}})


# --------------------------------------------------------------------------------------------
# attention and log-probs


def test_sdpa_and_local_attention_give_same_logits(megatron_tp1, tiny_qwen3_dir):
    from transformers import AutoConfig

    from clawrl.train.convert import hf_to_megatron, megatron_config_from_hf
    from clawrl.train.megatron_model import build_gpt_model, load_hf_state_dict, load_megatron_weights

    cfg = AutoConfig.from_pretrained(str(tiny_qwen3_dir))
    args = megatron_config_from_hf(cfg, dtype=torch.float32, tp=1)
    weights = hf_to_megatron(load_hf_state_dict(tiny_qwen3_dir), cfg)
    ids = torch.randint(0, 49152, (3, 40), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(40).expand(3, 40)
    logits = {}
    for attention in ("local", "sdpa"):
        model = build_gpt_model(args, attention=attention)
        load_megatron_weights(model, weights)
        with torch.no_grad():
            logits[attention] = model.eval()(input_ids=ids, position_ids=pos, attention_mask=None)
    kind = type(model.decoder.layers[0].self_attention.core_attention).__name__
    assert kind == "SDPACoreAttention"
    assert (logits["local"] - logits["sdpa"]).abs().max() < 1e-5
    # an explicit mask (True = masked) equal to the causal one gives the same result
    with torch.no_grad():
        causal = torch.triu(torch.ones(1, 1, 40, 40, dtype=torch.bool), diagonal=1)
        masked = model(input_ids=ids, position_ids=pos, attention_mask=causal)
    assert (masked - logits["sdpa"]).abs().max() < 1e-5


def test_vocab_parallel_logprobs_by_hand():
    from clawrl.train.megatron_model import compute_vocab_parallel_logprobs

    # logits [0, 0, ln 2] over a vocab of 3, plus one padding column (7.0) that must take no mass:
    # softmax = [1/4, 1/4, 1/2]; target 2 -> log(1/2) = -0.693147
    # H = -(2 * 1/4 * log(1/4) + 1/2 * log(1/2)) = 1.5 * ln 2 = 1.039721
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0), 7.0]]], requires_grad=True)
    lp, ent = compute_vocab_parallel_logprobs(logits, torch.tensor([[2]]), vocab_start=0, vocab_size=3)
    assert lp.item() == pytest.approx(-math.log(2.0), abs=1e-6)
    assert ent.item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6) and not ent.requires_grad  # reported only
    lp.sum().backward()
    # d lp / d z = onehot(2) - softmax = [-1/4, -1/4, 1/2]; the padding column gets no gradient
    assert logits.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.5, 0.0], abs=1e-6)


# --------------------------------------------------------------------------------------------
# CPU shims


def test_cpu_shims_are_idempotent_and_fork_the_cpu_generator():
    if torch.cuda.is_available():
        pytest.skip("the shims are never applied when CUDA is available")
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core import tensor_parallel

    from clawrl.train.megatron_shims import apply_cpu_shims

    draws = []
    for _ in range(2):
        assert apply_cpu_shims(seed=5) is True
        torch.manual_seed(123)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            inside = torch.rand(3)
        draws.append((inside, torch.rand(3)))
    assert torch.equal(draws[0][0], draws[1][0])  # re-applying with one seed resets the stream
    torch.manual_seed(123)
    assert torch.equal(draws[0][1], torch.rand(3))  # the fork did not advance the default generator
    assert torch.cuda.current_device() == torch.device("cpu")  # shim B
    assert fused_softmax.get_default_causal_mask(3).tolist() == [  # shim C, True = masked
        [False, True, True], [False, False, True], [False, False, False]]
