"""Training throughput: one PPO step of the trainer's backend (torch or megatron) vs a plain HF training step.

The bound is what any trainer pays for the batch: one forward + backward of the policy with a
cross-entropy loss on the output tokens, grad-norm clip, one AdamW step. A PPO step does that
same work plus what the objective needs on top:

  * a no-grad forward of the frozen reference when ``kl_coef > 0`` (the KL term), unless the samples
    brought the reference's log-probs from the judge (``ppo_step_judge_ref``: the judge holds the initial weights);
  * entropy and the PPO metrics (one extra pass over the logits, no grad).

The old log-probs cost nothing: they are read from the training forward itself (see
``clawrl/train/base.py``). Rows report the PPO step with and without the reference (KL on / off)
and the reference forward alone, so the overhead can be attributed. On a GPU each step also gets its
MFU: the model FLOPs of a training step (``clawrl.bench.mfu``'s count, 6·N·s + attention; the reference
forward is work on top that it does not count) per second over the H200's dense bf16 peak.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.common import bench_dtype, interleaved_times, machine_line, markdown_table
from clawrl.bench.mfu import PEAK_TFLOPS, compute_flops_per_sequence
from clawrl.config import PPOSettings
from clawrl.train.base import ADAM_BETAS, GRAD_CLIP, WEIGHT_DECAY, PPOHyperParams, TrainBackend
from clawrl.train.batch import TokenBatch, synthetic_batch

BENCH_HP = PPOHyperParams.from_settings(PPOSettings(), seed=0)  # the default config (combine, KL on)


def _plain_step(model_dir: Path, hp: PPOHyperParams, device: str, dtype: str) -> Callable[[TokenBatch], None]:
    """The bound: HF forward with labels (its own cross-entropy), backward, clip, AdamW; float32
    weights, the forward under autocast when ``dtype`` is not float32 (as TorchBackend does)."""
    from clawrl.models import load_causal_lm, torch_dtype

    model = load_causal_lm(model_dir, "float32", device)
    params, compute_dtype = list(model.parameters()), torch_dtype(dtype)
    optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY,
                                  fused=torch.device(device).type == "cuda")

    def step(batch: TokenBatch) -> None:
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        labels[:, 1:] = labels[:, 1:].masked_fill(batch.response_mask == 0, -100)  # train on outputs only
        with torch.autocast(torch.device(device).type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            loss = model(input_ids=batch.input_ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _backend(kind: str, model_dir: Path, hp: PPOHyperParams, device: str, dtype: str) -> TrainBackend:
    """The trainer's backend as the train flow builds it (Megatron: its default attention, SDPA on CUDA)."""
    if kind == "megatron":
        from clawrl.train.megatron_backend import MegatronBackend

        return MegatronBackend(model_dir, hp, dtype=dtype, device=device)
    from clawrl.train.torch_backend import TorchBackend

    return TorchBackend(model_dir, hp, dtype=dtype, device=device)


