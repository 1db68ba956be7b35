"""A decode step with fewer, fused kernels: each transformer layer through two ``torch.compile`` d functions.

Replayed from a CUDA graph, a decode step costs what its kernels cost one after another, and most
of a small model's ~60 kernels a layer are tiny element-wise ones (RMSNorm alone is seven: cast,
square, mean, add, rsqrt, multiply, scale; RoPE another six per tensor). On an H200 that made the
replay of Qwen3-0.6B's step 4.1 ms at batch 1, nearly all of it spent between kernels. Compiled by
Inductor, the norms, RoPE, the attention's softmax and the MLP's activation fuse, leaving per
layer the projections, two fused element-wise kernels, the K/V write and a short attention.

The layer is split where it writes the KV cache, so the compiled code never mutates a graph input:

* :func:`_before_attention`: input RMSNorm, q/k/v projections, Qwen3's q/k norms, RoPE;
* the K/V write into the cache rows (two index writes, eager);
* :func:`_after_attention`: attention over the row's cached span (GQA by reshaping, the key mask
  as SDPA's boolean mask), output projection, residual, RMSNorm, the SiLU MLP, residual.

With adapters in the step (:class:`clawrl.engine.lora_step.DenseStep`), each half also takes the
layer's slot pools and the step's row mask and applies :func:`~clawrl.engine.lora_step.add_dense` to
its projections inside the compiled code; without, it is called with ``lora=None`` (dynamo keeps one
compiled graph for each case).

Both take the layer's weights as a tuple of tensors, so one compiled function serves every layer
(dynamo guards on tensor shapes, not on which module they came from), and ``dynamic=True`` serves
every padded batch size and span with one compilation. Weight updates copy into the same tensors.
The maths is HF's Llama/Qwen3 layer (RMSNorm in float32, cast back before the weight), so the
outputs agree with :meth:`CausalLMRunner._forward` to bf16 rounding; the fused kernels round
differently, so this path is compared with itself (graphs vs the same steps launched eagerly).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from clawrl.engine.lora import LORA_TARGETS
from clawrl.engine.lora_step import DenseStep, add_dense

log = logging.getLogger("clawrl.engine")


def supports_fused_decode(hf_model) -> str | None:
    """None when :class:`FusedDecode` can run ``hf_model``'s layers, else why not."""
    config = hf_model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only 'silu' is fused)"
    layer = hf_model.model.layers[0]
    if not hasattr(layer.input_layernorm, "variance_epsilon"):
        return f"{type(layer.input_layernorm).__name__} is not an RMSNorm"
    return None


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: in float32, cast back to the input's dtype before the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _before_attention(h: Tensor, cos: Tensor, sin: Tensor, w: tuple, eps: float, head_dim: int,
                      lora: tuple | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(B, 1, D) hidden -> q (B, heads, 1, hd), k and v (B, kv_heads, hd) at this position. ``lora``:
    (mask, has, then A and B of q, k and v) of :class:`~clawrl.engine.lora_step.DenseStep`."""
    norm, q_w, q_b, k_w, k_b, v_w, v_b, q_norm, k_norm = w
    b = h.shape[0]
    x = _rms(h, norm, eps)
    q, k, v = F.linear(x, q_w, q_b), F.linear(x, k_w, k_b), F.linear(x, v_w, v_b)
    if lora is not None:
        mask, has, qa, qb, ka, kb, va, vb = lora
        q, k, v = add_dense(x, q, qa, qb, mask, has), add_dense(x, k, ka, kb, mask, has), \
            add_dense(x, v, va, vb, mask, has)
    q, k, v = q.view(b, -1, head_dim), k.view(b, -1, head_dim), v.view(b, -1, head_dim)
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    q = q * cos + _rotate_half(q) * sin  # cos, sin: (B, 1, hd)
    k = k * cos + _rotate_half(k) * sin
    return q[:, :, None], k, v


def _after_attention(h: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, w: tuple, eps: float,
                     lora: tuple | None = None) -> Tensor:
    """Attention of q (B, heads, 1, hd) over keys/values (B, kv_heads, span, hd), then the rest of the layer.
    ``lora``: (row mask, has, then A and B of o, gate, up and down), as in :func:`_before_attention`."""
    o_w, o_b, norm, gate_w, gate_b, up_w, up_b, down_w, down_b = w
    b, heads = q.shape[0], q.shape[1]
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, heads, 1, hd)
    attn = attn.reshape(b, 1, heads * q.shape[-1])
    if lora is None:
        h = h + F.linear(attn, o_w, o_b)
        x = _rms(h, norm, eps)
        return h + F.linear(F.silu(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)
    slots, has, oa, ob, ga, gb, ua, ub, da, db = lora  # slots: each row's slot mask (``mask`` is the keys')
    h = h + add_dense(attn, F.linear(attn, o_w, o_b), oa, ob, slots, has)
    x = _rms(h, norm, eps)
    gated = F.silu(add_dense(x, F.linear(x, gate_w, gate_b), ga, gb, slots, has)) * \
        add_dense(x, F.linear(x, up_w, up_b), ua, ub, slots, has)
    return h + add_dense(gated, F.linear(gated, down_w, down_b), da, db, slots, has)


def _layer_weights(layer) -> tuple[tuple, tuple]:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    before = (layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
              attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias,
              None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight)
    after = (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight, mlp.gate_proj.weight,
             mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)
    return before, after


class FusedDecode:
    """The decode step of :meth:`CausalLMRunner.decode_rows` through the compiled layer halves."""

    def __init__(self, hf_model, head_dim: int, backend: str = "inductor"):
        self.hf, self.head_dim = hf_model, head_dim
        layers = list(hf_model.model.layers)
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.weights = [_layer_weights(layer) for layer in layers]
        self.before = torch.compile(_before_attention, backend=backend, dynamic=True, fullgraph=True)
        self.after = torch.compile(_after_attention, backend=backend, dynamic=True, fullgraph=True)

    def forward(self, tokens: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache,
                span: int, lora: DenseStep | None = None) -> Tensor:
        """Final-norm hidden states (B, D) of ``tokens[b]`` at ``positions[b]`` of cache row b;
        ``cos``/``sin`` (B, 1, hd) at those positions, ``mask`` (B, 1, 1, span) the keys each row sees;
        ``lora``: the step's adapters."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        h = self.hf.model.embed_tokens(tokens)[:, None]  # (B, 1, D)
        for i, (before, after) in enumerate(self.weights):
            lw = None if lora is None else [t for name in LORA_TARGETS for t in lora.weights(i, name)]
            q, k, v = self.before(h, cos, sin, before, self.eps, self.head_dim,
                                  None if lw is None else (lora.mask, lora.has, *lw[:6]))
            kc, vc = cache.k[i], cache.v[i]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            h = self.after(h, q, kc[:b, :, :span], vc[:b, :, :span], mask, after, self.eps,
                           None if lw is None else (lora.mask, lora.has, *lw[6:]))
        return self.hf.model.norm(h[:, 0])
