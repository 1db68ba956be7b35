"""Engine throughput: the embedded engine at several concurrencies against HF ``generate``.

Every request is greedy with ``ignore_eos`` (HF: ``min_new_tokens``), so each one produces exactly
``new_tokens`` tokens and tokens/s compares like with like. Prompts are short chat-templated user
messages. The engine rows keep ``concurrency`` requests in flight (a closed loop over
``ROUNDS * concurrency`` requests); the HF rows run ``model.generate`` on a static left-padded
batch. Numbers on a shared machine move with its load, so each row carries the 1-minute load
average measured after the model's passes.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.common import (Target, bench_dtype, gather_bounded, interleaved_times, load_average, machine_line,
                                 markdown_table, target_lines)
from clawrl.sim.prompts import QUESTIONS

ROUNDS = 2  # requests per row = ROUNDS * concurrency (or batch size)

# on CPU the targets are the real model's: the tiny one's steps are too short for batching to pay the same way
CPU_TARGET_MODEL = "smollm2-135m"
CPU_TARGETS = (Target("16 in flight at least 5x the engine at 1", "embedded", 16, "vs_c1", 5.0),
               Target("16 in flight at least 0.8x HF generate at batch 16", "embedded", 16, "vs_hf_b16", 0.8))
CUDA_TARGETS = (Target("64 in flight at least `hf_static` at batch 64", "embedded", 64, "vs_hf_static", 1.0),
                Target("GPU busy at 64 in flight", "embedded", 64, "gpu_busy", 0.6),
                Target("1 in flight at least `hf_static` at batch 1", "embedded", 1, "vs_hf_static", 1.0))


def build_bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat-templated prompts, each a short question of the simulated users (they cycle when n exceeds them)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)][0]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def run_engine_bench(model_names: tuple[str, ...] = ("tiny", "smollm2-135m"),
                     concurrencies: tuple[int, ...] = (1, 4, 16), new_tokens: int = 32, *, cache_dir: Path,
                     hf_batch_sizes: tuple[int, ...] = (1, 16), repeats: int = 3, device: str = "cpu",
                     progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per (model, system, concurrency): tokens/s of the embedded engine at each
    concurrency and of HF ``generate`` at each static batch size, on ``device`` (in :func:`bench_dtype`).
    On CUDA two more systems: ``embedded_eager`` (the engine with ``cuda_graphs`` off: the same
    padded steps launched kernel by kernel) and ``hf_static`` (``generate`` with
    ``cache_implementation="static"``, whose decode step transformers compiles with torch.compile
    ``reduce-overhead``; its compilation falls in the untimed pass). The graphed engine's CUDA rows
    carry ``gpu_busy``: the share of a pass's wall time the GPU spends in kernels and copies (one
    more pass, profiled; the eager rows' kernel-by-kernel launches would take the profiler minutes).

    The configurations are timed by :func:`interleaved_times` (one untimed pass each, then
    ``repeats`` interleaved passes); each row keeps its best pass. ``hf_static`` is timed on its
    own once the engines are closed: torch.compile's CUDA graphs and the engine's in one process
    ended in an illegal memory access once on an H200. ``progress(label)`` is called after each timed pass."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import load_causal_lm, load_tokenizer, resolve_model_dir

    rows: list[dict[str, Any]] = []
    dtype, cuda = bench_dtype(device), torch.device(device).type == "cuda"
    engine_systems = ("embedded", "embedded_eager") if cuda else ("embedded",)
    configs = [(e, c) for e in engine_systems for c in concurrencies] + [("hf_generate", b) for b in hf_batch_sizes]
    static_configs = [("hf_static", b) for b in hf_batch_sizes] if cuda else []
    for name in model_names:
        model_dir = resolve_model_dir(name, Path(cache_dir))
        tok = load_tokenizer(model_dir)
        prompts = build_bench_prompts(tok, max(n for _, n in configs) * ROUNDS)
        label = progress and (lambda text: progress(f"{name} {text}"))
        engines = {e: EmbeddedEngine(model_dir, dtype=dtype, device=device, max_batch_size=max(concurrencies),
                                     max_context_len=1024, cuda_graphs=e == "embedded") for e in engine_systems}
        model = load_causal_lm(model_dir, dtype, device)
        runner = asyncio.Runner()  # one event loop for the engines across the passes
        counts: dict[tuple[str, int], tuple[int, int | None]] = {}  # tokens, largest decode batch

        def measure(system: str, n: int) -> None:
            group = prompts[: n * ROUNDS]
            if system.startswith("hf"):
                counts[system, n] = _hf_generate(model, tok, group, n, new_tokens, system == "hf_static"), None
                return
            engine = engines[system]
            engine.reset_stats()  # max_batch_seen of this pass only
            tokens = runner.run(_engine_closed_loop(engine, group, n, new_tokens))
            counts[system, n] = tokens, engine.stats["max_batch_seen"]

        times = interleaved_times({f"{s} {n}": functools.partial(measure, s, n) for s, n in configs}, repeats,
                                  device=device, progress=label)
        busy = {(s, n): gpu_busy_fraction(functools.partial(measure, s, n))
                for s, n in configs if cuda and s == "embedded"}
        for engine in engines.values():
            runner.run(engine.close())
        runner.close()
        times |= interleaved_times({f"{s} {n}": functools.partial(measure, s, n) for s, n in static_configs}, repeats,
                                   device=device, progress=label)
        model_rows = [dict(model=name, system=s, concurrency=n, requests=n * ROUNDS, tokens=counts[s, n][0],
                           seconds=round(times[f"{s} {n}"][0], 4),
                           tokens_per_s=round(counts[s, n][0] / times[f"{s} {n}"][0], 1),
                           max_batch=counts[s, n][1], gpu_busy=busy.get((s, n)), device=device, dtype=dtype,
                           load_1m=load_average())
                      for s, n in configs + static_configs]
        _add_ratios(model_rows)
        rows += model_rows
        del engines, model
    return rows


def gpu_busy_fraction(fn: Callable[[], Any]) -> float:
    """Run ``fn`` under the torch profiler: the GPU's kernel and copy time over the wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return round(busy_us / wall_us, 3)


