"""The contract every training backend implements, and the PPO step they share.

A backend owns a model, an optimizer and its parallelism; the formulas live in ``clawrl/algo`` and
the step logic (advantages, micro-batching, loss scaling, metrics) lives here, in
:func:`run_ppo_step`, so the torch and Megatron backends cannot drift apart. A backend hands
``run_ppo_step`` two callables: ``forward`` (log-probs and entropy of a micro-batch, with grad)
and ``optimizer_step`` (clip, step, zero grads).

Old log-probs cost no extra forward: an "epoch" is one optimizer step over the whole batch
(gradient accumulation over micro-batches), so every micro-batch of epoch 0 runs at exactly the
weights the batch started from, and its detached log-probs *are* the old log-probs. Later epochs
reuse them. Only the KL reference needs a forward of its own (``compute_logprobs(reference=True)``).
This needs a deterministic ``forward`` (dropout off), which both backends guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from clawrl.algo.advantages import compute_advantages, normalize_group_rewards
from clawrl.algo.losses import compute_ppo_loss, merge_metrics
from clawrl.records import Method
from clawrl.train.batch import TokenBatch

if TYPE_CHECKING:
    from clawrl.config import PPOSettings


@dataclass(frozen=True)
class PPOHyperParams:
    """Plain values copied from ``PPOSettings`` at the entry point; backends never see Settings."""

    method: Method
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float  # global grad-norm clip; 0 = off
    micro_batch_size: int  # sequences per forward/backward
    ppo_epochs: int  # optimizer steps per batch
    clip_low: float  # epsilon_low: ratio clipped below at 1 - clip_low
    clip_high: float  # epsilon_high: ratio clipped above at 1 + clip_high
    dual_clip: float  # c > 1 bounds the loss of negative advantages at c*|A|; 0 = off
    kl_coef: float
    kl_type: str  # k1 | k2 | k3
    entropy_coef: float
    loss_agg: str  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    tis_cap: float  # truncated IS cap vs rollout logprobs; 0 = off
    w_rl: float
    w_opd: float
    group_norm: bool
    seed: int
    group_by: str = "prompt"  # baseline group when group_norm: prompt | batch
    lr_schedule: str = "constant"  # constant | linear | cosine (see lr_at)
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_min: float = 0.0

    @classmethod
    def from_settings(cls, ppo: PPOSettings, seed: int) -> PPOHyperParams:
        return cls(
            method=Method(ppo.advantage_estimator),
            lr=ppo.lr,
            weight_decay=ppo.weight_decay,
            betas=(ppo.adam_beta1, ppo.adam_beta2),
            grad_clip=ppo.grad_clip,
            micro_batch_size=ppo.micro_batch_size,
            ppo_epochs=ppo.ppo_epochs,
            clip_low=ppo.clip_range,
            clip_high=ppo.clip_range_high,
            dual_clip=ppo.dual_clip,
            kl_coef=ppo.kl_coef,
            kl_type=ppo.kl_type,
            entropy_coef=ppo.entropy_coef,
            loss_agg=ppo.loss_agg,
            tis_cap=ppo.tis_cap,
            w_rl=ppo.w_rl,
            w_opd=ppo.w_opd,
            group_norm=ppo.group_norm,
            group_by=ppo.group_by,
            seed=seed,
            lr_schedule=ppo.lr_schedule,
            lr_warmup_steps=ppo.lr_warmup_steps,
            lr_decay_steps=ppo.lr_decay_steps,
            lr_min=ppo.lr_min,
        )


def lr_at(hp: PPOHyperParams, step: int) -> float:
    """The learning rate of training step ``step`` (0 = the first step from the base weights; the
    step that makes weight version v+1 is step v, so a resumed or replayed run gets the same lr).

    Warm-up: lr * (step + 1) / (warmup + 1) for step < warmup. Then, over ``lr_decay_steps`` steps,
    linear or cosine from lr to lr_min (decay step k of D: linear lr - (lr - lr_min) k / D, cosine
    lr_min + (lr - lr_min)(1 + cos(pi k / D)) / 2), and lr_min from then on."""
    import math

    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < hp.lr_warmup_steps:
        return hp.lr * (step + 1) / (hp.lr_warmup_steps + 1)
    if hp.lr_schedule == "constant":
        return hp.lr
    k = min(step - hp.lr_warmup_steps, hp.lr_decay_steps)
    frac = k / hp.lr_decay_steps
    if hp.lr_schedule == "linear":
        return hp.lr - (hp.lr - hp.lr_min) * frac
    if hp.lr_schedule == "cosine":
        return hp.lr_min + (hp.lr - hp.lr_min) * (1 + math.cos(math.pi * frac)) / 2
    raise ValueError(f"unknown lr_schedule {hp.lr_schedule!r}")


def set_optimizer_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Every parameter group of ``optimizer`` steps with ``lr`` from now on; returns it."""
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class TrainBackend(Protocol):
    """A long-lived trainer: model and optimizer stay in memory between steps."""

    def compute_logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor:
        """Log-prob of each next token, (B, L-1) float32, no grad; ``reference``: the frozen
        initial weights instead of the current policy. Only the response positions are part of
        the contract: a backend may leave prompt and padding positions at 0."""
        ...

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following optimizer steps (the trainer's schedule)."""
        ...

    def train_step(self, batch: TokenBatch) -> dict[str, float]:
        """One PPO step (``ppo_epochs`` optimizer steps) on ``batch``; returns its metrics."""
        ...

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights under Hugging Face names (LoRA merged), detached copies."""
        ...

    def save_checkpoint(self, out_dir: Path) -> Path:
        """Write an HF safetensors directory at ``out_dir`` atomically (temp dir + rename)."""
        ...

    def optimizer_state_dict(self) -> dict[str, Any]:
        """AdamW moments keyed by parameter name, with a backend-specific ``format`` tag."""
        ...

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict` output (a resume); a foreign ``format`` raises."""
        ...


# (micro-batch) -> (logprobs (b, l-1), entropy (b, l-1)); logprobs carry grad, entropy carries
# grad only when the second argument (entropy needs grad) is True.
ForwardFn = Callable[[TokenBatch, bool], tuple[Tensor, Tensor]]
# clips gradients, steps the optimizer, zeroes gradients; returns the pre-clip global grad norm.
OptimizerStepFn = Callable[[], float]


def default_loss(mb: TokenBatch, *, logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None,
                 entropy: Tensor, reward: Tensor, hp: PPOHyperParams, num_tokens: float,
                 num_seqs: float) -> tuple[Tensor, dict[str, float]]:
    """The advantage + loss of one micro-batch: ``compute_advantages`` for ``hp.method``, then the
    clipped PPO objective. This is the function the ``[hooks] loss`` setting replaces; a
    replacement takes the same keyword arguments and returns ``(scalar loss, metrics)``."""
    advantages = compute_advantages(
        hp.method,
        reward=reward,
        teacher_logprobs=mb.teacher_logprobs,
        old_logprobs=old_logprobs,
        mask=mb.response_mask,
        has_teacher=mb.has_teacher,
        w_rl=hp.w_rl,
        w_opd=hp.w_opd,
    )
    return compute_ppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        mb.response_mask,
        rollout_logprobs=mb.rollout_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        clip_low=hp.clip_low,
        clip_high=hp.clip_high,
        dual_clip=hp.dual_clip,
        tis_cap=hp.tis_cap,
        kl_coef=hp.kl_coef,
        kl_type=hp.kl_type,
        entropy_coef=hp.entropy_coef,
        loss_agg=hp.loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )


LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def run_ppo_step(
    batch: TokenBatch,
    hp: PPOHyperParams,
    *,
    forward: ForwardFn,
    optimizer_step: OptimizerStepFn,
    ref_logprobs: Tensor | None = None,
    loss_fn: LossFn = default_loss,
) -> dict[str, float]:
    """``hp.ppo_epochs`` optimizer steps over ``batch``, each accumulating micro-batch gradients.

    Every micro-batch's loss is normalised by the token/sequence counts of the *whole* batch, so
    the accumulated gradient equals the gradient of the full-batch aggregate whatever the
    micro-batch size. ``ref_logprobs`` (B, L-1) is required when ``hp.kl_coef > 0``.
    Returned metrics are full-batch values averaged over epochs (``*_min``/``*_max`` taken over
    all of them), plus ``grad_norm``, ``num_tokens``, ``num_seqs`` and ``rollout_logprob_abs_diff``.
    """
    if hp.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference's log-probs)")
    mask = batch.response_mask
    num_tokens = float(mask.sum())
    num_seqs = float((mask.sum(-1) > 0).sum())
    if num_tokens == 0:
        raise ValueError(f"batch of {len(batch)} samples has no response tokens to train on")
    reward = batch.reward
    if hp.group_norm and hp.method in (Method.GRPO, Method.COMBINE):
        groups = batch.group_ids if hp.group_by == "prompt" else torch.zeros_like(batch.group_ids)
        reward = normalize_group_rewards(batch.reward, groups)  # R - mean of its group, over the whole batch

    mbs = hp.micro_batch_size
    spans = [(s, min(s + mbs, len(batch))) for s in range(0, len(batch), mbs)]
    old_logprobs: list[Tensor] = []
    epoch_metrics: list[dict[str, float]] = []
    for epoch in range(hp.ppo_epochs):
        parts: list[dict[str, float]] = []
        for i, (s, e) in enumerate(spans):
            mb = batch.slice(s, e)
            width = mb.response_mask.shape[1]  # the micro-batch is trimmed to its own length
            logprobs, entropy = forward(mb, hp.entropy_coef != 0)
            if epoch == 0:  # still the weights the batch started from: these are the old logprobs
                old_logprobs.append(logprobs.detach())
            old = old_logprobs[i]
            loss, metrics = loss_fn(
                mb,
                logprobs=logprobs,
                old_logprobs=old,
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[s:e, :width],
                entropy=entropy,
                reward=reward[s:e],
                hp=hp,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            loss.backward()
            if epoch == 0:  # drift between the serving engine and the trainer, per token
                drift = ((old - mb.rollout_logprobs).abs() * mb.response_mask).sum() / num_tokens
                metrics["rollout_logprob_abs_diff"] = float(drift)
            parts.append(metrics)
        merged = merge_metrics(parts)
        merged["grad_norm"] = float(optimizer_step())
        epoch_metrics.append(merged)

    out = _mean_over_epochs(epoch_metrics)
    num_groups = float(torch.unique(batch.group_ids).numel())
    out.update(num_tokens=num_tokens, num_seqs=num_seqs, num_groups=num_groups,
               reward_mean=float(batch.reward.mean()), teacher_fraction=float(batch.has_teacher.float().mean()))
    return out


def _mean_over_epochs(per_epoch: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in per_epoch[0]:
        values = [m[key] for m in per_epoch if key in m]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out
