"""Engine throughput: the embedded engine at several concurrencies against HF ``generate``.

Every request is greedy with ``ignore_eos`` (HF: ``min_new_tokens``), so each one produces exactly
``new_tokens`` tokens and tokens/s compares like with like. Prompts are short chat-templated user
messages. The engine rows keep ``concurrency`` requests in flight (a closed loop over
``rounds * concurrency`` requests); the HF rows run ``model.generate`` on a static left-padded
batch. Numbers on a shared machine move with its load, so each row carries the 1-minute load
average measured around it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.report import describe_machine, write_section

BENCH_MESSAGES = (
    "What is the capital of France?", "Give me three tips for sleeping better.", "Explain recursion briefly.",
    "Write a haiku about autumn.", "How do I reverse a list in Python?", "What causes rain?",
    "Name two prime numbers above 50.", "Summarise the plot of Hamlet in one line.",
    "What is 17 times 23?", "Suggest a name for a cat.", "Why is the sky blue?", "Translate 'thank you' into Spanish.",
    "What does a CPU do?", "List three fruits that are red.", "How far is the Moon?", "Define entropy simply.",
)
SECTION_START = "<!-- engine-bench:start -->"  # the markers write_section("engine", ...) uses
SECTION_END = "<!-- engine-bench:end -->"


def build_bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` short chat-templated prompts (the messages cycle when n exceeds them)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": BENCH_MESSAGES[i % len(BENCH_MESSAGES)]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def count_bench_runs(model_names, concurrencies, hf_batch_sizes, repeats: int = 3) -> int:
    """How many measurements (``progress`` calls) :func:`run_engine_bench` makes."""
    return len(model_names) * (len(concurrencies) + len(hf_batch_sizes)) * repeats


def run_engine_bench(model_names: tuple[str, ...] = ("tiny", "smollm2-135m"),
                     concurrencies: tuple[int, ...] = (1, 4, 16), new_tokens: int = 32, *, cache_dir: Path,
                     hf_batch_sizes: tuple[int, ...] = (1, 16), rounds: int = 2, repeats: int = 3,
                     max_batch_size: int = 16, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per (model, system, concurrency): tokens/s of the embedded engine at each
    concurrency and of HF ``generate`` at each static batch size.

    The configurations are measured in interleaved passes, ``repeats`` times, and each row keeps
    its best pass: on a shared machine a load spike then slows every system alike, and another
    process can only ever make a run slower. ``progress(label)`` is called after each measurement."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import load_causal_lm, load_tokenizer, resolve_model_dir

    rows: list[dict[str, Any]] = []
    for name in model_names:
        model_dir = resolve_model_dir(name, Path(cache_dir))
        tok = load_tokenizer(model_dir)
        prompts = build_bench_prompts(tok, max([*concurrencies, *hf_batch_sizes]) * rounds)
        engine = EmbeddedEngine(model_dir, max_batch_size=max_batch_size, max_context_len=1024)
        model = load_causal_lm(model_dir)
        runs: dict[tuple[str, int], Callable[[], tuple]] = {}
        for c in concurrencies:
            runs[("embedded", c)] = lambda c=c: asyncio.run(
                _engine_closed_loop(engine, prompts[: c * rounds], c, new_tokens))
        for b in hf_batch_sizes:
            runs[("hf_generate", b)] = lambda b=b: _hf_generate(model, tok, prompts[: b * rounds], b, new_tokens)
        best: dict[tuple[str, int], tuple] = {}
        peak_load: dict[tuple[str, int], float] = {}
        for i in range(repeats):
            for key, fn in runs.items():
                load_before = os.getloadavg()[0]
                result = fn()  # (seconds, tokens[, max_batch])
                peak_load[key] = max(peak_load.get(key, 0.0), load_before, os.getloadavg()[0])
                if key not in best or result[0] < best[key][0]:
                    best[key] = result
                if progress:
                    progress(f"{name} {key[0]} {key[1]} (pass {i + 1}/{repeats})")
        for (system, n), result in best.items():
            extra = {"max_batch": result[2]} if system == "embedded" else {}
            rows.append(_row(name, system, n, n * rounds, result[1], result[0], peak_load[(system, n)], **extra))
        asyncio.run(engine.close())
        del engine, model
    _add_ratios(rows)
    return rows


async def _engine_closed_loop(engine, prompts: list[list[int]], concurrency: int,
                              new_tokens: int) -> tuple[float, int, int]:
    from clawrl.engine.types import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    await engine.start()
    await engine.generate(GenerateRequest(input_ids=prompts[0], sampling_params=params))  # warm-up
    engine.reset_stats()  # max_batch_seen of this row only
    gate = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> int:
        async with gate:
            res = await engine.generate(GenerateRequest(input_ids=p, sampling_params=params))
            return len(res.output_ids)

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - t
    return seconds, sum(counts), engine.stats["max_batch_seen"]


@torch.inference_mode()
def _hf_generate(model, tok, prompts: list[list[int]], batch: int, new_tokens: int) -> tuple[float, int]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]

    def encode(group):
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        return ids, mask

    def generate(group):
        ids, mask = encode(group)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - ids.shape[1]) * len(group)

    generate(batches[0][:1])  # warm-up
    t = time.perf_counter()
    tokens = sum(generate(g) for g in batches)
    return time.perf_counter() - t, tokens


def _row(model: str, system: str, concurrency: int, requests: int, tokens: int, seconds: float,
         peak_load: float, **extra) -> dict[str, Any]:
    return dict(model=model, system=system, concurrency=concurrency, requests=requests, tokens=tokens,
                seconds=round(seconds, 4), tokens_per_s=round(tokens / seconds, 1), load_1m=round(peak_load, 2),
                **extra)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """vs_c1: tokens/s over the engine's concurrency-1 row; vs_hf_b16: over HF generate batch 16."""
    for r in rows:
        base = next((x for x in rows if x["model"] == r["model"] and x["system"] == "embedded"
                     and x["concurrency"] == 1), None)
        hf16 = next((x for x in rows if x["model"] == r["model"] and x["system"] == "hf_generate"
                     and x["concurrency"] == 16), None)
        r["vs_c1"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2) if base and r["system"] == "embedded" else None
        r["vs_hf_b16"] = round(r["tokens_per_s"] / hf16["tokens_per_s"], 2) if hf16 else None


