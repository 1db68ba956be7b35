"""The megatron-core training backend: a local-spec GPTModel (no Transformer Engine) with tensor
parallelism, trained by the same PPO step and formulas as the torch backend.

The backend owns parallelism, not formulas: the step is :meth:`~clawrl.train.base.TrainBackend.train_step`
and every loss term comes from ``clawrl/algo``. What is Megatron-specific:
  * the model (:mod:`clawrl.train.megatron_model`), weights converted and sharded by
    :func:`~clawrl.train.convert.hf_to_megatron`, attention ``"local"`` (the spec's unfused
    ``DotProductAttention``) or ``"sdpa"`` (``F.scaled_dot_product_attention``);
  * log-probs and entropy from vocab-parallel logits
    (:func:`~clawrl.train.megatron_model.compute_vocab_parallel_logprobs`);
  * gradients: the q/k-norm weights are replicated but see only their rank's heads, so their
    gradients are summed over TP ranks (as Megatron's ``finalize_model_grads`` does); the
    clipping norm counts each TP shard once per rank and each replicated weight once in total.

Precision is the torch backend's (see :mod:`clawrl.train.base`), so the two agree. Data parallelism:
a world of ``tp_size x dp`` ranks holds ``dp`` replicas; each backpropagates its block of the batch's
rows (losses normalised by the whole batch's counts) and the gradients are summed over replicas, so a
step equals the one at world size 1 up to the order of float sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clawrl.checkpoint import trainer_weights
from clawrl.train.base import GRAD_CLIP, LossFn, PPOHyperParams, TrainBackend, default_loss
from clawrl.train.batch import TokenBatch
from clawrl.train.convert import hf_to_megatron, is_tp_sharded, megatron_config_from_hf, megatron_to_hf
from clawrl.train.megatron_model import (
    build_gpt_model,
    compute_vocab_parallel_logprobs,
    load_hf_state_dict,
    load_megatron_weights,
)
from clawrl.train.megatron_shims import init_megatron


class MegatronBackend(TrainBackend):
    """The :class:`~clawrl.train.base.TrainBackend` on megatron-core, tensor-parallel.

    Under torchrun every rank constructs it and calls every method (they are collective); rank 0
    alone writes checkpoints. Outside torchrun it runs as a TP-1 world of one process.
    """

    OPTIMIZER_STATE_FORMAT = "clawrl-megatron-adamw-hf-v1"

    def __init__(self, model_dir: Path, hp: PPOHyperParams, *, dtype: str = "float32", device: str = "cpu",
                 tp_size: int = 1, attention: str = "auto", deterministic: bool = True,
                 reference_dir: Path | None = None, loss_fn: LossFn = default_loss) -> None:
        """``model_dir``: the weights to train (the base model, or a checkpoint to resume from);
        ``reference_dir``: the frozen KL reference (default ``model_dir``; a resumed trainer
        passes the base model); ``attention``: "auto" is the SDPA core attention (flash kernels) on
        CUDA, as ``clawrl.bench.mfu`` measures it, and Megatron's own local attention on the CPU.
        Constructing it is collective under torchrun."""
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
        if attention == "auto":
            attention = "sdpa" if want_cuda else "local"
        super().__init__(hp, dtype=dtype, deterministic=deterministic, loss_fn=loss_fn)
        self.model_dir = Path(model_dir)
        self.runtime = init_megatron(tp_size, hp.seed)
        self.device, self.rank = self.runtime.device, self.runtime.rank
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()  # world size / tp_size
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = tp_size, self.runtime.tp_rank

        self.hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.args = megatron_config_from_hf(self.hf_config, dtype=torch.float32, tp=tp_size,
                                            use_cpu_initialization=self.device.type == "cpu")
        self.vocab_start = self.tp_rank * self.args.padded_vocab_size // tp_size
        self.model = self._build(self.model_dir, attention)
        self.reference = None
        if hp.kl_coef > 0:
            # a second model, not a deepcopy: Megatron modules hold process groups, which do not copy
            self.reference = self._frozen(self._build(reference_dir or self.model_dir, attention))
        self._init_optimizer()
        self.sharded = [is_tp_sharded(n) for n in self.param_names]  # aligned with self.params
        # q/k norms are replicated but each rank applies them to its own heads only, so their
        # gradients are partial sums (Megatron's finalize_model_grads all-reduces them the same way)
        self.partial_grad_params = [p for n, p in zip(self.param_names, self.params)
                                    if "q_layernorm" in n or "k_layernorm" in n]

    def _to_megatron(self, hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return hf_to_megatron(hf_state, self.hf_config, self.tp_rank, self.tp_size)

    def _build(self, model_dir: Path, attention: str):
        model = build_gpt_model(self.args, attention=attention, device=self.device)
        state = trainer_weights(model_dir)  # a checkpoint served in bf16 keeps its float32 weights beside
        load_megatron_weights(model, self._to_megatron(load_hf_state_dict(model_dir) if state is None else state))
        return model.eval()  # dropout is 0 anyway; eval keeps Megatron off its training-only paths

    def _logprobs(self, model: torch.nn.Module, mb: TokenBatch, entropy: bool) -> tuple[Tensor, Tensor]:
        """From vocab-parallel logits: the full-vocabulary logits never exist on one rank."""
        b, length = mb.input_ids.shape
        positions = torch.arange(length, device=mb.input_ids.device).expand(b, length)
        # attention_mask None = causal; batches are right-padded, so no real token sees padding
        with self._autocast():
            logits = model(input_ids=mb.input_ids, position_ids=positions, attention_mask=None)
        return compute_vocab_parallel_logprobs(
            logits[:, :-1], mb.input_ids[:, 1:], vocab_start=self.vocab_start, vocab_size=self.args.vocab_size,
            group=self.tp_group)

    def _grad_norm(self) -> float:
        """Global L2 norm of the gradients: tensor-parallel shards summed over ranks, replicated
        weights (the norms, identical on every rank once partial sums are reduced) counted once."""
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, is_sharded in zip(self.params, self.sharded):
            if p.grad is not None:
                sq = p.grad.detach().float().pow(2).sum()
                if is_sharded:
                    sharded += sq
                else:
                    replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return float((sharded + replicated).sqrt())

    def _clip_gradients(self) -> float:
        if self.tp_size > 1:
            for p in self.partial_grad_params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.tp_group)
        norm = self._grad_norm()
        if math.isfinite(norm):
            # torch.nn.utils.clip_grad_norm_'s rule, so both backends clip identically
            coef = min(GRAD_CLIP / (norm + 1e-6), 1.0)
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coef)
        return norm

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        """Data parallel: every rank's gradient summed (one flat all-reduce); a rank whose rows left a
        parameter without a gradient adds zeros."""
        if self.dp_size == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in self.params])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.dp_size == 1:
            return metrics
        keys = sorted(metrics)  # the same keys on every rank: the same loss on the same kind of rows
        out = {}
        for op, chosen in ((dist.ReduceOp.SUM, [k for k in keys if not k.endswith(("_min", "_max"))]),
                           (dist.ReduceOp.MIN, [k for k in keys if k.endswith("_min")]),
                           (dist.ReduceOp.MAX, [k for k in keys if k.endswith("_max")])):
            if chosen:
                t = torch.tensor([metrics[k] for k in chosen], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=op, group=self.dp_group)
                out.update(zip(chosen, t.tolist()))
        return out

    @torch.no_grad()
    def _gather_over_tp(self, local: Mapping[str, Tensor], keep_device: bool = False) -> list[dict[str, Tensor]]:
        """Every TP rank's version of ``local`` (rank order), on every rank: on CPU, or with one TP rank
        and ``keep_device`` the tensors themselves where they are (the callers copy them)."""
        if self.tp_size == 1:
            return [{n: t.detach() if keep_device else t.detach().cpu() for n, t in local.items()}]
        shards: list[dict[str, Tensor]] = [{} for _ in range(self.tp_size)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part.cpu()
        return shards

    def hf_state_dict(self, keep_device: bool = False) -> dict[str, Tensor]:
        """Float32 copies, gathered over TP (collective: every rank must call it); on CPU, or with one
        TP rank and ``keep_device`` on the training device."""
        state = megatron_to_hf(self._gather_over_tp(dict(self.model.named_parameters()), keep_device),
                               self.hf_config, self.tp_size)
        if getattr(self.hf_config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def _export_moments(self, moments: dict[str, Tensor], keep_device: bool = False) -> dict[str, Tensor]:
        """Under HF parameter names, gathered over TP, so a resume may use another TP size;
        moments are elementwise, so they convert exactly like the weights."""
        return megatron_to_hf(self._gather_over_tp(moments, keep_device), self.hf_config, self.tp_size)

    def _weights_to_save(self, keep_device: bool = False) -> dict[str, Tensor]:
        return self.hf_state_dict(keep_device)

    def _import_moments(self, state: Mapping[str, Any]) -> dict[str, dict[str, Tensor]]:
        return {key: self._to_megatron(state[key]) for key in ("exp_avg", "exp_avg_sq")}

    def _barrier(self) -> None:
        if self.runtime.world_size > 1:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
