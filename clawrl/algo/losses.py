"""The one PPO objective all methods and both training backends share.

    r_t   = exp(lp_t - old_lp_t)
    pg_t  = max(-A_t r_t, -A_t clip(r_t, 1-eps_low, 1+eps_high))        (PPO-clip, clip-higher)
    pg_t  = min(pg_t, c |A_t|)  where A_t < 0                            (dual clip, c > 1)
    w_t   = min(exp(old_lp_t - rollout_lp_t), cap), detached             (truncated IS)
    L     = agg(w_t pg_t) + kl_coef agg(KL_t) - entropy_coef agg(H_t)

Shapes: B samples, T = L-1 next-token positions; every per-token tensor is (B, T) aligned with
``input_ids[:, 1:]``, and ``mask`` is 1.0 on response tokens.

Where we depart from textbook PPO (Schulman et al. 2017, eq. 7) and the reference:
  1. Clip-higher: eps_high may exceed eps_low (DAPO, Yu et al. 2025, arXiv:2503.14476), so
     low-probability tokens with positive advantage can grow faster than the clip would let them.
  2. Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for
     A < 0 the loss is capped at c|A|, so a token whose ratio exploded cannot dominate the batch.
  3. Truncated importance sampling against the *rollout* log-probs: the engine that sampled the
     turn may be several weight versions old and numerically different from the trainer, so each
     token is reweighted by min(pi_old / pi_rollout, cap). The reference keeps the ratio at 1 and
     ignores this gap. Both log-probs must score the same distribution: rollout log-probs taken
     at temperature T != 1 against trainer log-probs at T = 1 bias every weight.
  4. KL to the frozen initial model is a loss term (not a reward penalty), estimator k1/k2/k3
     (Schulman 2020, "Approximating KL divergence").
  5. Log-ratios are clamped to [-20, 20] before exp: a masked or diverged token must not turn
     0 * inf into NaN for the whole batch.
  6. Aggregation is a named argument and takes the *global* token/sequence counts, so a backend
     that splits the batch into micro-batches (or ranks) gets the full-batch gradient by summing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far beyond any clip, still finite in float32


def compute_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
                        clip_low: float, clip_high: float,
                        dual_clip: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss with clip-higher and optional dual clip.

    pg_t = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); for A < 0 and dual_clip = c > 1,
    pg_t = min(pg_t, c|A|). All inputs (B, T). Returns (pg (B,T), ratio (B,T), clipped (B,T)
    bool: the clip changed the objective, dual_clipped (B,T) bool)."""
    if dual_clip and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or 0 = off), got {dual_clip}")
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # r = pi / pi_old
    unclipped = -advantages * ratio  # -A r
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # -A clip(r)
    pg = torch.maximum(unclipped, clipped)  # max(-A r, -A clip(r))
    was_clipped = clipped > unclipped
    dual_clipped = torch.zeros_like(was_clipped)
    if dual_clip:
        bound = -advantages * dual_clip  # c|A| where A < 0
        dual_clipped = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)  # min(pg, c|A|)
    return pg, ratio, was_clipped, dual_clipped


