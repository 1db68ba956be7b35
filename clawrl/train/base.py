"""The hyper-parameters, the base class every training backend extends, and the PPO step they share.

A backend owns a model, an optimizer and its parallelism; the formulas live in ``clawrl/algo`` and
the step logic (advantages, micro-batching, loss scaling, metrics), the optimizer, the learning
rate, the optimizer state and checkpoint writing live here, in :class:`TrainBackend`, so the torch
and Megatron backends cannot drift apart. A backend supplies the forward (:meth:`_logprobs`), the
gradient clipping, its weights under HF names and the conversion of AdamW moments.

Old log-probs cost no extra forward: a step is one optimizer step over the whole batch (gradient
accumulation over micro-batches), so every micro-batch runs at exactly the weights the batch started
from, and its detached log-probs *are* the old log-probs (the ratio is 1; the gap to the engine that
sampled the batch is weighted by truncated importance sampling). Only the KL reference needs a forward
of its own (``compute_logprobs(reference=True)``). This needs a deterministic forward: the models run
in eval mode (dropout off) while they train.

Precision: weights, gradients and AdamW state are float32; ``dtype="bfloat16"``/``"float16"`` runs
the forward under autocast. Pure bf16 weights would drop updates smaller than ~1/256 of a weight,
i.e. every update at lr 1e-5. The frozen KL reference, which is never updated, is kept in the
compute dtype.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from clawrl.algo.advantages import compute_advantages, normalize_group_rewards
from clawrl.algo.losses import compute_ppo_loss, merge_metrics
from clawrl.checkpoint import MASTER_FILE, OPTIMIZER_FILE, TRAINER_FILE, WEIGHTS_FILE, staged_dir, weights_digest
from clawrl.models import torch_dtype
from clawrl.records import Method
from clawrl.train.batch import TokenBatch

if TYPE_CHECKING:
    from clawrl.config import OPDSettings, PPOSettings

# not copied from the source model into a checkpoint: written fresh, a cache marker, or the
# trainer's own files of the checkpoint a resumed trainer started from
_NOT_COPIED = {"config.json", ".complete", TRAINER_FILE, OPTIMIZER_FILE, MASTER_FILE}


# Values no user of this system changes (settings once): AdamW with betas 0.9 / 0.98 and no weight decay,
# gradients clipped at global norm 1. The PPO loss's own are in clawrl.algo.losses.
ADAM_BETAS, WEIGHT_DECAY, GRAD_CLIP = (0.9, 0.98), 0.0, 1.0


@dataclass(frozen=True)
class PPOHyperParams:
    """The values a backend reads - the ``[ppo]`` settings under their names - and ``[model] seed``: plain
    values copied at the entry point, so backends never see Settings."""

    advantage_estimator: Method
    lr: float
    lr_decay_steps: int  # 0: constant lr; else a cosine from lr to lr_min (see lr_at)
    lr_min: float
    micro_batch_size: int  # sequences per forward/backward
    kl_coef: float
    w_opd: float
    group_norm: bool
    group_by: str  # baseline group when group_norm: prompt | batch
    seed: int
    opd_clip: float = 0.0  # the per-token OPD advantage clip, 0 = off

    @classmethod
    def from_settings(cls, ppo: PPOSettings, seed: int, opd: OPDSettings | None = None) -> PPOHyperParams:
        """The ``[ppo]`` settings; ``opd``: top-k OPD clips its per-token term to [-1, 1] (an average over
        k tokens can be large where the teacher and policy disagree)."""
        derived = {"group_norm": ppo.group_by != "none",
                   "group_by": "prompt" if ppo.group_by == "none" else ppo.group_by,
                   "opd_clip": 1.0 if opd is not None and opd.top_k > 0 else 0.0, "seed": seed}
        return cls(**derived, **{f.name: getattr(ppo, f.name) for f in fields(cls) if f.name not in derived})


def lr_at(hp: PPOHyperParams, step: int) -> float:
    """The learning rate of training step ``step`` (0 = the first step from the base weights; the
    step that makes weight version v+1 is step v, so a resumed or replayed run gets the same lr).

    ``lr``, or with ``lr_decay_steps`` D > 0 a cosine from lr to lr_min (step k < D:
    lr_min + (lr - lr_min)(1 + cos(pi k / D)) / 2), and lr_min from then on."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not hp.lr_decay_steps:
        return hp.lr
    frac = min(step, hp.lr_decay_steps) / hp.lr_decay_steps
    return hp.lr_min + (hp.lr - hp.lr_min) * (1 + math.cos(math.pi * frac)) / 2