async def _engine_closed_loop(engine, prompts: list[list[int]], concurrency: int, new_tokens: int,
                              loras: list[str | None] | None = None) -> int:
    """All ``prompts``, ``concurrency`` in flight (prompt i on LoRA adapter ``loras[i]``): the tokens generated."""
    from clawrl.engine.types import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    loras = loras or [None] * len(prompts)
    results = await gather_bounded(concurrency, (engine.generate(GenerateRequest(input_ids=p, sampling_params=params,
                                                                                 lora_path=lo))
                                                 for p, lo in zip(prompts, loras)))
    return sum(len(r.output_ids) for r in results)


@torch.inference_mode()
def _hf_generate(model, tok, prompts: list[list[int]], batch: int, new_tokens: int, static: bool = False) -> int:
    """``model.generate`` over ``prompts`` in static left-padded batches of ``batch``: the tokens generated.
    ``static``: with a static KV cache (on CUDA, transformers then compiles the decode step)."""
    extra = {"cache_implementation": "static"} if static else {}
    tokens = 0
    for i in range(0, len(prompts), batch):
        enc = tok.pad({"input_ids": prompts[i: i + batch]}, padding_side="left", return_tensors="pt").to(model.device)
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, **extra)
        tokens += out[:, enc["input_ids"].shape[1]:].numel()
    return tokens


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """For one model's rows: vs_c1 = tokens/s over the engine's concurrency-1 row (engine rows only);
    vs_hf_b16 = over HF generate at batch 16; vs_hf_static = over ``hf_static`` at the same batch size."""
    tps = {(r["system"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    hf16 = tps.get(("hf_generate", 16))
    for r in rows:
        c1 = tps.get((r["system"], 1))
        static = tps.get(("hf_static", r["concurrency"]))
        r["vs_c1"] = round(r["tokens_per_s"] / c1, 2) if c1 and r["system"].startswith("embedded") else None
        r["vs_hf_b16"] = round(r["tokens_per_s"] / hf16, 2) if hf16 else None
        r["vs_hf_static"] = round(r["tokens_per_s"] / static, 2) if static else None


def _head(rows: list[dict[str, Any]], title: str, systems: str) -> list[str]:
    return [title, "", machine_line(rows[0]["device"], rows[0]["dtype"]),
            f"Greedy, `ignore_eos`, {rows[0]['tokens'] // rows[0]['requests']} new tokens per request, short "
            f"chat-templated prompts. {systems}", ""]


def format_engine_section(rows: list[dict[str, Any]]) -> str:
    if torch.device(rows[0]["device"]).type == "cuda":
        return _format_cuda_section(rows)
    body = [
        *_head(rows, "## Embedded engine throughput", "`embedded` keeps `concurrency` requests in flight;\n"
               "`hf_generate` is `model.generate` on a static left-padded batch. Best of interleaved passes after an "
               "untimed one; `load_1m`: the 1-minute load average after them."),
        markdown_table(rows, ["model", "system", "concurrency", "requests", "tokens", "seconds", "tokens_per_s",
                              "vs_c1", "vs_hf_b16", "load_1m"]),
        "",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        c16 = next((r for r in rows if r["model"] == name and r["system"] == "embedded" and r["concurrency"] == 16),
                   None)
        if c16 and c16["vs_c1"] is not None and c16["vs_hf_b16"] is not None:
            body.append(f"- {name}: 16 concurrent = {c16['vs_c1']}x the engine at 1 and "
                        f"{c16['vs_hf_b16']}x HF generate at batch 16.")
    body += target_lines(rows, CPU_TARGETS, [CPU_TARGET_MODEL])
    return "\n".join(body)


def _format_cuda_section(rows: list[dict[str, Any]]) -> str:
    body = [
        *_head(rows, "## Embedded engine throughput on CUDA",
               "`embedded`: decode steps (fused layers) replayed from CUDA graphs;\n`embedded_eager`: the same with "
               "`cuda_graphs = false`; `hf_generate`: `model.generate` on a static left-padded batch; `hf_static`: the "
               "same with\n`cache_implementation=\"static\"` (compiled decode). Best of interleaved passes after an "
               "untimed one; `gpu_busy`: GPU time over wall time (one profiled pass)."),
        markdown_table(rows, ["model", "system", "concurrency", "requests", "tokens", "seconds", "tokens_per_s",
                              "max_batch", "gpu_busy", "vs_c1", "vs_hf_static"]),
        "",
        *target_lines(rows, CUDA_TARGETS, list(dict.fromkeys(r["model"] for r in rows))),
    ]
    return "\n".join(body)
