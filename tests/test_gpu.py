"""The CUDA paths, run on a GPU machine with ``pytest -m gpu`` (skipped without CUDA, so never in CI):
``[model] dtype = "auto"`` serves bfloat16 there, and the trainer the train flow builds takes bf16 PPO
steps on CUDA with float32 master weights, the Megatron backend through the SDPA core attention that
``clawrl.bench.mfu`` measures. Each bf16 result is held against the float32 CPU run of the same batch."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tests.train.test_megatron_backend import _batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron", "ignore::UserWarning:megatron",
                                         "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    """Each test compiles its own fused decode steps: the engines of one test share what dynamo
    compiled (one cache per function), and past its recompile limit a function runs uncompiled, so
    the variants that earlier tests' models and dtypes leave behind must not count against this one."""
    torch._dynamo.reset()
    yield


# kl_coef > 0 keeps a reference model; lr large enough that one step visibly moves the weights
TRAIN = {"ppo.kl_coef": 0.1, "ppo.lr": 1e-3, "ppo.micro_batch_size": 2}


def test_dtype_auto_serves_bfloat16_on_cuda(make_settings):
    from clawrl.engine.types import GenerateRequest, SamplingParams
    from clawrl.judge.runner import load_frozen_engine

    settings = make_settings()
    assert (settings.model.dtype, settings.model.device) == ("auto", "auto")
    engine = load_frozen_engine(settings)
    params = list(engine.model.parameters())
    assert {p.device.type for p in params} == {"cuda"} and {p.dtype for p in params} == {torch.bfloat16}

    async def generate():
        await engine.start()
        try:
            sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            return await engine.generate(GenerateRequest(input_ids=[1, 504, 1029, 30, 2], sampling_params=sp,
                                                         return_logprob=True))
        finally:
            await engine.close()

    result = asyncio.run(generate())
    assert len(result.output_ids) == len(result.output_logprobs) == 8
    assert all(math.isfinite(lp) and lp <= 0 for lp in result.output_logprobs)


@pytest.mark.parametrize("backend,model", [("torch", "tiny"), ("megatron", "tiny-qwen3")])
def test_trainer_takes_a_bf16_step_on_cuda_close_to_float32_on_cpu(make_settings, backend, model):
    from clawrl.train.trainer import trainer_from_settings

    batch = _batch(49152)
    metrics, moved = {}, {}
    # the float32 reference: the torch backend on the CPU (the CPU tests hold megatron to it within 1e-5)
    for device, kind in (("cpu", "torch"), ("cuda", backend)):
        trainer = trainer_from_settings(make_settings({**TRAIN, "ppo.backend": kind, "model.name": model,
                                                       "model.device": device}))
        b = trainer.backend
        assert b.compute_dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
        assert {p.dtype for p in b.params} == {torch.float32}  # master weights and AdamW state stay float32
        assert {p.dtype for p in b.reference.parameters()} == {b.compute_dtype}  # the frozen reference: bf16 on CUDA
        before = {n: p.detach().clone() for n, p in zip(b.param_names, b.params)}
        metrics[device] = b.train_step(batch)
        moved[device] = max((p.detach() - before[n]).abs().max().item() for n, p in zip(b.param_names, b.params))
    if backend == "megatron":
        assert type(b.model.decoder.layers[0].self_attention.core_attention).__name__ == "SDPACoreAttention"
    cuda = metrics["cuda"]
    assert math.isfinite(cuda["grad_norm"]) and cuda["grad_norm"] > 0
    assert cuda["num_tokens"] == metrics["cpu"]["num_tokens"] == 25.0  # 5 + 2 + 9 + 3 + 6 output tokens
    assert moved["cuda"] > 1e-4  # AdamW's first step moves a weight by up to lr = 1e-3
    assert abs(cuda["kl"]) < 0.02  # the bf16 reference vs the policy's autocast pass on the same weights; 0 in fp32
    assert abs(metrics["cpu"]["kl"]) < 1e-6
    for key in ("loss", "entropy"):  # bf16 compute: log-probs near -10.8 carry ~0.05 of rounding
        assert cuda[key] == pytest.approx(metrics["cpu"][key], rel=0.05, abs=0.05), (key, cuda[key], metrics["cpu"][key])