def format_engine_rows(rows: list[dict[str, Any]]) -> str:
    cols = ["model", "system", "concurrency", "requests", "tokens", "seconds", "tokens_per_s", "vs_c1",
            "vs_hf_b16", "load_1m"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_engine_results_markdown(rows: list[dict[str, Any]], path: Path,
                                  machine: dict[str, Any] | None = None) -> None:
    """Write (or replace) the engine section of ``path``, leaving the rest of the file alone."""
    m = machine or describe_machine()
    body = [
        "## Embedded engine throughput",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}; torch {m['torch']} ({m['threads']} threads); {m['date']}.",
        "Greedy, `ignore_eos`, 32 new tokens per request, short chat-templated prompts. `embedded` keeps",
        "`concurrency` requests in flight; `hf_generate` is `model.generate` on a static left-padded batch.",
        "Rows are measured in interleaved passes and keep their best pass; `load_1m` is the highest 1-minute",
        "load average seen around the row's passes (a load above the core count means other work ran too).",
        "",
        format_engine_rows(rows),
        "",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        c16 = next((r for r in rows if r["model"] == name and r["system"] == "embedded" and r["concurrency"] == 16),
                   None)
        if c16 and c16.get("vs_c1") is not None and c16.get("vs_hf_b16") is not None:
            body.append(f"- {name}: 16 concurrent = {c16['vs_c1']}x the engine at 1 and "
                        f"{c16['vs_hf_b16']}x HF generate at batch 16.")
    body.append("- Targets (smollm2-135m): >= 5x the engine at 1, >= 0.8x HF generate at batch 16.")
    write_section("engine", "\n".join(body), path)