def run_train_bench(model_names: tuple[str, ...] = ("tiny", "smollm2-135m"), *, cache_dir: Path,
                    batch_size: int = 8, seq_len: int = 256, prompt_len: int | None = None, warmup: int = 1,
                    repeats: int = 3, device: str = "cpu", backend: str = "torch",
                    progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Seconds (best and median of ``repeats``) and tokens/s (all B*L positions, best run) per step
    for: the plain HF step (the bound), the PPO step of ``backend`` with the KL reference
    computed in the step (``ppo_step``), brought by the samples (``ppo_step_judge_ref``) and without
    it (``ppo_step_no_ref``), and the reference forward alone. ``vs_bound`` = best bound time / best time (>= 0.8 is the target); ``mfu`` on
    CUDA (module docstring). Prompts are half of ``seq_len`` unless ``prompt_len`` says otherwise.
    ``progress(label)`` is called after each timed step."""
    from transformers import AutoConfig

    from clawrl.models import load_tokenizer, resolve_model_dir

    rows: list[dict[str, Any]] = []
    dtype = bench_dtype(device)
    prompt_len = seq_len // 2 if prompt_len is None else prompt_len
    for name in model_names:
        model_dir = resolve_model_dir(name, Path(cache_dir))
        tok = load_tokenizer(model_dir)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        batch = synthetic_batch(len(tok), batch_size=batch_size, prompt_len=prompt_len,
                                output_len=seq_len - prompt_len, pad_id=pad_id, teacher=True).to(device)
        tokens = batch_size * seq_len
        hp = dataclasses.replace(BENCH_HP, micro_batch_size=batch_size)
        plain = _plain_step(model_dir, hp, device, dtype)
        with_ref = _backend(backend, model_dir, hp, device, dtype)
        no_ref = _backend(backend, model_dir, dataclasses.replace(hp, kl_coef=0.0), device, dtype)
        flops = batch_size * compute_flops_per_sequence(AutoConfig.from_pretrained(str(model_dir)), seq_len)
        # what samples judged by an engine holding the initial weights bring
        judged = dataclasses.replace(batch, ref_logprobs=with_ref.compute_logprobs(batch, reference=True),
                                     has_ref=torch.ones(batch_size, dtype=torch.bool, device=device))
        results = interleaved_times({
            "hf_step": lambda: plain(batch),
            "ppo_step": lambda: with_ref.train_step(batch),
            "ppo_step_judge_ref": lambda: with_ref.train_step(judged),
            "ppo_step_no_ref": lambda: no_ref.train_step(batch),
            "ref_forward": lambda: with_ref.compute_logprobs(batch, reference=True),
        }, repeats, warmup, device=device, progress=progress and (lambda label: progress(f"{name} {label}")))
        bound = results["hf_step"][0]
        for k, (best, median) in results.items():
            train = k != "ref_forward"
            rows.append(dict(model=name, what=k, backend="hf" if k == "hf_step" else backend, device=device,
                             dtype=dtype, batch=batch_size, seq_len=seq_len, threads=torch.get_num_threads(),
                             seconds=round(best, 4), seconds_median=round(median, 4),
                             tokens_per_s=round(tokens / best, 1), vs_bound=round(bound / best, 3) if train else None,
                             mfu=f"{100 * flops / best / (PEAK_TFLOPS * 1e12):.1f}%" if train and device != "cpu"
                             else None))
        runtime = getattr(with_ref, "runtime", None)  # megatron: the process group it started
        del plain, with_ref, no_ref
        gc.collect()
        if runtime is not None:
            from clawrl.train.megatron_shims import shutdown_megatron

            shutdown_megatron(runtime)
    return rows


def format_train_section(train_rows: list[dict[str, Any]], sync_rows: list[dict[str, Any]]) -> str:
    """The train section: the PPO step vs its bound (these rows) and the weight sync vs its (clawrl.bench.sync);
    either list may be empty (``clawrl bench train --parts``)."""
    first = (train_rows or sync_rows)[0]
    lines = ["## Training step and weight sync", "", machine_line(first["device"], first["dtype"])]
    if train_rows:
        lines += [
            f"(a) One PPO step (the backend's `train_step`, {train_rows[0]['batch']} x {train_rows[0]['seq_len']} "
            "tokens, one micro-batch) vs a plain HF forward + backward + AdamW step of the same batch (the bound;",
            "target vs_bound >= 0.8). `ppo_step` computes the KL reference log-probs itself, `ppo_step_judge_ref` gets "
            "them from the judge's engine when it holds the initial weights,",
            "`ppo_step_no_ref` has no KL term; `mfu` (GPU): training FLOP/s over the 790 TFLOP/s bf16 peak.", "",
            markdown_table(train_rows, ["model", "what", "backend", "threads", "seconds", "seconds_median",
                                        "tokens_per_s", "vs_bound", "mfu"]), ""]
    if sync_rows:
        lines += [
            "(b) Weight sync into an idle embedded engine vs its bound (target <= 1.5x): `in_process` = pause, copy "
            "the state dict, continue vs copying the same tensors;",
            "`disk_sync` = checkpoint save + `update_weights_from_disk` vs safetensors save_file + load_file of the "
            "same state dict.", "",
            markdown_table(sync_rows, ["model", "path", "bytes", "seconds", "seconds_median", "bound_seconds",
                                       "vs_bound", "load_1m"])]
    return "\n".join(lines).rstrip("\n")