def test_chunked_prefill_and_the_prefix_cache_on_cuda_give_what_one_pass_gives(tiny_dir):
    """The CUDA kernels of a chunk (SDPA with a mask over the cached prefix) and of a prefix reused
    from the cache: float32 on the GPU, the same greedy tokens and log-probs as one pass."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.types import GenerateRequest, SamplingParams
    from tests.engine.test_embedded import assert_lp_close, prompts_of

    system, question = prompts_of([1500, 40], 40000, seed=21)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    def engine(**kw):
        return EmbeddedEngine(tiny_dir, dtype="float32", device="cuda", max_batch_size=4, max_context_len=4096, **kw)

    async def ask(eng, prompts):
        out = [await eng.generate(GenerateRequest(input_ids=p, sampling_params=sp, return_logprob=True))
               for p in prompts]
        await eng.close()
        return out

    one_pass = asyncio.run(ask(engine(chunked_prefill_size=4096, prefix_cache_tokens=0), [system + question]))[0]
    chunked = asyncio.run(ask(engine(chunked_prefill_size=128, prefix_cache_tokens=0), [system + question]))[0]
    first, reused = asyncio.run(ask(engine(chunked_prefill_size=4096), [system + [7], system + question]))
    assert reused.cached_tokens == 1472  # 23 whole blocks of the shared 1,500 tokens
    for got in (chunked, reused):
        assert got.output_ids == one_pass.output_ids
        assert_lp_close(got.output_logprobs, one_pass.output_logprobs, 1e-4)


def _answers(model_dir, prompts, params, **engine_kw):
    """Every prompt through one bf16 CUDA engine at once (requests join and leave the batch); the
    results and the engine's stats."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.types import GenerateRequest

    async def run():
        engine = EmbeddedEngine(model_dir, dtype="bfloat16", device="cuda", max_context_len=512, **engine_kw)
        try:
            results = await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=s,
                                                                             return_logprob=True))
                                             for p, s in zip(prompts, params)))
            return results, engine.stats
        finally:
            await engine.close()

    return asyncio.run(run())


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_graph_decode_is_token_for_token_the_eager_path(model_cache, model):
    """12 requests of different prompt and output lengths through 8 rows (batch buckets 1..8, spans
    64..256): the replayed graphs give the tokens and log-probs of the same padded steps launched
    eagerly, bit for bit."""
    from clawrl.engine.types import SamplingParams
    from clawrl.models import resolve_model_dir
    from tests.engine.test_embedded import prompts_of

    model_dir = resolve_model_dir(model, model_cache)
    prompts = prompts_of([5, 40, 13, 90, 7, 21, 64, 3, 150, 33, 9, 48], 1000, seed=8)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (30, 12, 100, 5, 64, 47, 20, 90, 8, 33, 70, 16)]
    graphed, g_stats = _answers(model_dir, prompts, params, max_batch_size=8)
    eager, e_stats = _answers(model_dir, prompts, params, max_batch_size=8, cuda_graphs=False)
    assert g_stats["cuda_graphs"] >= 3 and e_stats["cuda_graphs"] == 0
    assert g_stats["fused_decode"] and e_stats["fused_decode"]  # both through the compiled, fused layers
    assert [len(r.output_ids) for r in graphed] == [p.max_new_tokens for p in params]
    for g, e in zip(graphed, eager):
        assert g.output_ids == e.output_ids
        assert g.output_logprobs == e.output_logprobs


