"""PPO loss: hand-computed values, one property test per advantage sign, and the composed loss
against a per-token Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from clawrl.algo.losses import (
    CLIP_HIGH,
    CLIP_LOW,
    compute_kl,
    compute_policy_loss,
    compute_ppo_loss,
    compute_tis_weights,
    merge_metrics,
    token_mean,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def test_the_fixed_clip_range_is_0_8_to_1_28():
    assert (CLIP_LOW, CLIP_HIGH) == (EPS_LOW, EPS_HIGH)  # the values the hand computations below assume


def _pg(ratio: float, adv: float):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    pg, r, clipped = compute_policy_loss(lp, torch.zeros(1, 1), torch.tensor([[adv]]))
    pg.sum().backward()
    return pg.item(), lp.grad.item(), bool(clipped)


def test_policy_loss_by_hand():
    # A=+1, r=1.5: max(-1.5, -1.28) = -1.28, clip changed the objective
    assert _pg(1.5, 1.0)[0] == pytest.approx(-1.28) and _pg(1.5, 1.0)[2]
    # A=+1, r=0.5: max(-0.5, -0.8) = -0.5, unclipped (the clip only binds on the profitable side)
    assert _pg(0.5, 1.0)[0] == pytest.approx(-0.5) and not _pg(0.5, 1.0)[2]
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8, clipped
    assert _pg(0.5, -1.0)[0] == pytest.approx(0.8) and _pg(0.5, -1.0)[2]
    # A=-1, r=1.5: max(1.5, 1.28) = 1.5, unclipped; A=-2, r=1.1: max(2.2, 2.2) = 2.2
    assert _pg(1.5, -1.0)[0] == pytest.approx(1.5) and not _pg(1.5, -1.0)[2]
    assert _pg(1.1, -2.0)[0] == pytest.approx(2.2)


@pytest.mark.parametrize("ratio", [1.2801, 1.35, 2.0, 10.0])
def test_policy_loss_clipped_for_high_ratio_with_positive_advantage(ratio):
    loss, grad, clipped = _pg(ratio, 0.7)
    assert loss == pytest.approx(-0.7 * (1 + EPS_HIGH))  # -A (1 + eps_high)
    assert grad == 0.0 and clipped  # no push beyond the trust region


@pytest.mark.parametrize("ratio", [0.7999, 0.5, 0.1])
def test_policy_loss_clipped_for_low_ratio_with_negative_advantage(ratio):
    loss, grad, clipped = _pg(ratio, -0.7)
    assert loss == pytest.approx(0.7 * (1 - EPS_LOW))  # -A (1 - eps_low)
    assert grad == 0.0 and clipped


@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.0, 1.1, 1.5])
def test_policy_loss_unclipped_inside_trust_region_or_unprofitable_side(ratio):
    # A > 0 with r < 1+eps_high, or A < 0 with r > 1-eps_low: gradient of -A r is -A r (d log r)
    for adv in (0.7, -0.7):
        if (adv > 0 and ratio > 1 + EPS_HIGH) or (adv < 0 and ratio < 1 - EPS_LOW):
            continue
        loss, grad, clipped = _pg(ratio, adv)
        assert loss == pytest.approx(-adv * ratio) and grad == pytest.approx(-adv * ratio) and not clipped


def test_tis_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-2.0, -1.0, -1.0]])
    w = compute_tis_weights(old, rollout)
    # exp(1) = 2.718 -> capped at 2.0; exp(-1) = 0.3679; exp(0) = 1
    assert w[0].tolist() == pytest.approx([2.0, 0.36788, 1.0], abs=1e-5)
    assert not w.requires_grad  # detached: a weight, not a path for gradients


def test_k3_kl_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    # k3 = exp(ref - lp) - (ref - lp) - 1: exp(-1) + 1 - 1 = 0.36788 ; exp(1) - 1 - 1 = 0.71828
    assert compute_kl(lp, ref).tolist() == pytest.approx([0.36788, 0.71828], abs=1e-5)
    assert compute_kl(lp, lp).tolist() == [0.0, 0.0]  # the same distribution: no divergence


def test_token_mean_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert token_mean(v, m).item() == 2.5  # (1+2+3+4)/4
    assert token_mean(v, m, num_tokens=8).item() == 1.25  # 10/8: share of a bigger batch
    assert token_mean(v, torch.zeros_like(m)).item() == 0.0  # no token: 0, not 0/0


def test_clip_frac_counts_tokens_where_clip_changed_objective():
    lp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.0, 9.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    _, m = compute_ppo_loss(lp, torch.zeros(1, 5), adv, mask)
    # tokens 0 (A>0, r=1.5) and 2 (A<0, r=0.5) clipped; token 4 clipped but masked -> 2/4
    assert m["clip_frac"] == 0.5
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)  # masked 9.0 ignored
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.0) / 4)


def _loop_ppo_loss(lp, old, adv, mask, rollout, ref, *, kl_coef):
    """Independent reference: one sample, one token at a time, plain floats; the token mean."""
    total_pg = total_kl = 0.0
    n = 0
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            n += 1
            r = math.exp(lp[i][t] - old[i][t])
            a = adv[i][t]
            loss = max(-a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH))
            w = min(math.exp(old[i][t] - rollout[i][t]), 2.0)
            d = lp[i][t] - ref[i][t]
            total_pg, total_kl = total_pg + w * loss, total_kl + math.exp(-d) + d - 1
    return total_pg / n + kl_coef * total_kl / n


def _random_inputs(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + torch.randn(B, T, generator=g) * 0.4  # ratios spread around 1, many clipped
    rollout = old + torch.randn(B, T, generator=g) * 0.5
    ref = old + torch.randn(B, T, generator=g) * 0.3
    ent = torch.rand(B, T, generator=g) * 4
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1.0  # every sequence has a response token
    return lp, old, adv, mask, rollout, ref, ent


def test_ppo_loss_matches_per_token_loop():
    lp, old, adv, mask, rollout, ref, ent = _random_inputs(3)
    loss, metrics = compute_ppo_loss(lp.double(), old.double(), adv.double(), mask.double(),
                                     rollout_logprobs=rollout.double(), ref_logprobs=ref.double(),
                                     entropy=ent.double(), kl_coef=0.05)
    expected = _loop_ppo_loss(*(x.double().tolist() for x in (lp, old, adv, mask, rollout, ref)), kl_coef=0.05)
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-9)
    # the entropy is reported (its token mean), never part of the loss
    assert metrics["entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-6)


def test_micro_batches_with_global_counts_sum_to_full_batch():
    lp, old, adv, mask, rollout, ref, ent = _random_inputs(4, B=6)
    full_loss, full = compute_ppo_loss(lp, old, adv, mask, rollout_logprobs=rollout, ref_logprobs=ref,
                                       entropy=ent, kl_coef=0.05)
    parts, total = [], 0.0
    for s in (slice(0, 1), slice(1, 4), slice(4, 6)):
        loss, m = compute_ppo_loss(lp[s], old[s], adv[s], mask[s], rollout_logprobs=rollout[s],
                                   ref_logprobs=ref[s], entropy=ent[s], kl_coef=0.05, num_tokens=float(mask.sum()))
        total += loss.item()
        parts.append(m)
    merged = merge_metrics(parts)
    assert total == pytest.approx(full_loss.item(), rel=1e-5)
    for key, value in full.items():
        assert merged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_ppo_loss_gradient_sign_follows_advantage():
    old = torch.full((1, 2), -2.0)
    lp = old.clone().requires_grad_(True)
    loss, _ = compute_ppo_loss(lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    # token-mean over 2 tokens at r=1: d/dlp (-A r)/2 = -A/2 -> [-0.5, +0.5]
    assert lp.grad.tolist() == [[-0.5, 0.5]]


def test_ppo_loss_requires_the_reference_its_kl_coefficient_uses():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_ppo_loss(x, x, x, x + 1, kl_coef=0.1)


def test_diverged_masked_token_does_not_poison_loss():
    lp = torch.tensor([[-1.0, 0.0]])
    old = torch.tensor([[-1.0, -500.0]])  # masked position with a huge log-ratio
    loss, m = compute_ppo_loss(lp, old, torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(-1.0)  # only token 0: -A r = -1
