"""A batched forward for the Llama and Qwen3 Hugging Face layouts, with a per-slot KV cache.

The forward calls the loaded HF model's own modules (embedding, RMSNorms, projections, Qwen3's
q/k norms, MLP, LM head) and HF's ``rotate_half``, with RoPE tables from its rotary embedding,
so the maths is HF transformers' op for op and a weight update applied to the HF model is what
the next step computes with. Only attention is ours: GQA through
``scaled_dot_product_attention(enable_gqa=True)`` over the cache. fp32 logits agree with
``model(input_ids).logits`` to ~1e-5.

Two entry points share the layer code:

* :meth:`CausalLMRunner.prefill` runs N prompts (right-padded into one causal batch: a padded
  position is only ever *after* the real ones, so plain causal masking keeps real queries off
  the padding) and writes their K/V into cache rows ``rows``;
* :meth:`CausalLMRunner.decode` feeds one token to each of the first B cache rows, each at its own
  position, attending over its own cached length through a key mask.

With ``deterministic`` (``[engine] deterministic``), a row's decode logits are bit-identical whatever
else is in its step (which rows, how many, how long, on which adapters): a user's seeded answer does
not move when another user's answers change. The kernels keep that only at some shapes, so
:meth:`CausalLMRunner.decode` pads to them (measured on the CPU, torch 2.13 with MKL 2024.2, 1 to 8
threads):

* MKL's sgemm computes a row that falls in a partial block of 4 rows (M = 1, 2, 3, or a tail of 5..11
  rows) with other kernels than a full block: that row's outputs move by up to ~1e-6. The step's rows
  are padded to a multiple of :data:`~clawrl.engine.lora_step.GEMM_ROW_BLOCK` (a padded row is token 0
  at position 0 that never reads or writes the cache), and so are the LM head's;
* SDPA's CPU kernel rounds a row differently with the batch size (:func:`attend_one` says why), so a
  decode step's attention is written out instead; its sums over the key span still depend on the span's
  tail when it is not a multiple of 16 (the step's span is its longest row's): the span is rounded up
  to a multiple of :data:`DECODE_SPAN_MULTIPLE` within the cache's capacity (the extra keys are masked).

The padding costs a decode step of 1 row ~40% more time, of 16 rows 6-10% (2 CPU cores, smollm2-135m
shapes), so it is off by default: a step then runs at its own shapes through SDPA, and a row's logits
may move by ~1e-6 with its batch mates. The CUDA path pads to its own buckets
(clawrl/engine/cuda_graphs.py), and the fused decode compiles its own kernels: neither is covered.

A third, :meth:`CausalLMRunner.extend`, runs one chunk of a long prompt in one row after the
chunks before it (chunked prefill: the engine bounds the tokens a step computes).

The cache (:class:`KVCache`) is one ``(rows, kv_heads, capacity, head_dim)`` buffer per layer and
per K/V. Active sequences occupy rows ``0..B-1`` (the engine moves the last row into a freed one),
so decode reads plain slices, never a gather. Rows and capacity grow by doubling, up to the batch
size, the context limit and a budget of token slots; a reset gives the memory back to the system.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from transformers.models.llama.modeling_llama import rotate_half

from clawrl.engine.lora_step import GEMM_ROW_BLOCK, DenseStep, RowAdapters
from clawrl.engine.memory import give_back, memory_held

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
# A decode step's key span is a multiple of this (module docstring): the CPU's softmax and matmuls give a row the same
# sums for every span that is a multiple of 16 (measured for spans up to 2,200); 64 leaves room for wider vectors.
DECODE_SPAN_MULTIPLE = 64

log = logging.getLogger("clawrl.engine")


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int


def build_model_spec(config) -> ModelSpec:
    """The shape facts of an HF Llama/Qwen3 config; raises ValueError for anything else."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":  # the RoPE tables are computed once, for every position
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; only 'default'")
    if model_type == "qwen3" and getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=head_dim)


