"""Long prompts in the embedded engine: chunked prefill (same results as one pass, others keep
decoding between the chunks, an abort lands at the next chunk), the KV budget, the queue limit."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.config import ConfigError
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.types import EngineOverloadedError, GenerateRequest
from tests.engine.test_embedded import assert_lp_close, greedy, prompts_of, run, teacher_forced, wait_until

CONTEXT = 2048


def make(tiny_dir, **kw) -> EmbeddedEngine:
    kw.setdefault("max_batch_size", 4)
    return EmbeddedEngine(tiny_dir, max_context_len=CONTEXT, **kw)


def scored(prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling_params=greedy(n), return_logprob=True, logprob_start_len=0)


def test_a_chunked_prefill_gives_what_one_pass_gives(tiny_dir):
    """1,000 prompt tokens in chunks of 64 (16 chunks, the last one short): the same greedy tokens,
    output log-probs and prompt log-probs as one pass, and as a teacher-forced HF forward."""
    from clawrl.models import load_causal_lm

    prompt = prompts_of([1000], 40000, seed=3)[0]
    outs = {}
    for size in (4096, 64):
        eng = make(tiny_dir, chunked_prefill_size=size)
        outs[size] = run(eng.generate(scored(prompt, 12)))
        steps = eng.stats["prefill_steps"]
        run(eng.close())
        assert steps == (1 if size == 4096 else 16)
    whole, chunked = outs[4096], outs[64]
    assert chunked.output_ids == whole.output_ids
    assert_lp_close(chunked.output_logprobs, whole.output_logprobs, 1e-5)
    assert chunked.input_logprobs[0] is None and len(chunked.input_logprobs) == len(prompt)
    assert_lp_close(chunked.input_logprobs[1:], whole.input_logprobs[1:], 1e-5)
    hf = load_causal_lm(tiny_dir)
    assert_lp_close(chunked.input_logprobs[1:], teacher_forced(hf, prompt[:1], prompt[1:]))
    # scoring from the middle of a chunk (position 100 of chunk 64..127)
    eng = make(tiny_dir, chunked_prefill_size=64)
    mid = run(eng.generate(GenerateRequest(input_ids=prompt, sampling_params=greedy(1), return_logprob=True,
                                           logprob_start_len=100)))
    run(eng.close())
    assert mid.input_logprobs[0] is None and len(mid.input_logprobs) == len(prompt) - 100
    assert_lp_close(mid.input_logprobs[1:], whole.input_logprobs[101:], 1e-5)


def test_others_keep_decoding_while_a_long_prompt_is_prefilled(tiny_dir):
    """A short request decoding when a 1,500-token prompt arrives: with chunks of 64 the long prompt
    takes 24 steps to prefill, and the short one's 20 tokens all come before its first token."""
    eng = make(tiny_dir, chunked_prefill_size=64)
    short_prompt, long_prompt = prompts_of([8, 1500], 40000, seed=4)
    finished: list[str] = []

    async def one(name: str, prompt: list[int], n: int) -> None:
        await eng.generate(GenerateRequest(input_ids=prompt, sampling_params=greedy(n)))
        finished.append(name)

    async def scenario():
        short = asyncio.create_task(one("short", short_prompt, 20))
        await wait_until(lambda: eng.stats["steps"] >= 1)
        await asyncio.gather(short, one("long", long_prompt, 2))

    run(scenario())
    stats = eng.stats
    run(eng.close())
    assert finished == ["short", "long"]
    assert stats["prefill_steps"] == 1 + 24  # the short prompt, then 24 chunks (23 x 64 + 28)


def test_an_aborted_long_prompt_stops_at_the_next_chunk(tiny_dir):
    """The caller of a 2,000-token prompt (32 chunks of 64) goes away after a few chunks: the engine
    stops at the next chunk boundary and goes idle."""
    eng = make(tiny_dir, chunked_prefill_size=64)
    prompt = prompts_of([2000], 40000, seed=5)[0]

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(eng.generate(GenerateRequest(input_ids=prompt, sampling_params=greedy(4))))
        await wait_until(lambda: eng.stats["prefill_steps"] >= 3)
        task.cancel()
        at_cancel = eng.stats["prefill_steps"]
        await wait_until(lambda: eng.stats["running"] == 0 and eng.stats["queued"] == 0)
        return at_cancel, eng.stats["prefill_steps"]

    at_cancel, after = run(scenario())
    run(eng.close())
    # the chunk running when the abort reached the worker, and at most one more started while the
    # cancellation made its way there through the caller's event loop
    assert after - at_cancel <= 2 and after < 32


def test_requests_wait_for_room_in_the_kv_budget(tiny_dir):
    """A budget of 1,200 token slots: two requests that can reach 700 positions each cannot run
    together (2 x 700), so the second waits for the first; both complete."""
    eng = EmbeddedEngine(tiny_dir, max_batch_size=4, max_context_len=1024, max_total_tokens=1200)
    a, b = prompts_of([650, 650], 40000, seed=6)

    async def scenario():
        return await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=p, sampling_params=greedy(50)))
                                      for p in (a, b)))

    results = run(scenario())
    stats = eng.stats
    run(eng.close())
    assert [len(r.output_ids) for r in results] == [50, 50]
    assert stats["max_batch_seen"] == 1 and stats["kv_budget_tokens"] == 1200
    with pytest.raises(ConfigError, match="max_total_tokens = 1000 is below engine.max_context_len = 1024"):
        EmbeddedEngine(tiny_dir, max_context_len=1024, max_total_tokens=1000)


def test_a_full_queue_refuses_with_overloaded(tiny_dir):
    eng = make(tiny_dir, max_batch_size=1, max_queued_requests=1)
    prompts = prompts_of([8, 8, 8], 40000, seed=7)

    async def scenario():
        first = asyncio.create_task(eng.generate(GenerateRequest(input_ids=prompts[0], sampling_params=greedy(200))))
        await wait_until(lambda: eng.stats["running"] == 1)
        second = asyncio.create_task(eng.generate(GenerateRequest(input_ids=prompts[1], sampling_params=greedy(2))))
        await wait_until(lambda: eng.stats["queued"] == 1)
        with pytest.raises(EngineOverloadedError, match="queue is full"):
            await eng.generate(GenerateRequest(input_ids=prompts[2], sampling_params=greedy(2)))
        return await first, await second

    first, second = run(scenario())
    run(eng.close())
    assert (len(first.output_ids), len(second.output_ids)) == (200, 2)


def test_room_a_finished_long_request_held_goes_to_new_rows(tiny_dir):
    """Budget 2,000 slots: a 900-position request grows the cache to 900+ positions; once it ends,
    while another request keeps the engine busy, three short ones run together beside it (the
    leftover positions are dropped) instead of waiting for the engine to go idle."""
    eng = EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=1024, max_total_tokens=2000)
    long, keep_busy, *shorts = prompts_of([880, 8, 20, 20, 20], 40000, seed=8)

    async def scenario():
        busy = asyncio.create_task(eng.generate(GenerateRequest(input_ids=keep_busy, sampling_params=greedy(250))))
        await eng.generate(GenerateRequest(input_ids=long, sampling_params=greedy(20)))
        assert eng.stats["running"] == 1 and eng.stats["kv_capacity"] >= 900
        eng.reset_stats()
        await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=p, sampling_params=greedy(20))) for p in shorts))
        stats = eng.stats
        await busy
        return stats

    stats = run(scenario())
    run(eng.close())
    assert stats["max_batch_seen"] == 4  # the three short ones and the one keeping the engine busy
    assert stats["kv_rows"] * stats["kv_capacity"] <= 2000
