"""LoRA adapters on CUDA, run on a GPU machine with ``pytest -m gpu`` (skipped without CUDA): decode steps that mix
adapters run through the fused, compiled layers and replay CUDA graphs captured with the adapters' slot pools,
and give what the same steps launched eagerly give, bit for bit, and what the float32 CPU engine gives."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.lora import write_random_adapters
from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.models import load_causal_lm
from tests.engine.test_embedded import assert_lp_close, prompts_of

pytestmark = [pytest.mark.gpu]

LORAS = [None, "a0", "a1", "qv", "a0", None, "a1", "qv"]


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    torch._dynamo.reset()  # see tests/test_gpu.py: each test compiles its own fused steps
    yield


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_dir):
    model = load_causal_lm(tiny_dir)
    root = tmp_path_factory.mktemp("adapters")
    return write_random_adapters(model, [root / "a0", root / "a1"], rank=4, alpha=8, std=0.2) + \
        write_random_adapters(model, [root / "qv"], rank=2, alpha=2, targets=("q_proj", "v_proj"), seed=10, std=0.3)


def _serve(model_dir, adapter_dirs, waves, **engine_kw):
    """Each wave's requests admitted together (submitted while paused), the waves one after another; returns the
    results per wave, the engine's stats and how many graphs its decoder captured."""

    async def run():
        engine = EmbeddedEngine(model_dir, max_batch_size=8, max_context_len=512, **engine_kw)
        try:
            for d in adapter_dirs:
                assert (await engine.load_lora_adapter(d.name, str(d))).success
            out = []
            for wave in waves:
                await engine.pause_generation("in_place")
                tasks = [asyncio.ensure_future(engine.generate(r)) for r in wave]
                while engine.stats["queued"] < len(wave):
                    await asyncio.sleep(0.001)
                await engine.continue_generation()
                out.append(await asyncio.gather(*tasks))
            return out, engine.stats, getattr(engine._sched.decoder, "captures", 0)
        finally:
            await engine.close()

    return asyncio.run(run())


def _wave(prompts, n: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(input_ids=p, sampling_params=sp, lora_path=lo, return_logprob=True)
            for p, lo in zip(prompts, LORAS)]


def test_lora_steps_replayed_from_cuda_graphs_are_the_eager_steps_bit_for_bit(tiny_dir, adapter_dirs):
    """Three waves of 8 rows (two base, three adapters of ranks 4, 4 and 2), bf16: graphed and eager answer
    alike token for token and log-prob for log-prob; the third wave, the first's again, captures nothing new."""
    prompts = prompts_of([5, 40, 13, 90, 7, 21, 64, 3], 1000, seed=31)
    waves = [_wave(prompts, 24), _wave(prompts[::-1], 10), _wave(prompts, 24)]
    graphed, stats, captures = _serve(tiny_dir, adapter_dirs, waves, dtype="bfloat16", device="cuda")
    eager, eager_stats, _ = _serve(tiny_dir, adapter_dirs, waves, dtype="bfloat16", device="cuda", cuda_graphs=False)
    assert stats["fused_decode"] and eager_stats["fused_decode"] and stats["cuda_graphs"] > 0
    for g_wave, e_wave in zip(graphed, eager):
        for g, e in zip(g_wave, e_wave):
            assert g.output_ids == e.output_ids and g.output_logprobs == e.output_logprobs
    assert [r.output_ids for r in graphed[2]] == [r.output_ids for r in graphed[0]]
    _, _, two_waves = _serve(tiny_dir, adapter_dirs, waves[:2], dtype="bfloat16", device="cuda")
    assert captures == two_waves  # the third wave replayed the first wave's graphs
    assert len({tuple(r.output_ids) for r in graphed[0][1:4]}) == 3  # the adapters answer differently


def test_lora_decode_on_cuda_scores_its_tokens_as_the_cpu_engine_does(tiny_dir, adapter_dirs):
    """float32 on CUDA (graphs, fused layers, the dense slot step) against float32 on the CPU (the grouped slot
    step): the CPU engine scores the CUDA engine's greedy answers (prefill-only, same adapter), and each token's
    log-prob agrees to 1e-4."""
    prompts = prompts_of([6, 30, 11, 50, 9, 17, 40, 4], 1000, seed=32)
    (cuda,), stats, _ = _serve(tiny_dir, adapter_dirs, [_wave(prompts, 20)], dtype="float32", device="cuda")
    assert stats["cuda_graphs"] > 0 and stats["fused_decode"]
    score = SamplingParams(max_new_tokens=0)
    checks = [GenerateRequest(input_ids=p + r.output_ids, sampling_params=score, lora_path=lo, return_logprob=True,
                              logprob_start_len=len(p) - 1) for p, r, lo in zip(prompts, cuda, LORAS)]
    (cpu,), _, _ = _serve(tiny_dir, adapter_dirs, [checks], dtype="float32", device="cpu")
    for r, c in zip(cuda, cpu):
        assert_lp_close(r.output_logprobs, c.input_logprobs[1:], 1e-4)