def attend_one(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention of one query a row, q (B, heads, 1, hd), over keys and values (B, kv_heads, span, hd) where
    ``mask`` (B, 1, 1, span) is True: softmax(q·kᵀ/√hd)·v written out, each kv head's query group one matmul.
    Not SDPA's CPU kernel: that one splits the keys over threads when B x heads is small next to the thread
    count, so a row's rounding changed with how many rows shared its step (B = 1 vs 2 on 2 threads, up to
    B = 13 on 16); this form gives a row the same bits for any B and thread count (1 to 16 measured)."""
    b, heads, _, hd = q.shape
    kv = keys.shape[1]
    scores = torch.matmul(q.view(b, kv, heads // kv, hd), keys.transpose(-1, -2)) * hd ** -0.5  # (B, kv, g, span)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(weights, values).view(b, heads, 1, hd)


class KVBudgetError(RuntimeError):
    """The KV cache would need more token slots than its budget (the scheduler admits so it never does)."""


class KVCache:
    """Per-layer K and V buffers of shape (rows, kv_heads, capacity, head_dim).

    Both dimensions grow on demand (by doubling, up to ``max_rows`` = the engine's max batch size
    and ``max_len`` = the context limit) and are released by :meth:`reset` when the engine goes
    idle. ``max_tokens`` bounds rows x capacity, the token slots held: growth stops there, and a
    request for more raises :class:`KVBudgetError`. ``releases`` counts the resets that gave memory
    back to the system, ``released_bytes`` is what the last one gave (memory.memory_held before - after)."""

    def __init__(self, spec: ModelSpec, rows: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 max_tokens: int | None = None):
        self.spec, self.max_rows, self.max_len, self.dtype, self.device = spec, rows, max_len, dtype, device
        self.max_tokens = max_tokens or rows * max_len
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.rows = self.capacity = 0
        self.generation = 0  # counts buffer reallocations: what captured the old buffers' addresses is stale
        self.releases = self.released_bytes = 0

    @property
    def slot_bytes(self) -> int:
        """Bytes of K and V per token slot, over all layers."""
        return 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * self.dtype.itemsize

    def memory_stats(self) -> dict[str, int]:
        return {"kv_capacity": self.capacity, "kv_rows": self.rows, "kv_budget_tokens": self.max_tokens,
                "kv_bytes": self.rows * self.capacity * self.slot_bytes, "memory_releases": self.releases,
                "released_bytes": self.released_bytes}

    @torch.inference_mode()
    def ensure(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` positions, keeping what is cached (the buffers
        never shrink while in use: :meth:`reset` releases them)."""
        if rows <= self.rows and length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"KV length {length} exceeds the context limit {self.max_len}")
        rows, length = max(rows, self.rows), max(length, self.capacity)
        if rows * length > self.max_tokens:
            raise KVBudgetError(f"{rows} rows x {length} positions exceed the KV budget of {self.max_tokens} tokens")
        new_rows = min(self.max_rows, max(rows, 2 * self.rows, 1)) if rows > self.rows else rows
        new_cap = min(self.max_len, max(length, 2 * self.capacity, 64)) if length > self.capacity else length
        if new_rows * new_cap > self.max_tokens:  # grow less: first the spare positions, then the spare rows
            new_cap = max(length, min(new_cap, self.max_tokens // new_rows))
            new_rows = max(rows, min(new_rows, self.max_tokens // new_cap))
        shape = (new_rows, self.spec.num_kv_heads, new_cap, self.spec.head_dim)
        old_k, old_v, old_rows, old_cap = self.k, self.v, self.rows, self.capacity
        self.k = self.v = []  # the old buffers go as soon as they are copied
        # zeros, not empty: a masked key still enters the attention matmul with weight exactly 0,
        # and 0 * NaN (uninitialised memory) would poison the row
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        for new, old in zip(new_k + new_v, old_k + old_v):
            new[:old_rows, :, :old_cap].copy_(old)
        del old_k, old_v
        self.k, self.v, self.rows, self.capacity = new_k, new_v, new_rows, new_cap
        self.generation += 1

    @torch.inference_mode()
    def shrink(self, rows: int, length: int) -> None:
        """Keep only the first ``rows`` rows and ``length`` positions (the caller knows nothing live
        is beyond): what longer requests that finished left behind must not keep new rows out."""
        rows, length = min(rows, self.rows), min(length, self.capacity)
        if (rows, length) == (self.rows, self.capacity):
            return
        self.k = [buf[:rows, :, :length].clone() for buf in self.k]
        self.v = [buf[:rows, :, :length].clone() for buf in self.v]
        self.rows, self.capacity = rows, length
        self.generation += 1

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of row ``src`` into row ``dst``."""
        if src == dst or length == 0:
            return
        for buf in self.k + self.v:
            buf[dst, :, :length].copy_(buf[src, :, :length])

    def reset(self, release: bool = False) -> None:
        """Drop every buffer (the next sequence allocates afresh) and give the memory back to the system,
        also with nothing held (``release``: the caller freed other memory, the prefix cache's say)."""
        device, held = torch.device(self.device), self.rows * self.capacity or release
        before = memory_held(device) if held else 0
        self.k, self.v, self.rows, self.capacity = [], [], 0, 0
        self.generation += 1
        if held:
            give_back(device)
            self.releases, self.released_bytes = self.releases + 1, max(0, before - memory_held(device))


class CausalLMRunner:
    """Prefill and decode over a KV cache for an HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``."""

    def __init__(self, hf_model, max_positions: int, *, deterministic: bool = False):
        self.hf = hf_model
        self.deterministic = deterministic  # unfused decode at padded shapes: batch-invariant (module docstring)
        self.spec = build_model_spec(hf_model.config)
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.max_positions = max_positions
        with torch.inference_mode():  # cos, sin (max_positions, head_dim): HF's values, looked up per position
            cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device),
                                                 torch.arange(max_positions, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]
        self._layers = list(hf_model.model.layers)
        self.fused = None  # FusedDecode once fuse_decode() is called
        if len(self._layers) != self.spec.num_layers:
            raise ValueError(f"config says {self.spec.num_layers} layers, model has {len(self._layers)}")

    def fuse_decode(self) -> bool:
        """Decode through :class:`clawrl.engine.fused_decode.FusedDecode` (compiled, fused layer
        halves) from now on; False, with the reason logged, when this model's layers are not supported."""
        from clawrl.engine.fused_decode import FusedDecode, supports_fused_decode

        why = supports_fused_decode(self.hf)
        if why is not None:
            log.info("decode steps unfused: %s", why)
            return False
        self.fused = FusedDecode(self.hf, self.spec.head_dim)
        return True

    @property
    def row_block(self) -> int:
        """What a :class:`~clawrl.engine.lora_step.GroupedStep` pads its groups to: full blocks of rows when
        ``deterministic`` (module docstring), else 1 (no padding)."""
        return GEMM_ROW_BLOCK if self.deterministic else 1

    @staticmethod
    def rows(n: int) -> int:
        """The cache rows a decode step of ``n`` sequences uses (the padded CUDA path uses more)."""
        return n

    def new_cache(self, rows: int, max_tokens: int | None = None) -> KVCache:
        return KVCache(self.spec, rows, self.max_positions, self.dtype, self.device, max_tokens)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], rows: list[int], cache: KVCache,
                keep_from: list[int], lora=None) -> list[Tensor]:
        """Run ``prompts`` causally from position 0, writing K/V into cache ``rows``; ``lora`` (one adapter
        for all of them, clawrl/engine/lora_step.py) adds its deltas.

        Returns, per prompt i, the final-norm hidden states (len_i - keep_from[i], hidden) of
        positions ``keep_from[i] .. len_i - 1``; :meth:`lm_head` turns them into logits (the
        caller decides how many positions at a time, which bounds the logits' memory)."""
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        cache.ensure(max(rows) + 1, width)
        ids = pad_sequence([torch.tensor(p, dtype=torch.long) for p in prompts], batch_first=True).to(self.device)
        row_idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        cos, sin = self.cos[:width][None, None], self.sin[:width][None, None]  # (1, 1, L, hd)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[layer][row_idx, :, :width] = k
            cache.v[layer][row_idx, :, :width] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        hidden = self._forward(ids, cos, sin, attend, lora)  # (n, L, D)
        return [hidden[i, start:length] for i, (start, length) in enumerate(zip(keep_from, lengths))]

    @torch.inference_mode()
    def extend(self, ids: list[int], row: int, start: int, cache: KVCache, keep_from: int, lora=None) -> Tensor:
        """A chunk of a long prompt: run ``ids`` at positions ``start ..`` of cache row ``row``,
        whose first ``start`` positions are cached, attending over them and causally within the
        chunk; writes the chunk's K/V. Returns the final-norm hidden states of the chunk's
        positions ``keep_from ..`` (relative to the chunk)."""
        end = start + len(ids)
        cache.ensure(row + 1, end)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        cos, sin = self.cos[start:end][None, None], self.sin[start:end][None, None]
        mask = torch.arange(end, device=self.device)[None, :] <= torch.arange(start, end, device=self.device)[:, None]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[layer], cache.v[layer]
            kc[row, :, start:end] = k[0]
            vc[row, :, start:end] = v[0]
            keys, values = kc[row:row + 1, :, :end], vc[row:row + 1, :, :end]
            if q.is_cuda and keys.shape[1] != q.shape[1]:  # CUDA's masked kernels take no GQA: repeat the heads
                keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], 1)
                values = values.repeat_interleave(q.shape[1] // values.shape[1], 1)
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

        return self._forward(x, cos, sin, attend, lora)[0, keep_from:]

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache, lora: RowAdapters | None = None) -> Tensor:
        """One step for cache rows ``0..B-1``: ``tokens[b]`` sits at ``positions[b]`` and attends
        to that row's cached positions ``0..positions[b]``; ``lora``: each row's adapter
        (clawrl/engine/lora_step.py). Returns fp32 logits (B, vocab). With ``deterministic`` and unfused, at
        padded shapes (module docstring): each row's logits are the same bits whatever the other rows are."""
        b, need = tokens.shape[0], int(positions.max()) + 1
        cache.ensure(b, need)
        if self.fused is not None or not self.deterministic:  # at its own shapes (the fused kernels: their own)
            return self.decode_rows(tokens.to(self.device), positions.to(self.device), cache, need,
                                    None if lora is None else lora.step())
        span = min(cache.capacity, -(-need // DECODE_SPAN_MULTIPLE) * DECODE_SPAN_MULTIPLE)
        pad = -b % GEMM_ROW_BLOCK
        tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
        return self.decode_rows(tokens.to(self.device), positions.to(self.device), cache, span,
                                None if lora is None else lora.step(b + pad, block=self.row_block), live=b)[:b]

    @torch.inference_mode()
    def decode_rows(self, tokens: Tensor, positions: Tensor, cache: KVCache, span: int, lora=None,
                    live: int | None = None) -> Tensor:
        """:meth:`decode` on device tensors over the first ``span`` cached positions (at least
        ``positions.max() + 1``; the cache holds ``len(tokens)`` rows and ``span`` positions), ``lora`` a
        step of clawrl/engine/lora_step.py. No host synchronisation and no shapes that depend on values
        (with a :class:`DenseStep`, or none): a CUDA graph can capture it. ``live``: only the first ``live``
        rows are cache rows; the others pad the batch, attend to nothing (their attention output is 0) and
        write no K/V (unfused only)."""
        b = tokens.shape[0]
        n = b if live is None else live
        rows = torch.arange(n, device=self.device)
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # (B, 1, 1, hd)
        # key j of row b is visible iff j <= positions[b]: the row's own history plus this token
        mask = (torch.arange(span, device=self.device)[None, :] <= positions[:n, None])[:, None, None, :]
        if self.fused is not None and live is None and (lora is None or isinstance(lora, DenseStep)):
            try:
                return self.lm_head(self.fused.forward(tokens, positions, cos[:, 0], sin[:, 0], mask, cache, span,
                                                       lora))
            except Exception as e:  # a compiler missing or failing: this runner decodes unfused from now on
                if tokens.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                log.warning("fused decode failed, decoding unfused from now on: %s: %s", type(e).__name__, e)
                self.fused = None

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[layer], cache.v[layer]
            kc[rows, :, positions[:n]] = k[:n, :, 0]
            vc[rows, :, positions[:n]] = v[:n, :, 0]
            if live is None:
                return F.scaled_dot_product_attention(q, kc[:b, :, :span], vc[:b, :, :span], attn_mask=mask,
                                                      enable_gqa=True)
            out = attend_one(q[:n], kc[:n, :, :span], vc[:n, :, :span], mask)
            return out if n == b else F.pad(out, (0, 0, 0, 0, 0, 0, 0, b - n))  # the padding rows: 0

        hidden = self._forward(tokens[:, None], cos, sin, attend, lora)  # (B, 1, D)
        return self.lm_head(hidden[:, 0])

    def _forward(self, ids: Tensor, cos: Tensor, sin: Tensor, attend, lora=None) -> Tensor:
        n, length, head_dim = *ids.shape, self.spec.head_dim
        h = self.hf.model.embed_tokens(ids)  # (N, L, D)

        def proj(module, i: int, name: str, x: Tensor) -> Tensor:  # the base matmul, plus the adapters' deltas
            return module(x) if lora is None else lora.add(i, name, x, module(x))

        for i, layer in enumerate(self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q = proj(attn.q_proj, i, "q_proj", x).view(n, length, -1, head_dim)
            k = proj(attn.k_proj, i, "k_proj", x).view(n, length, -1, head_dim)
            v = proj(attn.v_proj, i, "v_proj", x).view(n, length, -1, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (N, heads, L, hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            h = h + proj(attn.o_proj, i, "o_proj", attend(i, q, k, v).transpose(1, 2).reshape(n, length, -1))
            x = layer.post_attention_layernorm(h)
            if lora is None:
                h = h + mlp(x)
            else:  # HF's MLP op for op, each projection through proj
                gated = mlp.act_fn(proj(mlp.gate_proj, i, "gate_proj", x)) * proj(mlp.up_proj, i, "up_proj", x)
                h = h + proj(mlp.down_proj, i, "down_proj", gated)
        return self.hf.model.norm(h)

    @torch.inference_mode()
    def lm_head(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states (..., hidden) -> fp32 logits (..., vocab). With ``deterministic``, (n, hidden)
        padded to full blocks of rows (module docstring): it adds no dependence of a row's logits on the rows
        computed with it (the first tokens of the prompts a prefill step completes together)."""
        if not self.deterministic or hidden.dim() != 2 or hidden.shape[0] % GEMM_ROW_BLOCK == 0:
            return self.hf.lm_head(hidden).float()
        n = hidden.shape[0]
        return self.hf.lm_head(F.pad(hidden, (0, 0, 0, -n % GEMM_ROW_BLOCK))).float()[:n]
