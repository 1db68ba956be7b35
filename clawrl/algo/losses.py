"""The one PPO objective all methods and both training backends share.

    r_t   = exp(lp_t - old_lp_t)
    pg_t  = max(-A_t r_t, -A_t clip(r_t, 1-eps_low, 1+eps_high))        (PPO-clip, clip-higher)
    w_t   = min(exp(old_lp_t - rollout_lp_t), cap), detached             (truncated IS)
    L     = mean(w_t pg_t) + kl_coef mean(KL_t)                          (means over response tokens)

Shapes: B samples, T = L-1 next-token positions; every per-token tensor is (B, T) aligned with
``input_ids[:, 1:]``, and ``mask`` is 1.0 on response tokens.

Where we depart from textbook PPO (Schulman et al. 2017, eq. 7) and the reference:
  1. Clip-higher: eps_high exceeds eps_low (DAPO, Yu et al. 2025, arXiv:2503.14476), so
     low-probability tokens with positive advantage can grow faster than the clip would let them.
  2. Truncated importance sampling against the *rollout* log-probs: the engine that sampled the
     turn may be several weight versions old and numerically different from the trainer, so each
     token is reweighted by min(pi_old / pi_rollout, cap). The reference keeps the ratio at 1 and
     ignores this gap. Both log-probs must score the same distribution: rollout log-probs taken
     at temperature T != 1 against trainer log-probs at T = 1 bias every weight.
  3. KL to the frozen initial model is a loss term (not a reward penalty), the k3 estimator
     (Schulman 2020, "Approximating KL divergence"): unbiased and never negative.
  4. Log-ratios are clamped to [-20, 20] before exp: a masked or diverged token must not turn
     0 * inf into NaN for the whole batch.
  5. The token mean takes the *global* token count, so a backend that splits the batch into
     micro-batches (or ranks) gets the full-batch gradient by summing.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far beyond any clip, still finite in float32
# Values no user of this system changes (settings once): the ratio is clipped to [0.8, 1.28] (clip-higher,
# DAPO's 0.2 / 0.28), and a token's truncated importance weight is at most 2.
CLIP_LOW, CLIP_HIGH, TIS_CAP = 0.2, 0.28, 2.0


def compute_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float = CLIP_LOW,
                        clip_high: float = CLIP_HIGH) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss with clip-higher: pg_t = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)).

    All inputs (B, T). Returns (pg (B,T), ratio (B,T), clipped (B,T) bool: the clip changed the objective)."""
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # r = pi / pi_old
    unclipped = -advantages * ratio  # -A r
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # -A clip(r)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped  # max(-A r, -A clip(r))


def compute_tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float = TIS_CAP) -> Tensor:
    """w_t = min(exp(old_lp_t - rollout_lp_t), cap), no grad. (B, T)."""
    log_w = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)  # min(pi_old / pi_rollout, cap)


def compute_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from sampled tokens, >= 0. (B, T)."""
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0  # k3 = exp(ref_lp - lp) - (ref_lp - lp) - 1


def token_mean(values: Tensor, mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """sum_{i,t} values * mask / N_tokens; ``num_tokens``: the count of the *whole* batch when this is
    one micro-batch of it (default: this tensor's own count)."""
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return (values * mask).sum() / denom


def compute_ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     rollout_logprobs: Tensor | None = None, ref_logprobs: Tensor | None = None,
                     entropy: Tensor | None = None, kl_coef: float = 0.0,
                     num_tokens: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """L = mean(w pg) + kl_coef mean(KL); all per-token inputs (B, T); ``entropy`` is only reported.

    Returns the scalar loss and metrics: policy_loss, kl, entropy, clip_frac, ratio_mean,
    tis_weight_mean, advantage_mean (token means), ratio_min, ratio_max, loss. With ``num_tokens``
    set to the whole batch's count, each additive metric is this micro-batch's share: combine parts
    with :func:`merge_metrics`."""
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")

    def agg(values: Tensor) -> Tensor:
        return token_mean(values, mask, num_tokens)

    def metric(values: Tensor) -> float:
        return float(token_mean(values.detach().float(), mask, num_tokens))

    pg, ratio, clipped = compute_policy_loss(logprobs, old_logprobs, advantages)
    weights = (compute_tis_weights(old_logprobs, rollout_logprobs) if rollout_logprobs is not None
               else torch.ones_like(pg))
    policy_loss = agg(pg * weights)  # mean(w_t pg_t)
    loss = policy_loss
    kl = torch.zeros((), device=pg.device)
    if ref_logprobs is not None:
        kl = agg(compute_kl(logprobs, ref_logprobs))
        loss = loss + kl_coef * kl  # + kl_coef mean(KL_t)
    ent = torch.zeros((), device=pg.device) if entropy is None else agg(entropy)

    real = mask > 0
    metrics = {
        "loss": float(loss.detach()),
        "policy_loss": float(policy_loss.detach()),
        "kl": float(kl.detach()),
        "entropy": float(ent.detach()),
        "clip_frac": metric(clipped.float()),
        "ratio_mean": metric(ratio),
        "ratio_min": float(ratio.detach().masked_fill(~real, float("inf")).min()),
        "ratio_max": float(ratio.detach().masked_fill(~real, float("-inf")).max()),
        "tis_weight_mean": metric(weights),
        "advantage_mean": metric(advantages),
    }
    return loss, metrics


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch metrics computed with whole-batch counts: sum the additive ones,
    min/max the ``*_min``/``*_max`` ones."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key.endswith("_min"):
                out[key] = min(out[key], value)
            elif key.endswith("_max"):
                out[key] = max(out[key], value)
            else:
                out[key] += value
    return out
