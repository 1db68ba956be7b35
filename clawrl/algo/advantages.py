"""Per-token advantages for the three methods that share one PPO objective.

    GRPO     A_t = R                                          (judge score, broadcast)
    OPD      A_t = clip(G_t)                                  (per token)
    COMBINE  A_t = R + w_opd * clip(G_t)                      (``[ppo] w_opd`` sets the balance)

with the per-token OPD gap G_t, for a sample with a teacher (0 for one without):

    sampled-token OPD   G_t = teacher_lp_t - old_lp_t
    top-k OPD           G_t = sum_{j in K_t} p~_t(j) * (tlp_t(j) - slp_t(j)),
                        p~_t(j) = exp(slp_t(j)) / sum_{i in K_t} exp(slp_t(i))

where K_t are the policy's k most likely ids at position t, slp_t / tlp_t the policy's / the
teacher's log-probs of them (full-vocabulary log_softmax, both scored at judge time) and p~_t the
policy's top-k probabilities renormalised. G_t is minus a reverse KL(policy || teacher) restricted to
K_t: it is 0 where the teacher agrees with the policy on its likely tokens, negative where the
teacher (given the hint) gives them less mass. With k = 1 and the sampled token the policy's top-1
it is the sampled-token gap, with the judge-time policy log-prob in place of old_lp.
``clip(G) = clamp(G, -c, c)`` with c = ``opd_clip`` (1 with top-k OPD, else 0 = no clip) bounds
one token's OPD advantage (before ``w_opd``); the reward term is never clipped.

Shapes: B samples, T = L-1 next-token positions; per-token tensors are (B, T) aligned with
``input_ids[:, 1:]`` and zero outside ``mask`` (the response tokens).

Where we depart from textbook GRPO / the reference (OpenClaw-RL):
  1. No std division. Rewards are -1/0/+1 and a group is often 1-3 samples: dividing by the
     group std turns a 7:1 split into a -2.6 advantage for the odd one out, is undefined for a
     uniform group, and weights prompts by how (un)certain the policy is (the "question-level
     difficulty bias" of Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).
  2. Group-mean subtraction is optional (off by default): live traffic rarely repeats a prompt,
     and a sample alone in its group would get A = 0. Groups are identical prompt ids.
  3. The OPD term is masked to zero for samples without a teacher. The reference fills their
     teacher log-probs with the rollout log-probs, which leaks the rollout-vs-train drift
     (rollout_lp - old_lp != 0) into their advantage.
  4. ``old_lp`` is the trainer's log-prob before the step, never the engine's: engine-vs-trainer
     drift is handled by truncated importance sampling in the loss, not baked into A.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from clawrl.records import Method


def normalize_group_rewards(reward: Tensor, group_ids: Tensor) -> Tensor:
    """R_i - mean_{j in g(i)} R_j. reward: (B,) float; group_ids: (B,) long. Returns (B,)."""
    # one-hot sums instead of index_add_/scatter: B is small, and this is deterministic on every device
    onehot = (group_ids[:, None] == torch.unique(group_ids)[None, :]).to(reward.dtype)  # (B, G)
    mean = (onehot * reward[:, None]).sum(0) / onehot.sum(0)  # mean_g  (G,)
    return reward - onehot @ mean  # R_i - mean_g(i)  (B,)


def compute_grpo_advantages(reward: Tensor, mask: Tensor) -> Tensor:
    """A_t = R, broadcast over the response tokens.

    reward: (B,); mask: (B, T). Returns (B, T)."""
    return reward[:, None] * mask  # A_t = R  (B, T)


def topk_opd_gap(student_topk: Tensor, teacher_topk: Tensor) -> Tensor:
    """G_t = sum_j p~_t(j) (tlp_t(j) - slp_t(j)), p~_t = softmax of slp_t over the k entries.

    student_topk, teacher_topk: (B, T, k) log-probs. Returns (B, T) (0 where k = 0)."""
    weights = torch.softmax(student_topk, dim=-1)  # p~_t(j) = p_t(j) / sum_{i in K_t} p_t(i)  (B, T, k)
    return (weights * (teacher_topk - student_topk)).sum(-1)  # (B, T)


def _opd_gap(teacher_logprobs: Tensor, old_logprobs: Tensor, has_teacher: Tensor, topk: tuple | None,
             opd_clip: float) -> Tensor:
    """clip(G_t) where the sample has a teacher, else 0 (module docstring). ``topk``: None or
    (student_topk (B, T, k), teacher_topk (B, T, k), has_topk (B,) bool): rows with has_topk use the
    top-k gap, the others the sampled-token gap."""
    gap = teacher_logprobs - old_logprobs  # sampled-token OPD  (B, T)
    if topk is not None and bool(topk[2].any()):
        gap = torch.where(topk[2][:, None], topk_opd_gap(topk[0], topk[1]), gap)
    if opd_clip > 0:
        gap = gap.clamp(-opd_clip, opd_clip)
    return gap * has_teacher[:, None]  # (B, T)


def compute_opd_advantages(teacher_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                           has_teacher: Tensor, *, topk: tuple | None = None, opd_clip: float = 0.0) -> Tensor:
    """A_t = clip(G_t) where the sample has a teacher, else 0.

    *_logprobs, mask: (B, T); has_teacher: (B,) bool; ``topk`` as in :func:`_opd_gap`. Returns (B, T)."""
    return _opd_gap(teacher_logprobs, old_logprobs, has_teacher, topk, opd_clip) * mask  # (B, T)


def compute_combine_advantages(reward: Tensor, teacher_logprobs: Tensor, old_logprobs: Tensor,
                               mask: Tensor, has_teacher: Tensor, w_opd: float, *,
                               topk: tuple | None = None, opd_clip: float = 0.0) -> Tensor:
    """A_t = R + w_opd*clip(G_t), the OPD term only where has_teacher.

    reward, has_teacher: (B,); *_logprobs, mask: (B, T). Returns (B, T)."""
    opd = _opd_gap(teacher_logprobs, old_logprobs, has_teacher, topk, opd_clip)  # (B, T)
    return (reward[:, None] + w_opd * opd) * mask  # R + w_opd*clip(G_t)  (B, T)


_ESTIMATORS: dict[Method, Callable[..., Tensor]] = {
    Method.GRPO: lambda reward, mask, **_: compute_grpo_advantages(reward, mask),
    Method.OPD: lambda teacher_logprobs, old_logprobs, mask, has_teacher, topk, opd_clip, **_: compute_opd_advantages(
        teacher_logprobs, old_logprobs, mask, has_teacher, topk=topk, opd_clip=opd_clip
    ),
    Method.COMBINE: compute_combine_advantages,
}


def compute_advantages(method: Method | str, *, reward: Tensor, teacher_logprobs: Tensor,
                       old_logprobs: Tensor, mask: Tensor, has_teacher: Tensor,
                       w_opd: float = 1.0, topk: tuple | None = None,
                       opd_clip: float = 0.0) -> Tensor:
    """Dispatch to the estimator of ``method``; unknown names raise listing the valid ones.

    ``reward`` is taken as given: group normalisation (:func:`normalize_group_rewards`) runs once
    over the whole batch before micro-batching. ``topk``: (student_topk, teacher_topk, has_topk)
    for top-k OPD; ``opd_clip``: the OPD advantage clip (module docstring). Returns (B, T), zero
    outside ``mask``."""
    try:
        estimator = _ESTIMATORS[Method(method)]
    except ValueError:
        valid = ", ".join(m.value for m in _ESTIMATORS)
        raise ValueError(f"unknown advantage method {method!r}; valid: {valid}") from None
    return estimator(reward=reward, teacher_logprobs=teacher_logprobs, old_logprobs=old_logprobs,
                     mask=mask, has_teacher=has_teacher, w_opd=w_opd, topk=topk, opd_clip=opd_clip)
