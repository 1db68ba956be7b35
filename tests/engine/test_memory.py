"""What the embedded engine holds and gives back: its KV cache goes when it is idle, and the memory
with it (glibc's malloc_trim on the CPU, torch.cuda.empty_cache on CUDA), measured by the engine
itself around the release; the prefix cache's K/V goes the moment it is flushed."""

from __future__ import annotations

import asyncio
import gc
import weakref

from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.types import GenerateRequest, SamplingParams
from tests.engine.test_embedded import prompts_of, run


def test_an_idle_engine_gives_its_kv_memory_back(tiny_dir):
    eng = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=2048, prefix_cache_tokens=0)
    prompts = prompts_of([1500] * 16, 40000, seed=21)
    busy: list[int] = []

    async def scenario():
        sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        calls = [asyncio.ensure_future(eng.generate(GenerateRequest(input_ids=p, sampling_params=sp)))
                 for p in prompts]
        while not all(c.done() for c in calls):
            busy.append(eng.stats["kv_bytes"])
            await asyncio.sleep(0.005)
        await asyncio.gather(*calls)
        while eng.stats["memory_releases"] == 0:  # the worker resets the cache once it finds nothing to run
            await asyncio.sleep(0.01)
        return eng.stats

    idle = run(scenario())
    run(eng.close())
    # 16 rows x at least 1,532 positions x 512 B a slot (K and V x 2 layers x 2 heads x 16 dims x 4 B)
    assert max(busy) >= 16 * 1532 * 512
    assert idle["kv_bytes"] == 0 and idle["kv_capacity"] == 0 and idle["memory_releases"] == 1
    assert idle["released_bytes"] >= max(busy) // 2  # the resident set shrank by most of the cache


def test_a_flush_frees_the_prefix_caches_kv_at_once(tiny_dir):
    eng = EmbeddedEngine(tiny_dir, max_batch_size=4, max_context_len=2048)
    prompt = prompts_of([640], 40000, seed=22)[0]

    async def scenario():
        await eng.generate(GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1)))
        while eng.stats["memory_releases"] == 0:  # idle: the KV cache went back
            await asyncio.sleep(0.01)
        kept = eng.stats["prefix_cache_bytes"]
        blocks = [weakref.ref(b.kv) for b in eng._sched.prefix._lru]
        assert await eng.flush_cache()
        assert eng.stats["memory_releases"] == 2  # the flushed prefix cache's memory went back too
        return kept, blocks, eng.stats["prefix_cache_bytes"]

    gc.disable()  # blocks and their parents refer to each other: only a GC pass would free them otherwise
    try:
        kept, blocks, after = run(scenario())
        dead = [ref() is None for ref in blocks]
    finally:
        gc.enable()
    run(eng.close())
    assert kept == 640 * 512 and len(blocks) == 10  # ten whole 64-token blocks of 512 B a token
    assert after == 0 and all(dead)
