"""The embedded engine's prefix cache: a request that starts like an earlier one prefills only the
rest, gets the same tokens and log-probs, and says what it reused; weight updates empty it; it
stays within its size."""

from __future__ import annotations

from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.types import GenerateRequest
from tests.engine.test_embedded import assert_lp_close, greedy, perturbed_state_dict, prompts_of, run


def make(tiny_dir, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_dir, max_batch_size=4, max_context_len=2048, **kw)


def req(ids: list[int], n: int = 6, **kw) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, sampling_params=greedy(n), return_logprob=True, **kw)


def test_a_shared_prefix_is_computed_once(tiny_dir):
    system, a, b = prompts_of([1000, 30, 40], 40000, seed=11)
    cached, plain = make(tiny_dir), make(tiny_dir, prefix_cache_tokens=0)

    async def scenario(eng):
        first = await eng.generate(req(system + a))
        second = await eng.generate(req(system + b))
        # the conversation goes on: its history, the answer, the next message
        third = await eng.generate(req(system + b + second.output_ids + a))
        return first, second, third, eng.stats

    (f1, s1, t1, stats), (f0, s0, t0, _) = run(scenario(cached)), run(scenario(plain))
    run(cached.close()), run(plain.close())
    assert [r.cached_tokens for r in (f1, s1)] == [0, 960]  # whole 64-token blocks of the 1,000 shared tokens
    # the history up to the last whole block before the new message: 1,000 + 40 + 6 = 1,046 -> 1,024
    assert t1.cached_tokens == 1024
    assert [r.cached_tokens for r in (f0, s0, t0)] == [0, 0, 0]
    for with_cache, without in ((f1, f0), (s1, s0), (t1, t0)):
        assert with_cache.output_ids == without.output_ids
        assert_lp_close(with_cache.output_logprobs, without.output_logprobs, 1e-5)
    assert stats["prefix_cache_hits"] == 2 and stats["prefix_tokens_saved"] == 960 + 1024


def test_prompt_scoring_computes_the_positions_it_scores(tiny_dir):
    prompt = prompts_of([300], 40000, seed=12)[0]
    eng = make(tiny_dir)

    async def scenario():
        await eng.generate(req(prompt))
        full = await eng.generate(req(prompt, 1, logprob_start_len=0))  # every position scored: nothing reused
        tail = await eng.generate(req(prompt, 1, logprob_start_len=200))  # positions before 200 may be reused
        return full, tail

    full, tail = run(scenario())
    run(eng.close())
    assert (full.cached_tokens, tail.cached_tokens) == (0, 192)
    assert_lp_close(tail.input_logprobs[1:], full.input_logprobs[201:], 1e-5)


def test_a_weight_update_and_a_flush_empty_it(tiny_dir):
    prompt = prompts_of([200], 40000, seed=13)[0]
    eng = make(tiny_dir)

    async def scenario():
        await eng.generate(req(prompt))
        assert (await eng.generate(req(prompt))).cached_tokens == 192
        assert (await eng.update_weights_from_state_dict(perturbed_state_dict(eng.model), "1")).success
        after_update = await eng.generate(req(prompt))  # the old weights' K/V is gone
        assert await eng.flush_cache()
        after_flush = await eng.generate(req(prompt))
        return after_update, after_flush

    after_update, after_flush = run(scenario())
    run(eng.close())
    assert (after_update.cached_tokens, after_flush.cached_tokens) == (0, 0)


def test_it_keeps_at_most_its_size_least_recently_used_first(tiny_dir):
    a, b = prompts_of([130, 130], 40000, seed=14)  # two whole blocks each
    eng = make(tiny_dir, prefix_cache_tokens=256)  # room for four blocks

    async def scenario():
        for p in (a, b):
            await eng.generate(req(p, 1))
        hit_a = (await eng.generate(req(a, 1))).cached_tokens  # a is now the most recent
        c = prompts_of([130], 40000, seed=15)[0]
        await eng.generate(req(c, 1))  # two more blocks: b's go
        return hit_a, (await eng.generate(req(b, 1))).cached_tokens, (await eng.generate(req(c, 1))).cached_tokens

    hit_a, hit_b, hit_c = run(scenario())
    stats = eng.stats
    run(eng.close())
    assert (hit_a, hit_b, hit_c) == (128, 0, 128)
    assert stats["prefix_cache_tokens"] <= 256


def test_equal_prompts_arriving_together_share_one_prefill(tiny_dir):
    """A judge's m votes: the same prompt m times, each sampled with its own seed. One prefill; each
    vote is what it would be alone."""
    from clawrl.engine.types import SamplingParams

    prompt = prompts_of([500], 40000, seed=16)[0]

    def vote(i: int) -> GenerateRequest:
        return GenerateRequest(input_ids=prompt, return_logprob=True, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=1.0, sampling_seed=100 + i))

    eng, alone = make(tiny_dir, prefix_cache_tokens=0), make(tiny_dir, prefix_cache_tokens=0)

    async def together():
        import asyncio

        await eng.pause_generation("in_place")  # the four arrive in one step, whatever the machine's load
        votes = [asyncio.create_task(eng.generate(vote(i))) for i in range(4)]
        while eng.stats["queued"] < 4:
            await asyncio.sleep(0.001)
        await eng.continue_generation()
        return await asyncio.gather(*votes)

    async def one_by_one():
        return [await alone.generate(vote(i)) for i in range(4)]

    shared, single = run(together()), run(one_by_one())
    steps = eng.stats["prefill_steps"]
    run(eng.close()), run(alone.close())
    assert steps == 1
    assert len({tuple(r.output_ids) for r in shared}) > 1  # the seeds differ, so do the votes
    for a, b in zip(shared, single):
        assert a.output_ids == b.output_ids
        assert_lp_close(a.output_logprobs, b.output_logprobs, 1e-5)


def test_k_v_of_a_request_that_ran_on_across_an_update_is_not_kept(tiny_dir):
    """In-place pause, weight update, continue: the request in flight finishes with K/V partly of the
    old weights; the cache must not hand that to the next request."""
    import asyncio

    prompt = prompts_of([200], 40000, seed=17)[0]
    eng = make(tiny_dir)

    async def scenario():
        task = asyncio.create_task(eng.generate(req(prompt, 40)))
        while eng.stats["steps"] < 3:
            await asyncio.sleep(0.001)
        await eng.pause_generation("in_place")
        assert (await eng.update_weights_from_state_dict(perturbed_state_dict(eng.model), "1")).success
        await eng.continue_generation()
        await task
        stale = await eng.generate(req(prompt))  # nothing cached: the old weights' K/V was not kept
        fresh = await eng.generate(req(prompt))  # now cached, from the new weights
        return stale.cached_tokens, fresh.cached_tokens

    assert run(scenario()) == (0, 192)
    run(eng.close())
