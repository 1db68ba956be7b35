"""The megatron-core model pieces clawrl uses, with no clawrl dependencies beyond the weight
conversion (so the GPU benchmark can import them on a machine that has only torch, transformers
and megatron-core):

  * :func:`build_gpt_model`: a local-spec GPTModel (no Transformer Engine) from
    :class:`~clawrl.train.convert.MegatronModelArgs`, with either the spec's unfused
    ``DotProductAttention`` or :class:`SDPACoreAttention` (``attention="sdpa"``), which calls
    ``F.scaled_dot_product_attention``: flash / memory-efficient kernels on GPU and O(S) memory
    instead of the unfused path's O(S^2) score matrix;
  * :func:`load_megatron_weights` / :func:`load_hf_state_dict`;
  * :func:`compute_vocab_parallel_logprobs`: log-probs and entropy from vocab-parallel logits,
    so the full-vocabulary logits never exist on one rank.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from clawrl.train.convert import MegatronModelArgs

ATTENTION_KINDS = ("local", "sdpa")


@functools.cache
def _sdpa_core_attention_class():
    """Built lazily (once) so importing this module does not import megatron-core (about 4 s)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """Core attention through ``F.scaled_dot_product_attention``, same contract as the local
        spec's ``DotProductAttention``: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np*hn].

        ``attention_mask`` None means causal; otherwise a bool mask broadcastable to
        [b, np, sq, sk] with True = masked (Megatron's convention, the inverse of SDPA's)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("SDPACoreAttention does not support context parallelism")
            if config.apply_query_key_layer_scaling:
                raise ValueError("SDPACoreAttention does not support apply_query_key_layer_scaling")
            if config.window_size is not None or config.softmax_type != "vanilla":
                raise ValueError("SDPACoreAttention supports plain causal softmax attention only")
            self.layer_number = max(1, layer_number)
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
            dropout_p = self.dropout_p if self.training else 0.0
            rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else nullcontext()
            with rng:  # dropout differs per TP rank, as in DotProductAttention
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=dropout_p,
                    is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=True)
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np*hn]

    return SDPACoreAttention


def build_gpt_model(args: MegatronModelArgs, *, attention: str = "local", device: str | torch.device = "cpu"):
    """A megatron-core GPTModel (local layer spec) for ``args``, on ``device``.

    Needs :func:`~clawrl.train.megatron_shims.init_megatron` first (the model reads the
    tensor-parallel group). Logits come out vocab-parallel: [b, s, padded_vocab / tp]."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION_KINDS)}")
    config = TransformerConfig(**args.config_kwargs)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_layernorm)
    if attention == "sdpa":  # the spec is built fresh per call, so this edit is local
        spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention_class()
    model = GPTModel(config=config, transformer_layer_spec=spec, **args.model_kwargs)
    # torch.nn.RMSNorm is created on the CPU in float32 whatever params_dtype says
    return model.to(device=device, dtype=config.params_dtype)


@torch.no_grad()
def load_megatron_weights(model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` into the model's parameters; every parameter must be covered, exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise KeyError(f"megatron weights do not match the model: missing={missing} unexpected={unexpected}")
    for name, p in params.items():
        if p.shape != state[name].shape:
            raise ValueError(f"{name}: model shape {tuple(p.shape)} != weight shape {tuple(state[name].shape)}")
        p.copy_(state[name])


def load_hf_state_dict(model_dir: Path) -> dict[str, Tensor]:
    """All tensors of an HF safetensors directory (single file or an index of shards), on CPU."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(model_dir / f)))
    return state


class _SumOverTP(torch.autograd.Function):
    """Forward: all-reduce sum over the TP group. Backward: identity, because every rank goes on
    to compute the same (replicated) loss, so d loss / d (local summand) = d loss / d sum."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def compute_vocab_parallel_logprobs(logits: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int,
                                    group=None) -> tuple[Tensor, Tensor]:
    """log p(target) and the entropy H of the softmax over the real vocabulary, from this rank's
    slice of the logits.

    logits: (b, t, Vl), columns ``vocab_start .. vocab_start+Vl`` of the padded vocabulary;
    targets: (b, t) global ids. Columns at or past ``vocab_size`` are padding and are left out of
    the softmax (not just zero-weighted: a zero logit would still take probability mass).
    With m the global max and e_v = exp(z_v - m), in float32:
        S = sum_v e_v,   lp_t = (z_t - m) - log S,   H = log S - sum_v e_v (z_v - m) / S
    Each sum over v is a local sum then one all-reduce. Only these replicated totals are combined
    afterwards; feeding a replicated value back into a per-rank sum would need its gradient
    all-reduced too. Returns (logprobs (b, t), entropy (b, t) without grad). With ``group`` None (or
    of size 1) no communication happens.
    """
    tp = group is not None and dist.get_world_size(group) > 1
    sum_tp = (lambda x: _SumOverTP.apply(x.contiguous(), group)) if tp else (lambda x: x)
    z = logits[..., : max(0, min(logits.shape[-1], vocab_size - vocab_start))].float()  # real columns
    width = z.shape[-1]
    with torch.no_grad():  # the max is only a shift for stability: no gradient through it
        zmax = z.amax(-1) if width else torch.full(z.shape[:-1], -math.inf, device=z.device)
        if tp:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    shifted = z - zmax[..., None]  # (b, t, Vl), <= 0
    exp = shifted.exp()
    total = sum_tp(exp.sum(-1))  # S
    log_total = total.log()
    local = targets - vocab_start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, max(width - 1, 0))[..., None]).squeeze(-1)
    logprobs = sum_tp(torch.where(mine, picked, torch.zeros_like(picked))) - log_total  # (z_t - m) - log S
    with torch.no_grad():
        entropy = log_total - sum_tp((exp * shifted).sum(-1)) / total  # H = log S - sum_v e_v (z_v - m) / S
    return logprobs, entropy