def default_loss(mb: TokenBatch, *, logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None,
                 entropy: Tensor, reward: Tensor, hp: PPOHyperParams, num_tokens: float,
                 num_seqs: float) -> tuple[Tensor, dict[str, float]]:
    """The advantage + loss of one micro-batch: ``compute_advantages`` for ``hp.advantage_estimator``,
    then the clipped PPO objective. This is the function the ``[hooks] loss`` setting replaces; a
    replacement takes the same keyword arguments and returns ``(scalar loss, metrics)``. ``entropy``
    (no grad) is reported; ``num_seqs``, the batch's sequence count, is for a replacement."""
    advantages = compute_advantages(hp.advantage_estimator, reward=reward, teacher_logprobs=mb.teacher_logprobs,
                                    old_logprobs=old_logprobs, mask=mb.response_mask, has_teacher=mb.has_teacher,
                                    w_opd=hp.w_opd, opd_clip=hp.opd_clip,
                                    topk=(mb.student_topk_logprobs, mb.teacher_topk_logprobs, mb.has_topk))
    return compute_ppo_loss(logprobs, old_logprobs, advantages, mb.response_mask, rollout_logprobs=mb.rollout_logprobs,
                            ref_logprobs=ref_logprobs, entropy=entropy, kl_coef=hp.kl_coef, num_tokens=num_tokens)


LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


