"""Training throughput and MFU of one bf16 GPU: megatron-core (local spec + SDPA attention) vs
plain transformers + torch, on a Qwen3-shaped model with random weights (nothing downloaded).

    python -m clawrl.bench.mfu --model qwen3-0.6b --seq 2048 --batch 8 --backend megatron --steps 10
    python -m clawrl.bench.mfu --model qwen3-0.6b --seq 2048 --batch 8 --backend hf --steps 10
    python -m clawrl.bench.mfu --tiny --backend megatron --steps 1        # CPU smoke test

A step is forward + backward + AdamW step on ``batch`` random sequences of ``seq`` tokens with the
next-token cross-entropy loss. Both backends start from the same random weights (the megatron
model is converted from the HF one), hold bf16 parameters and gradients and use torch's fused
AdamW (``--tiny`` on CPU: float32, unfused). Prints one JSON object; ``loss_first`` of the two
backends should agree to bf16 precision.

FLOP count (model FLOPs, PaLM's convention: Chowdhery et al. 2022, appendix B):
    N      = L (H·(nq+2·nkv)·hd + nq·hd·H + 3·H·F) + H·V    matmul weights: attention, SwiGLU
             MLP, and the output projection (counted once when tied; the embedding lookup is free)
    per token, training:  6·N + 12·L·nq·hd·s
    per sequence:         6·N·s + 12·L·(nq·hd)·s²
The attention term counts the full s×s score matrix (QK^T and AV, forward + 2x backward) although
a causal kernel skips half of it, as PaLM does; norms, RoPE, softmax and the optimizer are not
counted. MFU = (model FLOPs per step / step time) / peak, peak = 790 TFLOP/s (dense bf16 H200,
measured for an 8192³ matmul in this workplace).

Imports only torch, transformers and megatron-core (through clawrl.train.convert,
megatron_model and megatron_shims, which import nothing else), so the script runs on a GPU machine
that has no other clawrl dependency installed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

PEAK_TFLOPS = 790.0


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True


SHAPES = {
    "qwen3-0.6b": ModelShape(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936),
    "qwen3-4b": ModelShape(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=151936),
    # the CPU smoke shape (--tiny): the unit tests' tiny-qwen3 layout with a small vocabulary
    "tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=160, vocab=1024),
}


def count_matmul_params(s: ModelShape) -> int:
    """N = L (H·(nq+2nkv)·hd + nq·hd·H + 3·H·F) + H·V (see the module docstring)."""
    attention = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    mlp = 3 * s.hidden * s.ffn  # gate, up, down
    return s.layers * (attention + mlp) + s.hidden * s.vocab


def compute_flops_per_sequence(s: ModelShape, seq: int) -> int:
    """6·N·s + 12·L·(nq·hd)·s² training FLOPs for one sequence of ``seq`` tokens."""
    return 6 * count_matmul_params(s) * seq + 12 * s.layers * s.heads * s.head_dim * seq**2


def build_hf_config(s: ModelShape):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=s.tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_cache=False,
    )


def _build_hf(cfg, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    with device:  # initialise on the device: a 4B model's CPU init alone takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")

    def loss_fn(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    return model, loss_fn


def _build_megatron(cfg, dtype: torch.dtype, device: torch.device, attention: str, seed: int):
    """The megatron twin of the HF model ``_build_hf`` makes for this seed, loaded from its
    weights, so both backends start from identical weights (and their losses can be compared)."""
    from clawrl.train.convert import hf_to_megatron, megatron_config_from_hf
    from clawrl.train.megatron_model import build_gpt_model, load_megatron_weights
    from clawrl.train.megatron_shims import init_megatron

    runtime = init_megatron(1, seed)
    torch.manual_seed(seed)
    hf_model, _ = _build_hf(cfg, dtype, device)
    args = megatron_config_from_hf(cfg, dtype=dtype, tp=1, use_cpu_initialization=device.type == "cpu")
    model = build_gpt_model(args, attention=attention, device=device)
    load_megatron_weights(model, hf_to_megatron(hf_model.state_dict(), cfg))
    del hf_model

    def loss_fn(ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        positions = torch.arange(s, device=ids.device).expand(b, s)
        # labels make GPTModel return the per-token vocab-parallel cross-entropy, (b, s)
        labels = torch.roll(ids, shifts=-1, dims=1)
        return model(input_ids=ids, position_ids=positions, attention_mask=None, labels=labels)[:, :-1].mean()

    return model, loss_fn, runtime


def run_benchmark(shape_name: str, *, backend: str, seq: int, batch: int, steps: int, warmup: int,
                  attention: str = "sdpa", seed: int = 0, peak_tflops: float = PEAK_TFLOPS,
                  device: str | None = None) -> dict:
    """Build, warm up, time ``steps`` training steps; returns the JSON-able result."""
    shape = SHAPES[shape_name]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    cfg = build_hf_config(shape)
    runtime = None
    if backend == "hf":
        torch.manual_seed(seed)
        model, loss_fn = _build_hf(cfg, dtype, dev)
    elif backend == "megatron":
        model, loss_fn, runtime = _build_megatron(cfg, dtype, dev, attention, seed)
    else:
        raise ValueError(f"unknown backend {backend!r}; valid: hf, megatron")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=dev.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=g).to(dev)

    def step() -> float:
        loss = loss_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # float() waits for the stream: the step is finished when it returns

    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)

    step_s = sorted(times)[len(times) // 2]  # median: robust to one slow step
    flops = compute_flops_per_sequence(shape, seq) * batch
    result = {
        "model": shape_name, "backend": backend, "attention": attention if backend == "megatron" else "sdpa",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype),
        "seq": seq, "batch": batch, "steps": steps, "warmup": warmup, "params": n_params,
        "matmul_params": count_matmul_params(shape), "step_s_median": step_s, "step_s_all": times,
        "loss_first": losses[0], "loss_last": losses[-1], "tokens_per_s": batch * seq / step_s,
        "model_tflops_per_step": flops / 1e12, "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / (peak_tflops * 1e12), "peak_tflops": peak_tflops,
        "flops_formula": "6*N*s + 12*L*(nq*hd)*s^2 per sequence (PaLM App. B; full s^2 attention)",
        "shape": asdict(shape), "torch": torch.__version__,
    }
    if dev.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if runtime is not None:
        from clawrl.train.megatron_shims import shutdown_megatron

        shutdown_megatron(runtime)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=[k for k in SHAPES if k != "tiny"], default="qwen3-0.6b")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer smoke shape (overrides --model); "
                    "float32 on CPU, bf16 on a GPU")
    ap.add_argument("--backend", choices=["megatron", "hf"], required=True)
    ap.add_argument("--attention", choices=["sdpa", "local"], default="sdpa", help="megatron core attention")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    a = ap.parse_args(argv)
    result = run_benchmark("tiny" if a.tiny else a.model, backend=a.backend, seq=a.seq, batch=a.batch,
                           steps=a.steps, warmup=a.warmup, attention=a.attention, peak_tflops=a.peak_tflops)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
