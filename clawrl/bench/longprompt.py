"""Long prompts in the embedded engine: what one costs the requests already decoding, how fast an
abandoned one stops, and the memory it takes, at several ``chunked_prefill_size`` values
(``chunk = context`` is a prefill in one pass).

Each configuration runs in a fresh child process (its peak RSS is its own):

* **stall**: a short request streams 200 tokens; once it decodes, a long prompt arrives. Reported:
  the longest gap between two of the short request's tokens (the decode it lost to the long
  prefill), and the long prompt's time to first token.
* **abort**: another long prompt alone; its caller goes away 0.5 s in. Reported: seconds from then
  until the engine is idle.
* **peak memory**: the child's peak resident memory (CPU) or allocated GPU memory (CUDA) over its
  level with the model loaded; **held when idle**: its resident memory (CPU) or reserved GPU memory
  once the engine is idle again, over the same level (the prefix cache keeps the first long prompt).
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import resource
import time
from pathlib import Path
from typing import Any

LONG_NEW_TOKENS, SHORT_NEW_TOKENS = 8, 200


def measure(model_dir: str, context: int, prompt_tokens: int, chunk: int, batch: int, device: str, dtype: str) -> dict:
    """One configuration, in this process (the parent runs it in a child)."""
    import torch

    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.memory import memory_held
    from clawrl.engine.types import GenerateRequest, SamplingParams

    torch.manual_seed(0)
    kw = {"chunked_prefill_size": chunk} if "chunked_prefill_size" in inspect.signature(EmbeddedEngine).parameters else {}
    engine = EmbeddedEngine(Path(model_dir), dtype=dtype, device=device, max_batch_size=batch, max_context_len=context,
                            **kw)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(1)
    long_prompt, other_prompt = (torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(2))

    def req(ids, n):
        return GenerateRequest(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                            ignore_eos=True))

    async def stall() -> tuple[float, float]:
        arrivals: list[float] = []

        async def short():
            async for _ in engine.generate_stream(req([1, 2, 3, 4], SHORT_NEW_TOKENS)):
                arrivals.append(time.perf_counter())

        task = asyncio.create_task(short())
        while len(arrivals) < 5:
            await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        ttft = None
        async for _ in engine.generate_stream(req(long_prompt, LONG_NEW_TOKENS)):
            ttft = ttft or time.perf_counter() - t0
        await task
        return max(b - a for a, b in zip(arrivals, arrivals[1:])), ttft

    async def abort() -> float:
        task = asyncio.create_task(engine.generate(req(other_prompt, LONG_NEW_TOKENS)))  # not in the prefix cache
        await asyncio.sleep(0.5)
        task.cancel()
        gone = time.perf_counter()
        while engine.stats["running"] or engine.stats["queued"]:
            await asyncio.sleep(0.001)
        return time.perf_counter() - gone

    async def main() -> dict:
        await engine.start()
        await engine.generate(req([1, 2, 3], 2))  # warm
        cuda = device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        held_before = memory_held(torch.device(device))
        gap, ttft = await stall()
        idle = await abort()
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        await asyncio.sleep(0.5)  # the worker gives the memory back as it finds nothing to run
        held = memory_held(torch.device(device)) - held_before
        await engine.close()
        return {"chunk": chunk, "max_gap_s": gap, "ttft_s": ttft, "abort_idle_s": idle,
                "memory_growth_mb": (peak - base) / 2**20, "idle_held_mb": held / 2**20}

    return asyncio.run(main())


def measure_prefix(model_dir: str, context: int, prefix_tokens: int, turns: int, cache: bool, device: str,
                   dtype: str) -> dict:
    """An agent's conversation: a shared prefix of ``prefix_tokens`` (system prompt and tools), then
    ``turns`` turns, each adding a 40-token user message to the history and a 16-token answer.
    Reported per turn: prompt tokens, tokens reused from the prefix cache, time to first token."""
    import torch

    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.types import GenerateRequest, SamplingParams

    engine = EmbeddedEngine(Path(model_dir), dtype=dtype, device=device, max_batch_size=4, max_context_len=context,
                            prefix_cache_tokens=-1 if cache else 0)
    g = torch.Generator().manual_seed(2)
    history = torch.randint(3, engine.vocab_size, (prefix_tokens,), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    async def main() -> list[dict]:
        out = []
        for turn in range(turns):
            history.extend(torch.randint(3, engine.vocab_size, (40,), generator=g).tolist())
            t0 = time.perf_counter()
            ttft, result = None, None
            async for result in engine.generate_stream(GenerateRequest(input_ids=list(history), sampling_params=sp)):
                ttft = ttft or time.perf_counter() - t0
            history.extend(result.output_ids)
            out.append({"turn": turn + 1, "prompt_tokens": result.prompt_tokens, "cached": result.cached_tokens,
                        "ttft_s": ttft})
        await engine.close()
        return out

    return {"prefix_tokens": prefix_tokens, "cache": cache, "turns": asyncio.run(main())}


def run_long_prompt_bench(model: str, *, cache_dir: Path, context: int, prompt_tokens: int, chunks: tuple[int, ...],
                          prefixes: tuple[int, ...] = (), batch: int = 16, device: str = "cpu",
                          progress=None) -> list[dict[str, Any]]:
    from clawrl.bench.common import bench_dtype
    from clawrl.models import resolve_model_dir

    model_dir = str(resolve_model_dir(model, cache_dir))
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for chunk in chunks:
        with ctx.Pool(1) as pool:
            row = pool.apply(measure, (model_dir, context, prompt_tokens, chunk, batch, device, bench_dtype(device)))
        rows.append({"model": model, "prompt_tokens": prompt_tokens, **row})
        if progress:
            progress(f"chunk {chunk}")
    for prefix in prefixes:
        for cache in (False, True):
            with ctx.Pool(1) as pool:
                rows.append({"model": model, **pool.apply(measure_prefix, (
                    model_dir, context, prefix, 4, cache, device, bench_dtype(device)))})
            if progress:
                progress(f"prefix {prefix}, cache {cache}")
    return rows


def format_long_prompt_section(rows: list[dict[str, Any]], device: str) -> str:
    from clawrl.bench.common import bench_dtype, machine_line, markdown_table

    cols = ["model", "prompt tokens", "chunked_prefill_size", "longest decode gap of a running request (s)",
            "time to first token (s)", "idle after the caller left (s)", "peak memory growth (MB)",
            "held when idle (MB)"]
    table = markdown_table([dict(zip(cols, [
        r["model"], r["prompt_tokens"], r["chunk"], f"{r['max_gap_s']:.2f}", f"{r['ttft_s']:.2f}",
        f"{r['abort_idle_s']:.2f}", f"{r['memory_growth_mb']:.0f}", f"{r['idle_held_mb']:.0f}"]))
        for r in rows if "chunk" in r], cols)
    pcols = ["model", "shared prefix", "prefix cache", "turn", "prompt tokens", "reused (cached_tokens)",
             "computed", "time to first token (s)"]
    prefix = markdown_table([dict(zip(pcols, [
        r["model"], r["prefix_tokens"], "on" if r["cache"] else "off", t["turn"], t["prompt_tokens"], t["cached"],
        t["prompt_tokens"] - t["cached"], f"{t['ttft_s']:.2f}"])) for r in rows if "turns" in r for t in r["turns"]],
        pcols)
    return ("## Long prompts: chunked prefill, aborts, memory and the prefix cache\n\n"
            f"`clawrl bench long-prompt`. {machine_line(device, bench_dtype(device))}\n\n{table}\n\n"
            "A short request streams 200 tokens while the long prompt arrives; its longest gap between two "
            "tokens is the decoding it lost to the prefill. Then the long prompt alone, its caller gone 0.5 s in. "
            "Each row is one fresh process (max_batch_size 16); memory growth is over the process with the model "
            "loaded: peak RSS on the CPU, peak allocated GPU memory on CUDA. Below, an agent's conversation, with "
            f"and without the prefix cache:\n\n{prefix}\n")