class TrainBackend:
    """A long-lived trainer: model and optimizer stay in memory between steps.

    A subclass loads ``model`` (and ``reference`` or None) from ``model_dir``, sets ``hf_config``
    and ``device``, calls :meth:`_init_optimizer`, and implements :meth:`_logprobs`,
    :meth:`_clip_gradients`, :meth:`hf_state_dict` and the two moment conversions. Under tensor
    parallelism every rank calls every method (they are collective); global rank 0 writes files. Under
    data parallelism each rank backpropagates its block of the batch's rows, and the gradients are summed.
    """

    OPTIMIZER_STATE_FORMAT = ""  # tags optimizer_state_dict output; a foreign tag is refused on load
    rank, dp_rank, dp_size = 0, 0, 1  # global rank, and the data-parallel rank and size; a distributed backend sets them
    model: torch.nn.Module
    reference: torch.nn.Module | None
    model_dir: Path
    hf_config: Any
    device: torch.device

    def __init__(self, hp: PPOHyperParams, *, dtype: str, deterministic: bool, loss_fn: LossFn) -> None:
        self.hp = hp
        self.loss_fn = loss_fn  # [hooks] loss, or the default advantage + PPO loss
        self.compute_dtype = torch_dtype(dtype)
        if deterministic:
            # process-wide switches: a trainer process replays bit-exactly or fails loudly
            torch.manual_seed(hp.seed)
            # cuBLAS is deterministic only with a fixed workspace; torch refuses CUDA matmuls otherwise
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _init_optimizer(self) -> None:
        """AdamW over the trainable parameters; weights, gradients and moments stay float32."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.hp.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY,
                                           fused=self.device.type == "cuda")
        self.lr = self.hp.lr  # set_lr: the trainer's schedule
        self.steps_done = 0

    def _logprobs(self, model: torch.nn.Module, mb: TokenBatch, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """(log-probs, entropy without grad), each (b, l-1), of a micro-batch; a backend may return None for
        the entropy when ``entropy`` is False (not needed)."""
        raise NotImplementedError

    def _clip_gradients(self) -> float:
        """Clip the global gradient norm to ``GRAD_CLIP``; returns the pre-clip norm."""
        raise NotImplementedError

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights under HF names, detached copies; a tied ``lm_head.weight`` included, as HF does."""
        raise NotImplementedError

    def live_state_dict(self) -> dict[str, Tensor]:
        """The weights under HF names for a reader that is done before the next step (the in-process
        sync copies them at once): the live tensors where the backend holds them under HF names,
        else :meth:`hf_state_dict`'s copies."""
        return self.hf_state_dict()

    def _export_moments(self, moments: dict[str, Tensor], keep_device: bool = False) -> dict[str, Tensor]:
        """One AdamW moment per parameter name -> the stored form (the backend's naming): copies on
        CPU, or with ``keep_device`` (and one process) on the training device."""
        raise NotImplementedError

    def _import_moments(self, state: Mapping[str, Any]) -> dict[str, dict[str, Tensor]] | None:
        """Stored moments -> {"exp_avg": {param name: tensor}, "exp_avg_sq": ...}; None: keep them fresh."""
        raise NotImplementedError

    def _weights_to_save(self, keep_device: bool = False) -> dict[str, Tensor]:
        """The weights under HF names (live tensors or copies, on the device or on CPU)."""
        return self.hf_state_dict()

    def _barrier(self) -> None:
        """Wait for every rank (a checkpoint is complete for all ranks once rank 0 renamed it)."""

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """The KL reference as it is kept: no gradients, and its weights in the compute dtype (bf16 on
        a GPU: half the memory, and no cast of every weight in every forward, which autocast does
        not cache for frozen weights). Buffers such as RoPE's inverse frequencies stay float32."""
        model.requires_grad_(False)
        for p in model.parameters():  # a tied weight is one Parameter: cast once, still shared
            p.data = p.data.to(self.compute_dtype)
        return model

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        if self.reference is None:
            raise ValueError("no reference model: it is kept only when kl_coef > 0")
        yield self.reference

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor:
        """Log-prob of each next token, (B, L-1) float32, 0 past each sequence's end, no grad;
        ``reference``: the frozen initial weights instead of the current policy. Only the response
        positions are part of the contract: a backend may leave prompt positions at 0."""
        batch = batch.to(self.device)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
        with self._reference_model() if reference else nullcontext(self.model) as model:
            for s in range(0, len(batch), self.hp.micro_batch_size):
                mb = batch.slice(s, s + self.hp.micro_batch_size)
                lp, _ = self._logprobs(model, mb, False)
                out[s : s + len(mb), : lp.shape[1]] = lp * mb.attention_mask[:, 1:]
        return out

    def reference_logprobs(self, batch: TokenBatch) -> Tensor:
        """The frozen reference's log-probs of ``batch`` (on this device): the ones its samples
        brought (scored at judge time by the engine holding the initial weights), and a forward of
        the reference for the samples that brought none."""
        batch = batch.to(self.device)
        has = batch.has_ref
        if bool(has.all()):
            return batch.ref_logprobs * batch.response_mask
        if not bool(has.any()):
            return self.compute_logprobs(batch, reference=True)
        out = batch.ref_logprobs * batch.response_mask
        rows = (~has).nonzero().flatten().tolist()
        missing = self.compute_logprobs(batch.select(rows), reference=True)
        out[rows, : missing.shape[1]] = missing
        return out

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following optimizer steps (the trainer's schedule)."""
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.lr = lr

    def train_step(self, batch: TokenBatch) -> dict[str, float]:
        """One PPO step on ``batch``: one optimizer step, accumulating the gradients of every micro-batch.

        Every micro-batch's loss is normalised by the token count of the *whole* batch, so the
        accumulated gradient equals the gradient of the full-batch token mean whatever the micro-batch
        size. Returned metrics are full-batch values, plus ``grad_norm``, ``num_tokens``, ``num_seqs``,
        ``rollout_logprob_abs_diff`` and ``lr``.
        """
        hp, batch = self.hp, batch.to(self.device)
        mask = batch.response_mask
        num_tokens, num_seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
        if num_tokens == 0:
            raise ValueError(f"batch of {len(batch)} samples has no response tokens to train on")
        reward = batch.reward
        if hp.group_norm and hp.advantage_estimator in (Method.GRPO, Method.COMBINE):
            groups = batch.group_ids if hp.group_by == "prompt" else torch.zeros_like(batch.group_ids)
            reward = normalize_group_rewards(batch.reward, groups)  # R - mean of its group, over the whole batch
        full, (lo, hi) = batch, self._data_parallel_rows(len(batch))
        batch, reward = batch.slice(lo, hi), reward[lo:hi]  # this data-parallel rank's rows (all of them at DP 1)
        ref_logprobs = self.reference_logprobs(batch) if hp.kl_coef > 0 else None
        parts: list[dict[str, float]] = []
        for s in range(0, len(batch), hp.micro_batch_size):
            e = min(s + hp.micro_batch_size, len(batch))
            mb = batch.slice(s, e)
            width = mb.response_mask.shape[1]  # the micro-batch is trimmed to its own length
            logprobs, entropy = self._logprobs(self.model, mb, True)
            old = logprobs.detach()  # still the weights the batch started from: these are the old logprobs
            loss, metrics = self.loss_fn(mb, logprobs=logprobs, old_logprobs=old,
                                         ref_logprobs=None if ref_logprobs is None else ref_logprobs[s:e, :width],
                                         entropy=entropy, reward=reward[s:e], hp=hp, num_tokens=num_tokens,
                                         num_seqs=num_seqs)
            loss.backward()
            drift = ((old - mb.rollout_logprobs).abs() * mb.response_mask).sum() / num_tokens  # engine vs trainer
            parts.append({**metrics, "rollout_logprob_abs_diff": float(drift)})
        self._reduce_gradients()  # data parallel: the sum over ranks is the whole batch's gradient
        norm = self._clip_gradients()
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)  # weights stay as they were
            raise FloatingPointError(f"non-finite gradient norm {norm} at step {self.steps_done}; update skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return {**self._reduce_metrics(merge_metrics(parts)), "grad_norm": norm, "num_tokens": num_tokens,
                "num_seqs": num_seqs, "num_groups": float(torch.unique(full.group_ids).numel()),
                "reward_mean": float(full.reward.mean()), "teacher_fraction": float(full.has_teacher.float().mean()),
                "topk_fraction": float(full.has_topk.float().mean()),
                "reference_from_judge": float(full.has_ref.float().mean()) if hp.kl_coef > 0 else 0.0, "lr": self.lr}

    def _data_parallel_rows(self, n: int) -> tuple[int, int]:
        """The rows [lo, hi) of an n-row batch this data-parallel rank trains on: contiguous blocks,
        the first ``n % dp_size`` ranks one row more. Every rank holds the whole batch (counts,
        group baselines); each backpropagates its own rows."""
        if n < self.dp_size:
            raise ValueError(f"a batch of {n} samples cannot be split over {self.dp_size} data-parallel ranks")
        size, extra = divmod(n, self.dp_size)
        lo = self.dp_rank * size + min(self.dp_rank, extra)
        return lo, lo + size + (self.dp_rank < extra)

    def _reduce_gradients(self) -> None:
        """Sum the gradients over data-parallel ranks (each rank's loss is already normalised by the
        whole batch's counts); nothing at data parallel 1."""

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The whole batch's metrics from each data-parallel rank's: sums, and min/max for ``*_min``/``*_max``."""
        return metrics

    def optimizer_state_dict(self, keep_device: bool = False) -> dict[str, Any]:
        """AdamW's moments by parameter name, copies on CPU (with ``keep_device`` and one process, on
        the training device: a snapshot the next step may run beside):
        {"format", "step", "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}."""
        state = self.optimizer.state_dict()["state"]  # param index -> {"step", "exp_avg", "exp_avg_sq"}
        out: dict[str, Any] = {"format": self.OPTIMIZER_STATE_FORMAT, "step": 0, "exp_avg": {}, "exp_avg_sq": {}}
        if not state:
            return out
        steps = {float(s["step"]) for s in state.values()}
        if len(steps) != 1 or len(state) != len(self.params):
            raise RuntimeError(f"AdamW state covers {len(state)} of {len(self.params)} parameters "
                               f"at steps {sorted(steps)}")
        out["step"] = int(steps.pop())
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = self._export_moments({n: state[i][key] for i, n in enumerate(self.param_names)}, keep_device)
        return out

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`optimizer_state_dict` returned (a resume); lr, betas and weight decay
        stay this backend's own; a foreign ``format`` raises."""
        if state.get("format") != self.OPTIMIZER_STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r}; "
                             f"expected {self.OPTIMIZER_STATE_FORMAT!r}")
        moments = self._import_moments(state) if state["exp_avg"] else None
        if moments is None:
            return
        step = torch.tensor(float(state["step"]))
        per_param = {i: {"step": step.clone(), "exp_avg": moments["exp_avg"][n].clone(),
                         "exp_avg_sq": moments["exp_avg_sq"][n].clone()}
                     for i, n in enumerate(self.param_names)}  # moved to each parameter's device on load
        self.optimizer.load_state_dict({"state": per_param,
                                        "param_groups": self.optimizer.state_dict()["param_groups"]})

    def write_weights(self, directory: Path | None, keep_device: bool = False) -> str | None:
        """config.json, model.safetensors (in the served dtype: the compute dtype) and the source's
        tokenizer/generation files into the existing ``directory`` (rank 0; other ranks pass None and
        take part in the gather): what an engine loads. Returns the weights file's digest (rank 0).
        ``keep_device``: cast to the served dtype on the training device, so half the bytes cross to
        the host (the caller checks the room for a copy). The trainer's own state goes beside it
        (:meth:`master_weights`, the optimizer state: ``clawrl.checkpoint.write_trainer_state``)."""
        from safetensors.torch import save_file

        state = self._weights_to_save(keep_device)
        if self.rank != 0:
            return None
        if getattr(self.hf_config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # shared tensor; HF re-ties it
        served = {k: v.to(self.compute_dtype).contiguous().cpu() for k, v in state.items()}
        save_file(served, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        self.hf_config.save_pretrained(str(directory))
        for src in sorted(self.model_dir.iterdir()):
            if src.is_file() and src.name not in _NOT_COPIED and not src.name.startswith("model"):
                shutil.copy2(src, directory / src.name)
        return weights_digest(directory / WEIGHTS_FILE)

    def master_weights(self, keep_device: bool = False) -> dict[str, Tensor] | None:
        """When the served weights are not float32, copies of the float32 weights training continues
        from (HF names, a tied head left out; on CPU, or with ``keep_device`` and one process on the
        training device) on rank 0; None otherwise (collective like :meth:`write_weights`)."""
        if self.compute_dtype == torch.float32:
            return None
        state = self._weights_to_save(keep_device)
        if self.rank != 0:
            return None
        tied = getattr(self.hf_config, "tie_word_embeddings", False)
        copy = (lambda v: v.detach().clone(memory_format=torch.contiguous_format)) if keep_device else \
            (lambda v: v.detach().to("cpu", copy=True).contiguous())
        return {k: copy(v) for k, v in state.items() if not (tied and k == "lm_head.weight")}

    def save_checkpoint(self, out_dir: Path) -> Path:
        """:meth:`write_weights` into a staging dir beside ``out_dir``, renamed into place; an
        existing ``out_dir`` raises. Every rank returns after the rename."""
        out_dir = Path(out_dir)
        if out_dir.exists():
            raise FileExistsError(f"checkpoint {out_dir} already exists; checkpoints are never overwritten")
        with staged_dir(out_dir) if self.rank == 0 else nullcontext() as staging:
            self.write_weights(staging)
        self._barrier()
        return out_dir
