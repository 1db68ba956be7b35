"""Advantages: hand-computed values, and each estimator against a per-token Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from clawrl.algo.advantages import (
    compute_advantages,
    compute_combine_advantages,
    compute_grpo_advantages,
    compute_opd_advantages,
    normalize_group_rewards,
    topk_opd_gap,
)
from clawrl.records import Method

MASK = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TEACHER = torch.tensor([[-9.0, -1.0, -2.0], [-0.5, -3.0, -7.0]])
OLD = torch.tensor([[-1.0, -1.5, -1.0], [-0.5, -1.0, -1.0]])


def test_grpo_broadcasts_reward_over_response_tokens_only():
    adv = compute_grpo_advantages(torch.tensor([1.0, -1.0]), MASK)
    # row 0: R=+1 on positions 1,2; row 1: R=-1 on positions 0,1; 0 outside the mask
    assert adv.tolist() == [[0.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]


def test_opd_is_teacher_minus_old_and_zero_without_teacher():
    adv = compute_opd_advantages(TEACHER, OLD, MASK, torch.tensor([True, False]))
    # row 0: pos1 -1.0 - (-1.5) = 0.5; pos2 -2.0 - (-1.0) = -1.0; pos0 masked
    # row 1: no teacher -> 0 everywhere, although teacher - old = 0, -2 there
    assert adv.tolist() == [[0.0, 0.5, -1.0], [0.0, 0.0, 0.0]]


def test_combine_weights_the_opd_term():
    adv = compute_combine_advantages(torch.tensor([1.0, -1.0]), TEACHER, OLD, MASK,
                                     torch.tensor([True, True]), w_opd=2.0)
    # row 0: 1 + 2*0.5 = 2.0 ; 1 + 2*(-1.0) = -1.0
    # row 1: -1 + 2*(-0.5 - (-0.5)) = -1.0 ; -1 + 2*(-3 - (-1)) = -5.0
    assert adv.tolist() == [[0.0, 2.0, -1.0], [-1.0, -5.0, 0.0]]


def test_combine_masks_opd_term_for_samples_without_teacher():
    # The reference copies rollout logprobs into the teacher slot of RL-only samples; any
    # rollout-vs-train drift then leaks into A. Here teacher != old but has_teacher is False.
    drifted = OLD + 0.3
    adv = compute_combine_advantages(torch.tensor([1.0, -1.0]), drifted, OLD, MASK,
                                     torch.tensor([False, False]), w_opd=1.0)
    assert torch.equal(adv, compute_grpo_advantages(torch.tensor([1.0, -1.0]), MASK))


def test_group_mean_subtraction_by_hand():
    r = torch.tensor([1.0, -1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 7, 7])
    # group 0: mean 0 -> [1, -1]; group 7: mean 1 -> [0, 0] (no signal in a uniform group)
    assert normalize_group_rewards(r, g).tolist() == [1.0, -1.0, 0.0, 0.0]


def test_singleton_groups_give_zero_reward():
    r = torch.tensor([1.0, -1.0, 1.0])
    assert normalize_group_rewards(r, torch.tensor([0, 1, 2])).tolist() == [0.0, 0.0, 0.0]


def _loop_advantages(method, reward, teacher, old, mask, has_teacher, w_opd):
    """Independent reference: one sample and one token at a time, plain floats."""
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i][t] == 0:
                continue
            gap = (teacher[i][t] - old[i][t]) if has_teacher[i] else 0.0
            if method == "grpo":
                out[i][t] = reward[i]
            elif method == "on_policy_distillation":
                out[i][t] = gap
            else:
                out[i][t] = reward[i] + w_opd * gap
    return out


def _loop_group_norm(reward, groups):
    out = []
    for i, r in enumerate(reward):
        members = [reward[j] for j in range(len(reward)) if groups[j] == groups[i]]
        out.append(r - sum(members) / len(members))
    return out


@pytest.mark.parametrize("method", list(Method))
def test_estimators_match_per_token_loop(method):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    reward = torch.randint(-1, 2, (B,), generator=g).float()
    teacher = -torch.rand(B, T, generator=g) * 5
    old = -torch.rand(B, T, generator=g) * 5
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    has_teacher = torch.rand(B, generator=g) > 0.4
    fast = compute_advantages(method, reward=reward, teacher_logprobs=teacher, old_logprobs=old,
                              mask=mask, has_teacher=has_teacher, w_opd=1.3)
    slow = _loop_advantages(method.value, reward.tolist(), teacher.tolist(), old.tolist(), mask.tolist(),
                            has_teacher.tolist(), 1.3)
    torch.testing.assert_close(fast, torch.tensor(slow), atol=1e-6, rtol=0)


def test_group_norm_matches_loop():
    g = torch.Generator().manual_seed(2)
    reward = torch.randint(-1, 2, (12,), generator=g).float()
    groups = torch.randint(0, 4, (12,), generator=g)
    slow = _loop_group_norm(reward.tolist(), groups.tolist())
    torch.testing.assert_close(normalize_group_rewards(reward, groups), torch.tensor(slow), atol=1e-6, rtol=0)


def test_dispatch_accepts_enum_values_as_strings():
    kw = dict(reward=torch.tensor([1.0, -1.0]), teacher_logprobs=TEACHER, old_logprobs=OLD, mask=MASK,
              has_teacher=torch.tensor([True, True]))
    assert torch.equal(compute_advantages("grpo", **kw), compute_advantages(Method.GRPO, **kw))


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        compute_advantages("ppo_gae", reward=torch.zeros(1), teacher_logprobs=torch.zeros(1, 1),
                           old_logprobs=torch.zeros(1, 1), mask=torch.ones(1, 1),
                           has_teacher=torch.ones(1, dtype=torch.bool))
    assert "'ppo_gae'" in str(e.value)
    assert "grpo, on_policy_distillation, combine" in str(e.value)


# top-k OPD, k = 2, one sample with 2 output positions (log-probs of exact probabilities):
#   position 0: policy p = (0.6, 0.2) -> renormalised (0.75, 0.25); teacher (0.3, 0.4)
#     G = 0.75 ln(0.3/0.6) + 0.25 ln(0.4/0.2) = -0.75 ln 2 + 0.25 ln 2 = -0.5 ln 2 = -0.346574
#   position 1: policy (0.5, 0.5) -> (0.5, 0.5); teacher (0.05, 0.5)
#     G = 0.5 ln(0.05/0.5) + 0.5 ln 1 = 0.5 ln 0.1 = -1.151293, clipped at 1.0 -> -1.0
STUDENT_TOPK = torch.tensor([[[0.6, 0.2], [0.5, 0.5]]]).log()
TEACHER_TOPK = torch.tensor([[[0.3, 0.4], [0.05, 0.5]]]).log()
G_HAND = [-0.5 * math.log(2.0), 0.5 * math.log(0.1)]


def test_topk_opd_gap_by_hand():
    assert topk_opd_gap(STUDENT_TOPK, TEACHER_TOPK)[0].tolist() == pytest.approx(G_HAND, abs=1e-6)


def test_topk_opd_advantage_is_clipped_per_token_and_weighted_in_combine():
    mask, has = torch.ones(1, 2), torch.tensor([True])
    topk = (STUDENT_TOPK, TEACHER_TOPK, torch.tensor([True]))
    sampled = torch.full((1, 2), -20.0)  # the sampled-token gap, ignored for a top-k row
    free = compute_opd_advantages(sampled, torch.zeros(1, 2), mask, has, topk=topk)
    assert free[0].tolist() == pytest.approx(G_HAND, abs=1e-6)
    clipped = compute_opd_advantages(sampled, torch.zeros(1, 2), mask, has, topk=topk, opd_clip=1.0)
    assert clipped[0].tolist() == pytest.approx([G_HAND[0], -1.0], abs=1e-6)
    # combine: R + w_opd*clip(G), R = +1, w_opd = 0.5
    combine = compute_advantages("combine", reward=torch.tensor([1.0]), teacher_logprobs=sampled,
                                 old_logprobs=torch.zeros(1, 2), mask=mask, has_teacher=has, w_opd=0.5,
                                 topk=topk, opd_clip=1.0)
    assert combine[0].tolist() == pytest.approx([1.0 + 0.5 * G_HAND[0], 0.5], abs=1e-6)
    # no teacher -> no OPD term whatever the top-k rows hold
    assert compute_opd_advantages(sampled, torch.zeros(1, 2), mask, torch.tensor([False]), topk=topk).abs().max() == 0


def test_topk_rows_and_sampled_token_rows_mix_and_k1_is_the_sampled_gap():
    # row 0: top-k (k = 1: the policy's top-1 with log-prob -0.2, the teacher's -0.7 -> G = -0.5);
    # row 1: no top-k rows, today's teacher_lp - old_lp
    student = torch.tensor([[[-0.2], [-0.2], [-0.2]], [[0.0], [0.0], [0.0]]])
    teacher = torch.tensor([[[-0.7], [-0.7], [-0.7]], [[0.0], [0.0], [0.0]]])
    adv = compute_opd_advantages(TEACHER, OLD, MASK, torch.tensor([True, True]),
                                 topk=(student, teacher, torch.tensor([True, False])), opd_clip=1.0)
    # clip 1.0 also bounds the sampled-token rows: row 1 pos 1 is -3 - (-1) = -2 -> -1
    assert adv.flatten().tolist() == pytest.approx([0.0, -0.5, -0.5, 0.0, -1.0, 0.0])