def test_weights_synced_into_a_graph_captured_engine_are_what_the_next_replay_computes(model_cache):
    """An engine that has captured its graphs takes another checkpoint's weights (copied into the
    parameters the graphs read): from then on it answers as an engine started on that checkpoint,
    and a request retracted across the update finishes on the new weights."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.types import GenerateRequest, SamplingParams
    from clawrl.models import resolve_model_dir

    old, new = resolve_model_dir("tiny-qwen3", model_cache), resolve_model_dir("tiny-qwen3", model_cache, seed=1)
    prompt = [1, 504, 1029, 30, 2, 77, 310]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    long_sp = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

    async def run():
        engine = EmbeddedEngine(old, dtype="bfloat16", device="cuda", max_batch_size=4, max_context_len=512)
        fresh = EmbeddedEngine(new, dtype="bfloat16", device="cuda", max_batch_size=4, max_context_len=512)
        try:
            before = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=sp))
            graphs = engine.stats["cuda_graphs"]
            long = asyncio.ensure_future(engine.generate(GenerateRequest(input_ids=prompt, sampling_params=long_sp)))
            while engine.stats["tokens_generated"] < 24 + 50:
                await asyncio.sleep(0.001)
            await engine.pause_generation("retract")
            result = await engine.update_weights_from_disk(str(new), weight_version="1")
            await engine.continue_generation()
            finished = await long  # before `fresh` captures its graphs: no decode of `engine` during it
            after = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=sp))
            expected = await fresh.generate(GenerateRequest(input_ids=prompt, sampling_params=sp))
            return before, graphs, result, finished, after, expected, engine.stats
        finally:
            await engine.close()
            await fresh.close()

    before, graphs, result, long, after, expected, stats = asyncio.run(run())
    assert graphs > 0 and result.success and stats["cuda_graphs"] > 0 and stats["retractions"] == 1
    assert after.output_ids == expected.output_ids != before.output_ids
    assert len(long.output_ids) == 400
    assert [span["version"] for span in long.weight_versions] == ["0", "1"]


def test_engine_bench_on_cuda_times_the_graphed_and_the_eager_engine(model_cache):
    from clawrl.bench.engine import format_engine_section, run_engine_bench

    rows = run_engine_bench(("tiny",), concurrencies=(1, 4), new_tokens=8, cache_dir=model_cache,
                            hf_batch_sizes=(), repeats=1, device="cuda")
    assert [(r["system"], r["concurrency"], r["tokens"]) for r in rows] == [
        ("embedded", 1, 16), ("embedded", 4, 64), ("embedded_eager", 1, 16), ("embedded_eager", 4, 64)]
    assert [r["gpu_busy"] is None for r in rows] == [False, False, True, True]  # profiled: the graphed rows
    assert all(0 < r["gpu_busy"] <= 1 for r in rows[:2]) and {r["dtype"] for r in rows} == {"bfloat16"}
    assert "## Embedded engine throughput on CUDA" in format_engine_section(rows)


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_fused_decode_compiled_on_cuda_agrees_with_the_unfused_layers_to_bf16_rounding(model_cache, model):
    """Inductor's fused kernels for the decode step (clawrl.engine.fused_decode) against the runner's
    op-for-op HF layers, bf16 on CUDA: the same greedy tokens over 6 steps of 3 rows at different
    positions, logits within 2% of their scale."""
    from clawrl.engine.modeling import CausalLMRunner
    from clawrl.models import load_causal_lm, resolve_model_dir

    model_dir = resolve_model_dir(model, model_cache)
    logits, tokens = {}, {}
    for fused in (False, True):
        runner = CausalLMRunner(load_causal_lm(model_dir, "bfloat16", "cuda"), 256)
        if fused:
            assert runner.fuse_decode()
        logits[fused], tokens[fused] = _greedy_steps(runner)
        assert (runner.fused is not None) == fused
    scale = logits[False].abs().max()
    assert float((logits[True] - logits[False]).abs().max() / scale) < 0.02
    assert tokens[True] == tokens[False]


def _greedy_steps(runner, steps: int = 6):
    prompts = [[1, 5, 9, 33, 2], [7, 8, 9], [4] * 70]
    cache = runner.new_cache(4)
    runner.prefill(prompts, [0, 1, 2], cache, [len(p) - 1 for p in prompts])
    cache.ensure(3, 128)  # the span the steps attend over
    tok = torch.tensor([3, 4, 5], device="cuda")
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    out, chosen = [], []
    for _ in range(steps):
        step = runner.decode_rows(tok, pos, cache, 128)
        out.append(step)
        tok, pos = step.argmax(-1), pos + 1
        chosen.append(tok.tolist())
    return torch.stack(out), chosen


@pytest.mark.parametrize("backend,model", [("torch", "tiny"), ("megatron", "tiny-qwen3")])
def test_the_trainer_state_is_copied_on_the_gpu_and_written_while_the_next_step_trains(make_settings, backend,
                                                                                       model):
    from safetensors.torch import load_file

    from clawrl.checkpoint import MASTER_FILE, OPTIMIZER_FILE, WEIGHTS_FILE, read_step_result, weights_digest
    from clawrl.train.trainer import trainer_from_settings
    from tests.train.test_lr_schedule import _samples

    settings = make_settings({**TRAIN, "ppo.backend": backend, "model.name": model, "model.device": "cuda"})
    trainer = trainer_from_settings(settings)
    trainer._prune = lambda: None  # keep every version's state to compare it
    assert trainer._fits_on_device(4)  # a tiny model's state is copied on the GPU
    trainer.run("b1", _samples(1))
    b = trainer.backend
    master, optimizer = b.master_weights(), b.optimizer_state_dict()  # on the host, right after step 1
    trainer.run("b2", _samples(2))  # step 2 changes the live state while v1's copy is written
    trainer.wait_state()
    v1 = settings.storage.data_root / "checkpoints" / "v000001"
    assert read_step_result(v1).sha256 == weights_digest(v1 / WEIGHTS_FILE)  # cast to bf16 on the GPU
    assert load_file(v1 / WEIGHTS_FILE)["model.norm.weight"].dtype == torch.bfloat16
    stored, stored_master = torch.load(v1 / OPTIMIZER_FILE, weights_only=True), load_file(v1 / MASTER_FILE)
    assert stored["step"] == 1 and set(stored_master) == set(master)
    assert all(torch.equal(stored_master[k], master[k]) and stored_master[k].dtype == torch.float32 for k in master)
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(t.device.type == "cpu" and torch.equal(t, optimizer[key][n]) for n, t in stored[key].items())
    now = b.optimizer_state_dict()["exp_avg"]
    assert any(not torch.equal(now[n], optimizer["exp_avg"][n]) for n in now)  # step 2 did move them
