"""The megatron-core training backend: a local-spec GPTModel (no Transformer Engine) with tensor
parallelism, trained by the same PPO step and formulas as the torch backend.

The backend owns parallelism, not formulas: the step is :func:`clawrl.train.base.run_ppo_step`
and every loss term comes from ``clawrl/algo``. What is Megatron-specific:
  * the model (:mod:`clawrl.train.megatron_model`), weights converted and sharded by
    :func:`~clawrl.train.convert.hf_to_megatron`, attention ``"local"`` (the spec's unfused
    ``DotProductAttention``) or ``"sdpa"`` (``F.scaled_dot_product_attention``);
  * log-probs and entropy from vocab-parallel logits
    (:func:`~clawrl.train.megatron_model.compute_vocab_parallel_logprobs`);
  * gradients: the q/k-norm weights are replicated but see only their rank's heads, so their
    gradients are summed over TP ranks (as Megatron's ``finalize_model_grads`` does); the
    clipping norm counts each TP shard once per rank and each replicated weight once in total.

Precision follows the torch backend so the two agree: float32 weights, gradients and AdamW state;
``dtype="bfloat16"`` runs the forward under autocast. Data parallelism is not implemented: every
rank of the world is one tensor-parallel rank (``world_size == tp_size``).

Multi-GPU, PPO steps on a synthetic batch (the entry point at the bottom of this file)::

    torchrun --nproc-per-node 4 -m clawrl.train.megatron_backend --model DIR --tp 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clawrl.models import torch_dtype
from clawrl.train.base import LossFn, PPOHyperParams, default_loss, run_ppo_step, set_optimizer_lr
from clawrl.train.batch import TokenBatch
from clawrl.train.convert import (
    DEFAULT_VOCAB_MULTIPLE,
    hf_to_megatron,
    is_tp_sharded,
    megatron_config_from_hf,
    megatron_to_hf,
)
from clawrl.train.megatron_model import (
    ATTENTION_KINDS,
    build_gpt_model,
    compute_vocab_parallel_logprobs,
    load_hf_state_dict,
    load_megatron_weights,
)
from clawrl.train.megatron_shims import init_megatron

_NOT_COPIED = {"config.json", ".complete"}  # written fresh, or a cache marker
OPTIMIZER_STATE_FORMAT = "clawrl-megatron-adamw-hf-v1"


# --------------------------------------------------------------------------------------------
# backend


class MegatronBackend:
    """The :class:`~clawrl.train.base.TrainBackend` on megatron-core, tensor-parallel.

    Under torchrun every rank constructs it and calls every method (they are collective); rank 0
    alone writes checkpoints. Outside torchrun it runs as a TP-1 world of one process.
    """

    def __init__(self, model_dir: Path, hp: PPOHyperParams, *, dtype: str = "float32", device: str = "cpu",
                 tp_size: int = 1, attention: str = "local", deterministic: bool = True,
                 reference_dir: Path | None = None, vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE,
                 loss_fn: LossFn = default_loss) -> None:
        """``model_dir``: the weights to train (the base model, or a checkpoint to resume from);
        ``reference_dir``: the frozen KL reference (default ``model_dir``; a resumed trainer
        passes the base model). Constructing it is collective under torchrun."""
        from megatron.core import parallel_state
        from transformers import AutoConfig

        want_cuda = torch.device(device).type == "cuda"
        if want_cuda != torch.cuda.is_available():
            raise ValueError(f"device {device!r}: megatron runs on CUDA when it is available and on CPU "
                             f"(with shims) only when it is not; torch.cuda.is_available() is "
                             f"{torch.cuda.is_available()}")
        if not want_cuda and dtype != "float32":
            # megatron-core's linear layers re-enter autocast in backward for CUDA only
            # (custom_bwd(device_type="cuda")): a CPU bf16 backward fails on a dtype mismatch
            raise ValueError(f"dtype {dtype!r} on CPU: the Megatron backend runs float32 on CPU")
        self.model_dir = Path(model_dir)
        self.hp = hp
        self.loss_fn = loss_fn  # [hooks] loss, or the default advantage + PPO loss
        self.compute_dtype = torch_dtype(dtype)
        if deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.runtime = init_megatron(tp_size, hp.seed)
        if parallel_state.get_data_parallel_world_size() != 1:
            raise ValueError(f"world size {self.runtime.world_size} != tp_size {tp_size}: data parallelism "
                             "is not implemented in MegatronBackend")
        self.device = self.runtime.device
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = tp_size, self.runtime.tp_rank

        self.hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.args = megatron_config_from_hf(self.hf_config, dtype=torch.float32, tp=tp_size,
                                            vocab_multiple=vocab_multiple,
                                            use_cpu_initialization=self.device.type == "cpu")
        self.vocab_start = self.tp_rank * self.args.padded_vocab_size // tp_size
        self.vocab_multiple = vocab_multiple
        self.model = self._build(self._load_shard(self.model_dir), attention)
        self.reference = None
        if hp.kl_coef > 0:
            # a second model, not a deepcopy: Megatron modules hold process groups, which do not copy
            ref_dir = self.model_dir if reference_dir is None else Path(reference_dir)
            self.reference = self._build(self._load_shard(ref_dir), attention).requires_grad_(False)
        model = self.model
        self.params = list(model.parameters())
        self.sharded = [is_tp_sharded(n) for n, _ in model.named_parameters()]  # aligned with self.params
        # q/k norms are replicated but each rank applies them to its own heads only, so their
        # gradients are partial sums (Megatron's finalize_model_grads all-reduces them the same way)
        self.partial_grad_params = [p for n, p in model.named_parameters() if "q_layernorm" in n or "k_layernorm" in n]
        self.optimizer = torch.optim.AdamW(self.params, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay,
                                           fused=self.device.type == "cuda")
        self.lr = hp.lr  # set_lr: the trainer's schedule
        self.steps_done = 0

    def _load_shard(self, model_dir: Path) -> dict[str, Tensor]:
        return hf_to_megatron(load_hf_state_dict(model_dir), self.hf_config, self.tp_rank, self.tp_size,
                              vocab_multiple=self.vocab_multiple)

    def _build(self, weights: Mapping[str, Tensor], attention: str):
        model = build_gpt_model(self.args, attention=attention, device=self.device)
        load_megatron_weights(model, weights)
        return model.eval()  # dropout is 0 anyway; eval keeps Megatron off its training-only paths

    # -- forwards ---------------------------------------------------------------------------

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _logprobs(self, model, input_ids: Tensor, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(b, length)
        # attention_mask None = causal; batches are right-padded, so no real token sees padding
        with self._autocast():
            logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None)
        return compute_vocab_parallel_logprobs(
            logits[:, :-1], input_ids[:, 1:], vocab_start=self.vocab_start, vocab_size=self.args.vocab_size,
            entropy_grad=entropy_grad, group=self.tp_group)

    def _forward(self, mb: TokenBatch, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        return self._logprobs(self.model, mb.input_ids, entropy_grad)

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor:
        """Log-prob of each next token, (B, L-1) float32 (0 past each sequence's end), no grad."""
        if reference and self.reference is None:
            raise ValueError("no reference model: it is kept only when kl_coef > 0")
        model = self.reference if reference else self.model
        batch = batch.to(self.device)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
        for s in range(0, len(batch), self.hp.micro_batch_size):
            mb = batch.slice(s, min(s + self.hp.micro_batch_size, len(batch)))
            lp, _ = self._logprobs(model, mb.input_ids, False)
            out[s : s + len(mb), : lp.shape[1]] = lp
        return out

    # -- training ---------------------------------------------------------------------------

    def _grad_norm(self) -> Tensor:
        """Global L2 norm of the gradients: tensor-parallel shards summed over ranks, replicated
        weights (the norms, identical on every rank once partial sums are reduced) counted once."""
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, is_sharded in zip(self.params, self.sharded):
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if is_sharded:
                sharded += sq
            else:
                replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return (sharded + replicated).sqrt()

    def _sum_partial_grads(self) -> None:
        if self.tp_size > 1:
            for p in self.partial_grad_params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.tp_group)

    def _optimizer_step(self) -> float:
        self._sum_partial_grads()
        norm = float(self._grad_norm())
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)  # weights stay as they were
            raise FloatingPointError(f"non-finite gradient norm {norm} at step {self.steps_done}; update skipped")
        if self.hp.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so both backends clip identically
            coef = min(self.hp.grad_clip / (norm + 1e-6), 1.0)
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def set_lr(self, lr: float) -> None:
        self.lr = set_optimizer_lr(self.optimizer, lr)

    def train_step(self, batch: TokenBatch) -> dict[str, float]:
        batch = batch.to(self.device)
        ref = self.compute_logprobs(batch, reference=True) if self.hp.kl_coef > 0 else None
        metrics = run_ppo_step(batch, self.hp, forward=self._forward, optimizer_step=self._optimizer_step,
                               ref_logprobs=ref, loss_fn=self.loss_fn)
        self.steps_done += 1
        metrics["lr"] = self.lr
        return metrics

    # -- weights out ------------------------------------------------------------------------

    @torch.no_grad()
    def _gather_over_tp(self, local: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Every TP rank's version of ``local`` (CPU copies, rank order), on every rank."""
        if self.tp_size == 1:
            return [{n: t.detach().cpu() for n, t in local.items()}]
        shards: list[dict[str, Tensor]] = [{} for _ in range(self.tp_size)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part.cpu()
        return shards

    def megatron_shards(self) -> list[dict[str, Tensor]]:
        """Every TP rank's parameters (CPU copies, rank order), gathered on every rank."""
        return self._gather_over_tp(dict(self.model.named_parameters()))

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights under HF names, float32 CPU copies, gathered over TP (collective: every
        rank must call it). A tied ``lm_head.weight`` is included, like HF's own state_dict."""
        state = megatron_to_hf(self.megatron_shards(), self.hf_config, self.tp_size)
        if getattr(self.hf_config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """AdamW's moments under HF parameter names, gathered over TP (collective), so a resume
        may use another TP size: {"format", "step", "exp_avg": {hf name: tensor}, "exp_avg_sq": ...}.
        Moments are elementwise, so they convert exactly like the weights."""
        names = [n for n, _ in self.model.named_parameters()]
        state = self.optimizer.state_dict()["state"]  # param index -> {"step", "exp_avg", "exp_avg_sq"}
        out: dict[str, Any] = {"format": OPTIMIZER_STATE_FORMAT, "step": 0, "exp_avg": {}, "exp_avg_sq": {}}
        if not state:
            return out
        steps = {float(s["step"]) for s in state.values()}
        if len(steps) != 1 or len(state) != len(names):
            raise RuntimeError(f"AdamW state covers {len(state)} of {len(names)} parameters at steps {sorted(steps)}")
        out["step"] = int(steps.pop())
        for key in ("exp_avg", "exp_avg_sq"):
            shards = self._gather_over_tp({n: state[i][key] for i, n in enumerate(names)})
            out[key] = megatron_to_hf(shards, self.hf_config, self.tp_size)
        return out

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`optimizer_state_dict` returned (at any TP size); the learning
        rate and betas stay this backend's own."""
        if state.get("format") != OPTIMIZER_STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r}; expected {OPTIMIZER_STATE_FORMAT!r}")
        if not state["exp_avg"]:
            return
        moments = {key: hf_to_megatron(state[key], self.hf_config, self.tp_rank, self.tp_size,
                                       vocab_multiple=self.vocab_multiple) for key in ("exp_avg", "exp_avg_sq")}
        per_param = {i: {"step": torch.tensor(float(state["step"])),
                         "exp_avg": moments["exp_avg"][n].clone(), "exp_avg_sq": moments["exp_avg_sq"][n].clone()}
                     for i, (n, _) in enumerate(self.model.named_parameters())}
        self.optimizer.load_state_dict({"state": per_param,
                                        "param_groups": self.optimizer.state_dict()["param_groups"]})

    def save_checkpoint(self, out_dir: Path) -> Path:
        """config.json + model.safetensors + the source's tokenizer/generation files, written by
        global rank 0 to a temp dir beside ``out_dir`` and renamed into place; an existing
        ``out_dir`` raises. Collective: every rank calls it and returns after the rename."""
        out_dir = Path(out_dir)
        if out_dir.exists():
            raise FileExistsError(f"checkpoint {out_dir} already exists; checkpoints are never overwritten")
        state = self.hf_state_dict()
        if self.runtime.rank == 0:
            _write_hf_checkpoint(state, self.hf_config, self.model_dir, out_dir)
        if self.runtime.world_size > 1:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return out_dir


def _write_hf_checkpoint(state: dict[str, Tensor], hf_config: Any, source_dir: Path, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is read by other processes
        if getattr(hf_config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # safetensors refuses shared tensors
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config.save_pretrained(str(tmp))
        for src in sorted(Path(source_dir).iterdir()):
            if src.is_file() and src.name not in _NOT_COPIED and not src.name.startswith("model"):
                shutil.copy2(src, tmp / src.name)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# standalone multi-GPU step: torchrun --nproc-per-node N -m clawrl.train.megatron_backend ...


def build_synthetic_batch(vocab_size: int, *, batch_size: int, prompt_len: int, output_len: int,
                          seed: int) -> TokenBatch:
    """Random prompts and outputs with alternating +-1 rewards and random rollout log-probs in
    (-3, 0], for smoke runs of the training step (the same on every rank for one seed); see
    :func:`with_own_rollout_logprobs` for an on-policy version."""
    from clawrl.records import SampleRecord
    from clawrl.train.batch import collate_samples

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(batch_size):
        ids = torch.randint(0, vocab_size, (prompt_len + output_len,), generator=g).tolist()
        lps = (-torch.rand(output_len, generator=g) * 3).tolist()
        samples.append(SampleRecord(
            sample_id=f"synthetic-{i}", turn_id=f"t{i}", session_id="synthetic", judge_config_hash="",
            method="grpo", prompt_ids=ids[:prompt_len], output_ids=ids[prompt_len:], rollout_logprobs=lps,
            reward=1.0 if i % 2 == 0 else -1.0, has_teacher=False, teacher_logprobs=None, weight_version="0"))
    return collate_samples(samples, pad_id=0)


def with_own_rollout_logprobs(backend, batch: TokenBatch) -> TokenBatch:
    """``batch`` as if the trainer's current weights had sampled it (on-policy): rollout log-probs
    are the backend's own, so TIS weights are 1 and the gradients have a realistic size (random
    rollout log-probs make every TIS weight ~e^-8 and the gradients vanish). Collective under TP."""
    own = backend.compute_logprobs(batch).cpu() * batch.response_mask
    return dataclasses.replace(batch, rollout_logprobs=own)


def synthetic_hyperparams(*, lr: float, micro_batch_size: int, ppo_epochs: int = 1, kl_coef: float = 0.0,
                          entropy_coef: float = 0.0) -> PPOHyperParams:
    """The hyper-parameters of the standalone step: GRPO, the default clip and TIS settings."""
    from clawrl.records import Method

    return PPOHyperParams(method=Method.GRPO, lr=lr, weight_decay=0.0, betas=(0.9, 0.98), grad_clip=1.0,
                          micro_batch_size=micro_batch_size, ppo_epochs=ppo_epochs, clip_low=0.2, clip_high=0.28,
                          dual_clip=0.0, kl_coef=kl_coef, kl_type="k3", entropy_coef=entropy_coef,
                          loss_agg="token-mean", tis_cap=2.0, w_rl=1.0, w_opd=1.0, group_norm=False, seed=0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run PPO steps of the Megatron backend on a synthetic batch "
                                             "(launch with torchrun, one process per tensor-parallel rank).")
    ap.add_argument("--model", required=True, help="local HF model directory (config.json + safetensors)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--attention", default="sdpa", choices=ATTENTION_KINDS)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--save", type=Path, default=None, help="write an HF checkpoint here after the steps")
    a = ap.parse_args(argv)

    if dist.is_torchelastic_launched() and not dist.is_initialized():
        # torchrun exports RANK/WORLD_SIZE/MASTER_ADDR; torch's env:// rendezvous reads them.
        # Without torchrun, MegatronBackend starts a world of one process itself.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    hp = synthetic_hyperparams(lr=a.lr, micro_batch_size=a.micro_batch_size, ppo_epochs=a.ppo_epochs,
                               kl_coef=a.kl_coef, entropy_coef=a.entropy_coef)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = MegatronBackend(a.model, hp, dtype=a.dtype, device=device, tp_size=a.tp, attention=a.attention,
                              deterministic=False)
    batch = build_synthetic_batch(backend.args.vocab_size, batch_size=a.batch_size, prompt_len=a.prompt_len,
                                  output_len=a.output_len, seed=0)
    batch = with_own_rollout_logprobs(backend, batch)
    for step in range(a.steps):
        t0 = time.perf_counter()
        metrics = backend.train_step(batch)
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        metrics["step_s"] = time.perf_counter() - t0
        if backend.runtime.rank == 0:
            print(json.dumps({"step": step, "tp": a.tp, **metrics}), flush=True)
    if a.save is not None:
        backend.save_checkpoint(a.save)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