def compute_tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """w_t = min(exp(old_lp_t - rollout_lp_t), cap), no grad; cap 0 = off (all ones). (B, T)."""
    if cap == 0:
        return torch.ones_like(old_logprobs)
    log_w = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)  # min(pi_old / pi_rollout, cap)


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs  # k1 = lp - ref_lp


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2  # k2 = 1/2 (lp - ref_lp)^2


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0  # k3 = exp(ref_lp - lp) - (ref_lp - lp) - 1  (>= 0)


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def compute_kl(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens; k1 | k2 | k3. (B, T)."""
    if kl_type not in _KL_ESTIMATORS:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid: {', '.join(_KL_ESTIMATORS)}")
    return _KL_ESTIMATORS[kl_type](logprobs, ref_logprobs)


def _token_mean(values: Tensor, mask: Tensor, num_tokens: float | None, num_seqs: float | None) -> Tensor:
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return (values * mask).sum() / denom  # sum_{i,t} l m / N_tokens


def _seq_count(mask: Tensor, num_seqs: float | None) -> Tensor | float:
    return (mask.sum(-1) > 0).sum().clamp(min=1) if num_seqs is None else num_seqs


def _seq_mean_token_mean(values: Tensor, mask: Tensor, num_tokens: float | None, num_seqs: float | None) -> Tensor:
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return per_seq.sum() / _seq_count(mask, num_seqs)  # mean_i (sum_t l m / n_i)


def _seq_mean_token_sum(values: Tensor, mask: Tensor, num_tokens: float | None, num_seqs: float | None) -> Tensor:
    return (values * mask).sum() / _seq_count(mask, num_seqs)  # mean_i sum_t l m


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float | None, float | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def aggregate_loss(values: Tensor, mask: Tensor, loss_agg: str, *, num_tokens: float | None = None,
                   num_seqs: float | None = None) -> Tensor:
    """Reduce per-token ``values`` (B, T) under ``mask`` to a scalar.

    ``num_tokens`` / ``num_seqs`` are the counts of the *whole* batch when this is one micro-batch
    of it (default: this tensor's own counts; a sequence counts when it has a masked token)."""
    if loss_agg not in _AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(_AGGREGATIONS)}")
    return _AGGREGATIONS[loss_agg](values, mask, num_tokens, num_seqs)


def compute_ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     rollout_logprobs: Tensor | None = None, ref_logprobs: Tensor | None = None,
                     entropy: Tensor | None = None, clip_low: float, clip_high: float,
                     dual_clip: float = 0.0, tis_cap: float = 0.0, kl_coef: float = 0.0,
                     kl_type: str = "k3", entropy_coef: float = 0.0, loss_agg: str = "token-mean",
                     num_tokens: float | None = None,
                     num_seqs: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """L = agg(w pg) + kl_coef agg(KL) - entropy_coef agg(H); all per-token inputs (B, T).

    Returns the scalar loss and metrics: policy_loss, kl, entropy (aggregated like the loss),
    clip_frac, dual_clip_frac, ratio_mean, tis_weight_mean, advantage_mean (token means),
    ratio_min, ratio_max, loss. With ``num_tokens``/``num_seqs`` set to whole-batch counts,
    each additive metric is this micro-batch's share: combine parts with :func:`merge_metrics`."""
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")

    def agg(values: Tensor) -> Tensor:
        return aggregate_loss(values, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    def token_mean(values: Tensor) -> float:
        return float(_token_mean(values.detach().float(), mask, num_tokens, None))

    pg, ratio, clipped, dual_clipped = compute_policy_loss(
        logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    weights = (compute_tis_weights(old_logprobs, rollout_logprobs, tis_cap) if rollout_logprobs is not None
               else torch.ones_like(pg))
    policy_loss = agg(pg * weights)  # agg(w_t pg_t)
    loss = policy_loss
    kl = torch.zeros((), device=pg.device)
    if ref_logprobs is not None:
        kl = agg(compute_kl(logprobs, ref_logprobs, kl_type))
        loss = loss + kl_coef * kl  # + kl_coef agg(KL_t)
    ent = torch.zeros((), device=pg.device)
    if entropy is not None:
        ent = agg(entropy)
        loss = loss - entropy_coef * ent  # - entropy_coef agg(H_t)

    real = mask > 0
    metrics = {
        "loss": float(loss.detach()),
        "policy_loss": float(policy_loss.detach()),
        "kl": float(kl.detach()),
        "entropy": float(ent.detach()),
        "clip_frac": token_mean((clipped | dual_clipped).float()),
        "dual_clip_frac": token_mean(dual_clipped.float()),
        "ratio_mean": token_mean(ratio),
        "ratio_min": float(ratio.detach().masked_fill(~real, float("inf")).min()),
        "ratio_max": float(ratio.detach().masked_fill(~real, float("-inf")).max()),
        "tis_weight_mean": token_mean(weights),
        "advantage_mean": token_mean(advantages),
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
