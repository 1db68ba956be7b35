"""The padded fixed-shape decode that CUDA graphs replay, run eagerly on the CPU (``capture=False``):
the buckets, and that padding the batch and the attention span changes no sequence's result. The
captured graphs themselves need CUDA: tests/test_gpu.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clawrl.engine.cuda_graphs import GraphedDecode, batch_buckets, span_bucket
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.modeling import CausalLMRunner
from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.models import load_causal_lm
from tests.engine.test_embedded import assert_lp_close, prompts_of


def test_batch_buckets_are_powers_of_two_to_8_then_multiples_of_8_up_to_the_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_span_bucket_rounds_up_to_a_power_of_two_at_least_64_within_the_capacity():
    assert [span_bucket(s, 4096) for s in (1, 64, 65, 128, 129, 1000, 4096)] == [64, 64, 128, 128, 256, 1024, 4096]
    assert span_bucket(300, 320) == 320  # a capacity trimmed by the budget caps the span
    assert span_bucket(10, 32) == 32


def test_graphs_need_cuda(tiny_dir):
    runner = CausalLMRunner(load_causal_lm(tiny_dir), 256)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        GraphedDecode(runner, 8)


def test_a_padded_step_gives_each_row_what_the_unpadded_step_gives(tiny_dir):
    """5 rows at different positions, padded to a bucket of 8 and a span of 64: the first 5 rows'
    logits match the plain step's; the padding wrote only position 0 of the free rows 5-7."""
    runner = CausalLMRunner(load_causal_lm(tiny_dir), 256)
    prompts = prompts_of([3, 9, 17, 30, 41], 49152, seed=3)
    logits = {}
    for name in ("plain", "padded"):
        cache = runner.new_cache(8)
        runner.prefill(prompts, list(range(5)), cache, [len(p) - 1 for p in prompts])
        cache.ensure(8, 64)
        with torch.inference_mode():
            for layer in cache.k + cache.v:
                layer[5:].fill_(7.0)  # free rows: anything finite
        decoder = runner if name == "plain" else GraphedDecode(runner, 8, capture=False)
        tokens, positions = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([len(p) for p in prompts])
        logits[name] = decoder.decode(tokens, positions, cache)
        if name == "padded":
            assert decoder.rows(5) == 8 and cache.rows == 8
            for layer in cache.k:
                assert torch.all(layer[5:, :, 1:] == 7.0)  # position 0 of the padded rows, nothing else
                assert not torch.all(layer[5:, :, 0] == 7.0)
    assert logits["padded"].shape == logits["plain"].shape == (5, 49152)
    torch.testing.assert_close(logits["padded"], logits["plain"], rtol=1e-5, atol=1e-5)


def test_an_engine_on_the_padded_path_answers_as_the_plain_engine_does(tiny_dir):
    """The scheduler with the padded decoder (its CPU stand-in for the CUDA path: admission counts
    padded rows): several requests of different lengths joining and leaving, greedy tokens and
    log-probs as the plain engine's."""
    prompts = prompts_of([4, 11, 25, 7, 60, 33], 49152, seed=5)
    sp = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 20, 5, 14, 3, 17)]

    async def answers(padded: bool):
        engine = EmbeddedEngine(tiny_dir, max_batch_size=6, max_context_len=256)
        if padded:
            engine._sched.decoder = GraphedDecode(engine._sched.runner, 6, capture=False)
        try:
            return await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=s,
                                                                          return_logprob=True))
                                          for p, s in zip(prompts, sp)))
        finally:
            await engine.close()

    plain, padded = asyncio.run(answers(False)), asyncio.run(answers(True))
    assert [len(r.output_ids) for r in padded] == [9, 20, 5, 14, 3, 17]
    for a, b in zip(plain, padded):
        assert b.output_ids == a.output_ids
        assert_lp_close(b.output_logprobs, a.output_logprobs, 1e-4)
