"""Training throughput and MFU of one bf16 GPU: megatron-core (local spec + SDPA attention) vs
plain transformers + torch, on a Qwen3-shaped model with random weights (nothing downloaded).

    python -m clawrl.bench.mfu --model qwen3-0.6b --seq 2048 --batch 8 --backend megatron --steps 10
    python -m clawrl.bench.mfu --model qwen3-0.6b --seq 2048 --batch 8 --backend hf --steps 10
    python -m clawrl.bench.mfu --model tiny --device cpu --backend megatron --steps 1    # smoke test

A step is forward + backward + AdamW step on ``batch`` random sequences of ``seq`` tokens with the
next-token cross-entropy loss. Both backends start from the same random weights (the megatron
model is converted from the HF one), hold bf16 parameters and gradients and use torch's fused
AdamW (on the CPU: float32, unfused). Prints one JSON object; ``loss_first`` of the two
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
import copy
import json
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from clawrl.bench import cpu_model

PEAK_TFLOPS = 790.0


def _qwen3(**shape: int) -> Qwen3Config:
    """A Qwen3 config of ``shape`` with Qwen3's own norm epsilon, RoPE and tied embeddings."""
    return Qwen3Config(**shape, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_cache=False)


SHAPES = {
    "qwen3-0.6b": _qwen3(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-4b": _qwen3(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=9728, vocab_size=151936),
    # the smoke-test shape: the unit tests' tiny-qwen3 layout with a small vocabulary
    "tiny": _qwen3(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=160, vocab_size=1024),
}


def count_matmul_params(c: Qwen3Config) -> int:
    """N = L (H·(nq+2nkv)·hd + nq·hd·H + 3·H·F) + H·V (see the module docstring)."""
    h, q_width = c.hidden_size, c.num_attention_heads * c.head_dim
    attention = h * (q_width + 2 * c.num_key_value_heads * c.head_dim) + q_width * h
    mlp = 3 * h * c.intermediate_size  # gate, up, down
    return c.num_hidden_layers * (attention + mlp) + h * c.vocab_size


def compute_flops_per_sequence(c: Qwen3Config, seq: int) -> int:
    """6·N·s + 12·L·(nq·hd)·s² training FLOPs for one sequence of ``seq`` tokens."""
    return 6 * count_matmul_params(c) * seq + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq**2


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
    cfg = copy.deepcopy(SHAPES[shape_name])  # building a model may write to its config
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    runtime = None
    if backend == "hf":
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
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)

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
    flops = compute_flops_per_sequence(cfg, seq) * batch
    result = {
        "model": shape_name, "backend": backend, "attention": attention if backend == "megatron" else "sdpa",
        "device": dev.type, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
        "dtype": str(dtype), "seq": seq, "batch": batch, "steps": steps, "warmup": warmup, "params": n_params,
        "matmul_params": count_matmul_params(cfg), "step_s_median": step_s, "step_s_all": times,
        "loss_first": losses[0], "loss_last": losses[-1], "tokens_per_s": batch * seq / step_s,
        "model_tflops_per_step": flops / 1e12, "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / (peak_tflops * 1e12), "peak_tflops": peak_tflops,
        "flops_formula": "6*N*s + 12*L*(nq*hd)*s^2 per sequence (PaLM App. B; full s^2 attention)",
        "torch": torch.__version__,
    }
    if dev.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if runtime is not None:
        from clawrl.train.megatron_shims import shutdown_megatron

        shutdown_megatron(runtime)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(SHAPES), default="qwen3-0.6b", help="tiny: the 2-layer smoke-test shape")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu; bf16 on cuda, "
                    "float32 on cpu")
    ap.add_argument("--backend", choices=["megatron", "hf"], required=True)
    ap.add_argument("--attention", choices=["sdpa", "local"], default="sdpa", help="megatron core attention")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    a = ap.parse_args(argv)
    result = run_benchmark(a.model, backend=a.backend, seq=a.seq, batch=a.batch,
                           steps=a.steps, warmup=a.warmup, attention=a.attention, peak_tflops=a.peak_tflops,
                           device=a.device)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
