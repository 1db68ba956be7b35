"""Hugging Face Llama / Qwen3 checkpoints <-> megatron-core GPTModel (local layer spec), with
tensor-parallel sharding in both directions.

Name and shape map; H hidden, hd head_dim,
nq query heads, nkv kv heads, F ffn width, V vocab, Vp padded vocab, p = tp_size, r = tp_rank:

  embedding.word_embeddings.weight            [Vp/p, H]  model.embed_tokens.weight (rows padded)
  decoder.layers.{i}.input_layernorm.weight   [H]        model.layers.{i}.input_layernorm.weight
  ...self_attention.linear_qkv.weight  [(nq+2nkv)hd/p, H] q/k/v_proj, grouped per kv head:
        for each kv head g: its nq/nkv query heads, then k_g, then v_g. Rank r holds kv heads
        [r·nkv/p, (r+1)·nkv/p) with their query heads, i.e. a contiguous row block.
  ...self_attention.q_layernorm/k_layernorm   [hd]       self_attn.q_norm/k_norm (Qwen3 only)
  ...self_attention.linear_proj.weight   [H, nq·hd/p]    self_attn.o_proj.weight (column block)
  ...pre_mlp_layernorm.weight                 [H]        post_attention_layernorm.weight
  ...mlp.linear_fc1.weight               [2F/p, H]       cat(gate_proj_r, up_proj_r): each rank
        holds ITS gate rows then ITS up rows, because the gated MLP halves its local output.
  ...mlp.linear_fc2.weight               [H, F/p]        mlp.down_proj.weight (column block)
  decoder.final_layernorm.weight              [H]        model.norm.weight
  output_layer.weight                  [Vp/p, H]         lm_head.weight (absent when tied)

Vocab padding is explicit: megatron's vocab-parallel embedding needs Vp divisible by p, and
Megatron-LM rounds up to a multiple of ``vocab_multiple · p`` (128 by default) for even GEMM
shapes. Padded rows are zero on the way in and dropped on the way out; their logits must be
masked by whoever reads the logits (``MegatronModelArgs.vocab_size`` says where they start).

RoPE needs no permutation: megatron's default ``rotary_interleaved=False`` is HF's rotate_half.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
DEFAULT_VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True)
class MegatronModelArgs:
    """Everything needed to build the megatron twin of an HF model.

    ``TransformerConfig(**config_kwargs)`` and ``GPTModel(config, spec, **model_kwargs)``.
    """

    config_kwargs: dict[str, Any]
    model_kwargs: dict[str, Any]
    qk_layernorm: bool
    vocab_size: int  # the HF vocabulary; logits at and past this index are padding
    padded_vocab_size: int


@dataclass(frozen=True)
class _Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qk_norm: bool


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _dims(hf_config: Any) -> _Dims:
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    for key in ("attention_bias", "mlp_bias"):
        if _get(hf_config, key, False):
            raise ValueError(f"{key}=True is not supported (the local spec is built without biases)")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {_get(hf_config, 'hidden_act')!r} is not supported; only silu (SwiGLU)")
    heads = _get(hf_config, "num_attention_heads")
    hidden = _get(hf_config, "hidden_size")
    return _Dims(layers=_get(hf_config, "num_hidden_layers"), hidden=hidden, heads=heads,
                 kv_heads=_get(hf_config, "num_key_value_heads") or heads,
                 head_dim=_get(hf_config, "head_dim") or hidden // heads, ffn=_get(hf_config, "intermediate_size"),
                 vocab=_get(hf_config, "vocab_size"), tied=bool(_get(hf_config, "tie_word_embeddings", False)),
                 qk_norm=model_type == "qwen3")


def _rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE")
    theta = params.get("rope_theta", _get(hf_config, "rope_theta"))  # transformers 5 vs 4
    if theta is None:
        raise ValueError("the HF config names no rope_theta")
    return float(theta)


def compute_padded_vocab_size(vocab_size: int, tp_size: int, vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE) -> int:
    """Smallest multiple of ``vocab_multiple · tp_size`` that holds ``vocab_size`` rows."""
    step = vocab_multiple * tp_size
    return -(-vocab_size // step) * step


def megatron_config_from_hf(hf_config: Any, *, dtype: torch.dtype, tp: int,
                            vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE, use_cpu_initialization: bool = True,
                            perform_initialization: bool = False) -> MegatronModelArgs:
    """TransformerConfig and GPTModel keyword arguments equivalent to an HF Llama/Qwen3 config.

    Every CUDA-only fusion is off (the local spec runs everywhere); dropout is 0 as in HF
    training of these models. ``perform_initialization=False`` because the weights are loaded
    right after (random init of a 4B model on CPU would cost minutes for nothing).
    """
    import torch.nn.functional as F

    d = _dims(hf_config)
    if d.heads % tp or d.kv_heads % tp:
        raise ValueError(f"tp={tp} must divide the query heads ({d.heads}) and kv heads ({d.kv_heads})")
    if d.ffn % tp:
        raise ValueError(f"tp={tp} must divide intermediate_size ({d.ffn})")
    padded = compute_padded_vocab_size(d.vocab, tp, vocab_multiple)
    config_kwargs: dict[str, Any] = dict(
        num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads, num_query_groups=d.kv_heads,
        kv_channels=d.head_dim,  # Qwen3: head_dim != hidden / heads
        ffn_hidden_size=d.ffn, qk_layernorm=d.qk_norm, normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        # the CUDA-only fusions, off
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    model_kwargs: dict[str, Any] = dict(
        vocab_size=padded, max_sequence_length=int(_get(hf_config, "max_position_embeddings", 4096)),
        position_embedding_type="rope", rotary_base=_rope_theta(hf_config), share_embeddings_and_output_weights=d.tied,
    )
    return MegatronModelArgs(config_kwargs, model_kwargs, d.qk_norm, d.vocab, padded)


_TP_SHARDED = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_proj.weight",
               "linear_fc1.weight", "linear_fc2.weight")


def is_tp_sharded(name: str) -> bool:
    """Whether a megatron parameter is split over tensor-parallel ranks (else every rank holds a
    full copy: the norms). Decided by name because megatron-core 0.16.1 only tags parameters
    with ``tensor_model_parallel`` when it also initialises them."""
    return name.endswith(_TP_SHARDED)


def _layer(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config: Any, tp_rank: int = 0, tp_size: int = 1, *,
                   vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE) -> dict[str, torch.Tensor]:
    """The megatron state dict of tensor-parallel rank ``tp_rank`` (of ``tp_size``).

    Returns views of ``hf_state_dict`` where no copy is needed; load them with ``copy_``.
    A tied model's ``lm_head.weight`` is ignored if present.
    """
    d = _dims(hf_config)
    p, r = tp_size, tp_rank
    if not 0 <= r < p:
        raise ValueError(f"tp_rank {r} out of range for tp_size {p}")
    padded = compute_padded_vocab_size(d.vocab, p, vocab_multiple)
    group = d.heads // d.kv_heads  # query heads per kv head

    def col(w: torch.Tensor) -> torch.Tensor:  # column-parallel: output rows split
        return w.chunk(p, dim=0)[r]

    def row(w: torch.Tensor) -> torch.Tensor:  # row-parallel: input columns split
        return w.chunk(p, dim=1)[r]

    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": col(_pad_rows(hf_state_dict["model.embed_tokens.weight"], padded)),
        "decoder.final_layernorm.weight": hf_state_dict["model.norm.weight"],
    }
    if not d.tied:
        out["output_layer.weight"] = col(_pad_rows(hf_state_dict["lm_head.weight"], padded))
    for i in range(d.layers):
        hf, mc = _layer(i)
        q = hf_state_dict[hf + "self_attn.q_proj.weight"].view(d.kv_heads, group * d.head_dim, d.hidden)
        k = hf_state_dict[hf + "self_attn.k_proj.weight"].view(d.kv_heads, d.head_dim, d.hidden)
        v = hf_state_dict[hf + "self_attn.v_proj.weight"].view(d.kv_heads, d.head_dim, d.hidden)
        qkv = torch.cat([q, k, v], dim=1).reshape(-1, d.hidden)  # grouped per kv head
        gate = col(hf_state_dict[hf + "mlp.gate_proj.weight"])
        up = col(hf_state_dict[hf + "mlp.up_proj.weight"])
        out[mc + "input_layernorm.weight"] = hf_state_dict[hf + "input_layernorm.weight"]
        out[mc + "self_attention.linear_qkv.weight"] = col(qkv)
        out[mc + "self_attention.linear_proj.weight"] = row(hf_state_dict[hf + "self_attn.o_proj.weight"])
        out[mc + "pre_mlp_layernorm.weight"] = hf_state_dict[hf + "post_attention_layernorm.weight"]
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mc + "mlp.linear_fc2.weight"] = row(hf_state_dict[hf + "mlp.down_proj.weight"])
        if d.qk_norm:
            out[mc + "self_attention.q_layernorm.weight"] = hf_state_dict[hf + "self_attn.q_norm.weight"]
            out[mc + "self_attention.k_layernorm.weight"] = hf_state_dict[hf + "self_attn.k_norm.weight"]
    return out


def megatron_to_hf(shards: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]], hf_config: Any,
                   tp_size: int = 1) -> dict[str, torch.Tensor]:
    """HF state dict from megatron weights: either one state dict in the unsharded (TP 1) layout,
    or a sequence of ``tp_size`` per-rank state dicts in rank order.

    Every returned tensor is a fresh contiguous copy (never a view of a live parameter). A tied
    model gets no ``lm_head.weight``, as in HF's own safetensors files. ``*._extra_state`` keys
    are ignored.
    """
    if isinstance(shards, Mapping):
        shards = [shards]
    elif len(shards) != tp_size:
        raise ValueError(f"got {len(shards)} shards for tp_size={tp_size}")
    d = _dims(hf_config)
    group = d.heads // d.kv_heads

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name].detach() for s in shards], dim=dim)

    def replicated(name: str) -> torch.Tensor:
        return shards[0][name].detach().clone()

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[: d.vocab].clone(),
        "model.norm.weight": replicated("decoder.final_layernorm.weight"),
    }
    if not d.tied:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[: d.vocab].clone()
    for i in range(d.layers):
        hf, mc = _layer(i)
        qkv = cat(mc + "self_attention.linear_qkv.weight", 0).view(d.kv_heads, (group + 2) * d.head_dim, d.hidden)
        q, k, v = qkv.split([group * d.head_dim, d.head_dim, d.head_dim], dim=1)
        halves = [s[mc + "mlp.linear_fc1.weight"].detach().chunk(2, dim=0) for s in shards]
        out[hf + "input_layernorm.weight"] = replicated(mc + "input_layernorm.weight")
        out[hf + "self_attn.q_proj.weight"] = q.reshape(-1, d.hidden).contiguous()
        out[hf + "self_attn.k_proj.weight"] = k.reshape(-1, d.hidden).contiguous()
        out[hf + "self_attn.v_proj.weight"] = v.reshape(-1, d.hidden).contiguous()
        out[hf + "self_attn.o_proj.weight"] = cat(mc + "self_attention.linear_proj.weight", 1)
        out[hf + "post_attention_layernorm.weight"] = replicated(mc + "pre_mlp_layernorm.weight")
        out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[hf + "mlp.down_proj.weight"] = cat(mc + "mlp.linear_fc2.weight", 1)
        if d.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = replicated(mc + "self_attention.q_layernorm.weight")
            out[hf + "self_attn.k_norm.weight"] = replicated(mc + "self_attention.k_layernorm.weight")
    return out
