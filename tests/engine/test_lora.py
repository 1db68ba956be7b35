"""LoRA adapters in the embedded engine (tiny model, fp32): PEFT's files read as PEFT computes them, a mixed
batch giving each row what it gets alone, base rows untouched bit for bit, the memory bound, the per-step
adapter bound, the prefix cache kept apart per adapter, and loading and unloading while requests run."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.lora import (Adapter, AdapterError, AdapterStore, projection_shapes, read_adapter,
                               write_random_adapters)
from clawrl.engine.lora_step import LoRASlots, OneAdapter, RowAdapters
from clawrl.engine.modeling import CausalLMRunner
from clawrl.engine.sampling import RowSampling, sample_next_tokens
from clawrl.engine.types import BadRequestError, GenerateRequest, SamplingParams
from clawrl.models import load_causal_lm
from tests.engine.test_embedded import assert_lp_close, greedy, prompts_of, run, wait_until

ATOL = 1e-5  # fp32 logits, tiny model: batched vs alone and ours vs PEFT's


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    return load_causal_lm(tiny_dir)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_hf):
    """Three rank-4 adapters over all seven projections (alpha 8: scale 2), and a rank-2 one over q and v only."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = write_random_adapters(tiny_hf, [root / f"a{i}" for i in range(3)], rank=4, alpha=8, std=0.2)
    return dirs + write_random_adapters(tiny_hf, [root / "qv"], rank=2, alpha=2, targets=("q_proj", "v_proj"),
                                        seed=10, std=0.3)


def _adapters(tiny_hf, dirs) -> list[Adapter]:
    shapes = projection_shapes(tiny_hf)
    return [Adapter(d.name, str(d), uid, read_adapter(d, shapes, 2, torch.float32, "cpu"))
            for uid, d in enumerate(dirs, 1)]


def test_an_adapter_is_read_with_its_scale_folded_into_b(tiny_hf, adapter_dirs):
    config = json.loads((adapter_dirs[0] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    raw = load_file(str(adapter_dirs[0] / "adapter_model.safetensors"))
    w = read_adapter(adapter_dirs[0], projection_shapes(tiny_hf), 2, torch.float32, "cpu")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_"
    assert torch.equal(w.a[1, "down_proj"], raw[key + "A.weight"])  # (r, in) = (4, 160)
    assert torch.equal(w.b[1, "down_proj"], raw[key + "B.weight"] * 2.0)  # scale = lora_alpha / r = 8 / 4
    assert w.rank == 4 and len(w.a) == 2 * 7
    assert read_adapter(adapter_dirs[3], projection_shapes(tiny_hf), 2, torch.float32, "cpu").targets == \
        {"q_proj", "v_proj"}


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_file_and_key(tiny_hf, adapter_dirs, tmp_path):
    shapes = projection_shapes(tiny_hf)
    with pytest.raises(AdapterError, match="is not a directory"):
        read_adapter(tmp_path / "missing", shapes, 2, torch.float32, "cpu")
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((adapter_dirs[0] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora = True is not supported"):
        read_adapter(bad, shapes, 2, torch.float32, "cpu")
    (bad / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(adapter_dirs[0] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, key: torch.zeros(4, 65)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"q_proj.lora_A.weight has shape \(4, 65\), expected \(4, 64\)"):
        read_adapter(bad, shapes, 2, torch.float32, "cpu")
    with pytest.raises(AdapterError, match="in layers 0..0"):  # an adapter of a deeper model
        read_adapter(adapter_dirs[0], shapes, 1, torch.float32, "cpu")
    whole = (adapter_dirs[0] / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(whole[:-100])
    with pytest.raises(AdapterError, match="cannot read .*adapter_model.safetensors: the file ends before its data"):
        read_adapter(bad, shapes, 2, torch.float32, "cpu")
    save_file({**tensors, key: torch.full((4, 64), float("nan"))}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="q_proj.lora_A.weight holds NaN or infinite values"):
        read_adapter(bad, shapes, 2, torch.float32, "cpu")
    save_file({k: t.bfloat16() for k, t in tensors.items()}, str(bad / "adapter_model.safetensors"))
    as_bf16 = read_adapter(bad, shapes, 2, torch.float32, "cpu")  # a bf16 file served in float32
    assert torch.equal(as_bf16.a[0, "q_proj"], tensors[key].bfloat16().float())


def test_non_finite_values_are_refused_naming_their_tensor_and_a_sum_that_overflows_too(tiny_hf, adapter_dirs,
                                                                                        tmp_path):
    shapes = projection_shapes(tiny_hf)
    (tmp_path / "adapter_config.json").write_text((adapter_dirs[0] / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dirs[0] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"  # (160, 4)
    for value, error in ((float("-inf"), "up_proj.lora_B.weight holds NaN or infinite values"),
                         (3e38, r"values too large to serve \(their sum overflows float32\)")):  # finite each
        save_file({**tensors, key: torch.full((160, 4), value)}, str(tmp_path / "adapter_model.safetensors"))
        with pytest.raises(AdapterError, match=error):
            read_adapter(tmp_path, shapes, 2, torch.float32, "cpu")


def test_an_adapter_read_where_it_serves_is_registered_without_a_copy(tiny_hf, adapter_dirs):
    """Read on the host to serve on the host: the store's worker registers the tensors read, not a copy of them."""
    w = read_adapter(adapter_dirs[0], projection_shapes(tiny_hf), 2, torch.float32, "cpu")
    assert w.to("cpu") is w
    store = AdapterStore(lambda path: w, max_loaded=2)
    store.add("a@v1", str(adapter_dirs[0]), w)
    assert store.names["a@v1"].weights is w
    store.close()


def _one_step(runner, prompts, adapters, *, dense: bool, lora: bool = True, exact: bool = False) -> torch.Tensor:
    """Prefill each prompt with its adapter, then one decode step of all of them: logits (rows, vocab). ``exact``:
    ``decode_rows`` at the step's own shapes (no padded rows or span, SDPA), as the default decode runs it."""
    cache = runner.new_cache(8)  # room for a padded batch
    for row, (p, a) in enumerate(zip(prompts, adapters)):
        runner.prefill([p], [row], cache, [len(p) - 1], None if a is None else OneAdapter(a.weights))
    step = None
    if lora and any(adapters):
        pool = LoRASlots(projection_shapes(runner.hf), 2, 4, torch.float32, "cpu", dense=dense)
        distinct = list({a.uid: a for a in adapters if a}.values())
        slot = dict(zip((a.uid for a in distinct), pool.assign(distinct)))
        step = RowAdapters(pool, [None if a is None else slot[a.uid] for a in adapters],
                           frozenset().union(*(a.weights.targets for a in distinct)))
    tokens, positions = torch.tensor([7] * len(prompts)), torch.tensor([len(p) for p in prompts])
    if exact:
        cache.ensure(len(prompts), int(positions.max()) + 1)
        return runner.decode_rows(tokens, positions, cache, int(positions.max()) + 1, step and step.step())
    return runner.decode(tokens, positions, cache, step)


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "dense"])  # the CPU's way and CUDA's
def test_a_mixed_decode_step_gives_each_row_what_it_gets_alone(tiny_hf, adapter_dirs, dense):
    runner = CausalLMRunner(tiny_hf, 256)
    a0, a1, _, qv = _adapters(tiny_hf, adapter_dirs)
    rows = [None, a0, a1, a0, None, qv]
    prompts = prompts_of([5, 9, 3, 12, 7, 4], 49152, seed=2)
    mixed = _one_step(runner, prompts, rows, dense=dense)
    base = _one_step(runner, prompts, [None] * 6, dense=dense, lora=False)
    for b, a in enumerate(rows):
        alone = _one_step(runner, [prompts[b]], [a], dense=dense)[0]
        torch.testing.assert_close(mixed[b], alone, atol=ATOL, rtol=0)
        if a is None:  # nothing added: the base step's logits bit for bit
            assert torch.equal(mixed[b], base[b])
        else:
            assert (mixed[b] - base[b]).abs().max() > 1e-3  # the adapter changed something


def _seeded_row(runner, prompts, adapters, mates: list[int]) -> list[tuple[torch.Tensor, int, float]]:
    """Row 0 decoded with a seeded sampler for ``len(mates)`` steps, step s beside the first ``mates[s]`` of the
    other rows (greedy; each prompt prefilled alone, so row 0's cache is the same whatever its mates): per step
    row 0's logits, token and log-prob."""
    cache = runner.new_cache(8)
    for row, (p, a) in enumerate(zip(prompts, adapters)):
        runner.prefill([p], [row], cache, [len(p) - 1], None if a is None else OneAdapter(a.weights))
    pool = LoRASlots(projection_shapes(runner.hf), 2, 4, torch.float32, "cpu", dense=False)
    tokens, positions = torch.full((len(prompts),), 7), torch.tensor([len(p) for p in prompts])
    seeded = RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(3))
    out = []
    for live in mates:
        b = 1 + live
        distinct = list({a.uid: a for a in adapters[:b] if a}.values())
        slot = dict(zip((a.uid for a in distinct), pool.assign(distinct)))
        step = RowAdapters(pool, [None if a is None else slot[a.uid] for a in adapters[:b]],
                           frozenset().union(*(a.weights.targets for a in distinct)))
        logits = runner.decode(tokens[:b], positions[:b], cache, step)
        sampled = sample_next_tokens(logits, [seeded] + [RowSampling(temperature=0.0)] * live)
        out.append((logits[0], sampled.token_ids[0], sampled.logprobs[0]))
        tokens[:b], positions[:b] = torch.tensor(sampled.token_ids), positions[:b] + 1
    return out


def test_a_rows_seeded_logprobs_are_bit_identical_whatever_its_batch_mates(tiny_hf, adapter_dirs):
    """The isolation the engine promises per user: row 0 (its own adapter, a seeded sampler) alone, and beside
    rows of another adapter, of its own and of none that end at other steps - one of them long enough that the
    step's attention span crosses 64 - gives the same logits, tokens and log-probs, bit for bit. (On the CPU this
    takes padded shapes: MKL rounds a row of a partial 4-row block otherwise, the attention its span's tail.)"""
    runner = CausalLMRunner(tiny_hf, 256, deterministic=True)
    a0, a1, _, _ = _adapters(tiny_hf, adapter_dirs)
    prompts = prompts_of([20, 9, 5, 100, 3, 12], 49152, seed=4)
    adapters = [a0, a1, None, a1, a0, a1]
    alone = _seeded_row(runner, prompts[:1], adapters[:1], [0] * 7)
    for mates in ([5, 5, 4, 2, 1, 0, 0], [1, 2, 3, 4, 5, 5, 3], [2, 2, 2, 2, 2, 2, 2]):
        beside = _seeded_row(runner, prompts, adapters, mates)
        for step, ((logits, token, lp), (ref_logits, ref_token, ref_lp)) in enumerate(zip(beside, alone)):
            assert torch.equal(logits, ref_logits), f"mates {mates}, step {step}: " \
                f"{(logits - ref_logits).abs().max().item():.2g} apart"
            assert (token, struct.pack("<d", lp)) == (ref_token, struct.pack("<d", ref_lp))


def test_without_deterministic_a_decode_step_runs_at_its_own_shapes(tiny_hf, adapter_dirs):
    """The default ([engine] deterministic off): the step is ``decode_rows`` at its rows and span (SDPA, groups
    unpadded), bit for bit, and the LM head computes the rows it is given, no more."""
    runner = CausalLMRunner(tiny_hf, 256)
    a0, a1, _, _ = _adapters(tiny_hf, adapter_dirs)
    rows, prompts = [a0, None, a1], prompts_of([5, 70, 3], 49152, seed=14)  # 3 rows, a span of 71
    assert torch.equal(_one_step(runner, prompts, rows, dense=False),
                       _one_step(runner, prompts, rows, dense=False, exact=True))
    hidden = torch.randn(3, tiny_hf.config.hidden_size)
    assert torch.equal(runner.lm_head(hidden), tiny_hf.lm_head(hidden).float())
    assert runner.row_block == 1 and CausalLMRunner(tiny_hf, 256, deterministic=True).row_block == 4


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "dense"])
def test_a_mixed_prefill_gives_each_prompt_what_it_gets_alone(tiny_hf, adapter_dirs, dense):
    """One right-padded prefill of five prompts of three adapters and none: each prompt's hidden states as when
    prefilled alone with its adapter; the base prompts' as the same batch without LoRA, bit for bit."""
    runner = CausalLMRunner(tiny_hf, 256)
    a0, a1, _, qv = _adapters(tiny_hf, adapter_dirs)
    rows, prompts = [a1, None, qv, a1, None], prompts_of([7, 12, 5, 9, 10], 49152, seed=13)
    pool = LoRASlots(projection_shapes(tiny_hf), 2, 4, torch.float32, "cpu", dense=dense)
    slot = dict(zip((a1.uid, qv.uid), pool.assign([a1, qv])))
    step = RowAdapters(pool, [None if a is None else slot[a.uid] for a in rows], a1.weights.targets | qv.weights.targets)
    keep = [0] * 5
    mixed = runner.prefill(prompts, list(range(5)), runner.new_cache(8), keep, step.step(width=12))
    base = runner.prefill(prompts, list(range(5)), runner.new_cache(8), keep)
    for i, (p, a) in enumerate(zip(prompts, rows)):
        alone = runner.prefill([p], [0], runner.new_cache(1), [0], None if a is None else OneAdapter(a.weights))[0]
        torch.testing.assert_close(mixed[i], alone, atol=ATOL, rtol=0)
        assert torch.equal(mixed[i], base[i]) == (a is None)


def test_logits_with_an_adapter_are_peft_s(tiny_dir, tiny_hf, adapter_dirs):
    from peft import PeftModel

    peft = PeftModel.from_pretrained(load_causal_lm(tiny_dir), str(adapter_dirs[1])).eval()
    prompt = prompts_of([11], 49152, seed=4)[0]
    with torch.no_grad():
        ref = peft(torch.tensor([prompt + [7]])).logits[0].float()  # (12, vocab)
    runner = CausalLMRunner(tiny_hf, 256)
    a1 = _adapters(tiny_hf, adapter_dirs[1:2])[0]
    cache = runner.new_cache(1)
    hidden = runner.prefill([prompt], [0], cache, [0], OneAdapter(a1.weights))[0]
    torch.testing.assert_close(runner.lm_head(hidden), ref[:-1], atol=ATOL, rtol=0)
    for dense in (False, True):
        step = _one_step(runner, [prompt], [a1], dense=dense)[0]
        torch.testing.assert_close(step, ref[-1], atol=ATOL, rtol=0)


def _lora_engine(tiny_dir, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=256, **kw)


def _req(prompt, n=12, lora=None, **kw) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling_params=greedy(n), lora_path=lora, return_logprob=True, **kw)


async def _load(engine, dirs, names=None):
    for name, d in zip(names or [d.name for d in dirs], dirs):
        res = await engine.load_lora_adapter(name, str(d))
        assert res.success, res.message


def test_a_mixed_batch_serves_each_request_as_alone_and_base_requests_as_without_lora(tiny_dir, adapter_dirs):
    """All five admitted in one step (submitted while paused): the base prompts (60 and 62 tokens) are prefilled
    as one batch with or without LoRA (the adapters' short prompts batch apart by length too), then every step
    decodes the five rows, so the base requests' log-probs are compared bit for bit with the engine without LoRA."""
    prompts = prompts_of([60, 3, 4, 5, 62], 49152, seed=5)
    loras = [None, "a0", "a1", "qv", None]

    async def serve(engine, loras, together: bool = True):
        async with engine:
            if engine.lora_info()["enable_lora"]:
                await _load(engine, [adapter_dirs[0], adapter_dirs[1], adapter_dirs[3]], ["a0", "a1", "qv"])
            reqs = [_req(p, lora=lo) for p, lo in zip(prompts, loras)]
            if not together:
                return [await engine.generate(r) for r in reqs], engine.stats
            await engine.pause_generation("in_place")
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await wait_until(lambda: engine.stats["queued"] == 5)
            await engine.continue_generation()
            return await asyncio.gather(*tasks), engine.stats

    mixed, stats = run(serve(_lora_engine(tiny_dir), loras))
    alone, _ = run(serve(_lora_engine(tiny_dir), loras, together=False))
    plain, plain_stats = run(serve(_lora_engine(tiny_dir, max_loaded_loras=0), [None] * 5))
    assert stats["max_batch_seen"] == plain_stats["max_batch_seen"] == 5 and stats["adapters_registered"] == 3
    for m, a in zip(mixed, alone):
        assert m.output_ids == a.output_ids
        assert_lp_close(m.output_logprobs, a.output_logprobs, 1e-5)
    for i in (0, 4):  # the base requests: what the engine without LoRA gives them in the same batch, bit for bit
        assert mixed[i].output_ids == plain[i].output_ids and mixed[i].output_logprobs == plain[i].output_logprobs
    assert len({tuple(m.output_ids) for m in mixed[1:4]} | {tuple(plain[1].output_ids)}) == 4  # adapters differ


def test_an_unknown_adapter_is_refused_in_sglang_s_words(tiny_dir, adapter_dirs):
    async def go():
        async with _lora_engine(tiny_dir) as engine:
            await _load(engine, adapter_dirs[:1], ["u1@v1"])
            with pytest.raises(AdapterError) as e:
                await engine.generate(_req([5, 6, 7], lora="u1@v2"))
            dup = await engine.load_lora_adapter("u1@v1", str(adapter_dirs[1]))
            gone = await engine.unload_lora_adapter("u9@v1")
            return str(e.value), dup, gone

    message, dup, gone = run(go())
    assert message == "The following requested LoRA adapters are not loaded: u1@v2\nLoaded adapters: ['u1@v1']."
    assert not dup.success and dup.message.startswith("LoRA with name u1@v1 already exists")
    assert dup.loaded_adapters == {"u1@v1": str(adapter_dirs[0])}
    assert not gone.success and gone.message.startswith("LoRA with name u9@v1 does not exist")

    async def off():
        async with _lora_engine(tiny_dir, max_loaded_loras=0) as engine:
            with pytest.raises(BadRequestError, match="LoRA is off on this engine"):
                await engine.generate(_req([5, 6, 7], lora="u1@v1"))
            return await engine.load_lora_adapter("u1@v1", str(adapter_dirs[0]))

    assert not run(off()).success


def test_least_recently_used_idle_adapters_leave_memory_and_are_read_again(tiny_dir, adapter_dirs):
    prompt = [9, 8, 7, 6, 5]

    async def go():
        async with _lora_engine(tiny_dir, max_loaded_loras=2, max_loras_per_batch=1) as engine:
            await _load(engine, adapter_dirs[:2])  # a0, a1 held
            first = [await engine.generate(_req(prompt, lora=n)) for n in ("a1", "a0")]  # a1 the least recent
            await _load(engine, adapter_dirs[2:3])  # a2: a1 leaves memory
            held_after_a2 = engine.stats["adapters_held"], engine.stats["adapter_evictions"]
            again = await engine.generate(_req(prompt, lora="a1"))  # read again; a0 leaves
            return first, held_after_a2, again, engine.stats

    first, held_after_a2, again, stats = run(go())
    assert held_after_a2 == (2, 1)
    assert again.output_ids == first[0].output_ids and again.output_logprobs == first[0].output_logprobs
    assert (stats["adapter_reads"], stats["adapter_evictions"], stats["adapters_held"]) == (1, 2, 2)


def test_an_adapter_in_use_stays_in_memory_and_the_next_one_waits_for_room(tiny_dir, adapter_dirs):
    prompts = prompts_of([7, 8], 49152, seed=6)

    async def go():
        async with _lora_engine(tiny_dir, max_loaded_loras=1, max_loras_per_batch=1) as engine:
            await _load(engine, adapter_dirs[:2])  # room for one: a0 is dropped for a1
            alone = [await engine.generate(_req(p, 40, lora=n)) for p, n in zip(prompts, ("a0", "a1"))]
            long = asyncio.create_task(engine.generate(_req(prompts[0], 40, lora="a0")))
            await wait_until(lambda: engine.stats["running"] == 1)
            second = await engine.generate(_req(prompts[1], 40, lora="a1"))
            return alone, await long, second, engine.stats

    alone, long, second, stats = run(go())
    assert long.output_ids == alone[0].output_ids and second.output_ids == alone[1].output_ids
    assert long.output_logprobs == alone[0].output_logprobs
    # a0 dropped for a1, then for each of the four requests the other one (the last once a0's request ended)
    assert (stats["adapters_held"], stats["adapter_reads"], stats["adapter_evictions"]) == (1, 4, 5)


def test_a_step_computes_at_most_max_loras_per_batch_adapters_and_the_others_take_turns(tiny_dir, adapter_dirs):
    prompts = prompts_of([4, 6, 8, 10], 49152, seed=7)
    names = ["a0", "a1", "a2", "qv"]

    async def go(together: bool):
        async with _lora_engine(tiny_dir, max_loras_per_batch=2) as engine:
            await _load(engine, adapter_dirs, names)
            reqs = [_req(p, 16, lora=n) for p, n in zip(prompts, names)]
            out = await asyncio.gather(*(engine.generate(r) for r in reqs)) if together else \
                [await engine.generate(r) for r in reqs]
            return out, engine.stats

    mixed, stats = run(go(True))
    alone, _ = run(go(False))
    assert stats["adapter_deferred_rows"] > 0 and stats["adapter_slots"] == 2
    for m, a in zip(mixed, alone):
        assert m.output_ids == a.output_ids and len(m.output_ids) == 16
        assert_lp_close(m.output_logprobs, a.output_logprobs, 1e-5)


def test_the_prefix_cache_never_hands_one_adapter_s_kv_to_another(tiny_dir, adapter_dirs):
    prompt = prompts_of([140], 49152, seed=8)[0]  # two whole 64-token blocks are cached

    async def go(prefix_cache_tokens: int):
        async with _lora_engine(tiny_dir, prefix_cache_tokens=prefix_cache_tokens) as engine:
            await _load(engine, adapter_dirs[:2])
            return [await engine.generate(_req(prompt, 4, lora=n)) for n in ("a0", "a1", None, "a0")]

    cached = run(go(1024))
    fresh = run(go(0))
    assert [r.cached_tokens for r in cached] == [0, 0, 0, 128]  # only a0's second request reuses a0's K/V
    for c, f in zip(cached, fresh):
        assert c.output_ids == f.output_ids
        assert_lp_close(c.output_logprobs, f.output_logprobs, 1e-5)


def test_loading_and_unloading_pause_nobody_and_a_request_keeps_the_adapter_it_started_with(tiny_dir, adapter_dirs):
    """Four requests that would run to the 4096-token context are in flight while a new adapter version is loaded
    and the old one unloaded; both return while all four still run, a request on the new version is served
    meanwhile, and then the four are aborted (they never ended by themselves, so nothing waited for them)."""
    prompts = prompts_of([5, 6, 7, 8], 49152, seed=9)
    endless = SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True)

    async def go():
        async with EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=4096) as engine:
            await _load(engine, adapter_dirs[:1], ["u@v1"])
            tasks = [asyncio.create_task(engine.generate(GenerateRequest(input_ids=p, sampling_params=endless,
                                                                         lora_path=lo)))
                     for p, lo in zip(prompts, [None, "u@v1", None, "u@v1"])]
            await wait_until(lambda: engine.stats["running"] == 4)
            loaded = await engine.load_lora_adapter("u@v2", str(adapter_dirs[1]))
            unloaded = await engine.unload_lora_adapter("u@v1")
            v2 = await engine.generate(_req(prompts[0], 4, lora="u@v2"))
            with pytest.raises(AdapterError, match="not loaded: u@v1"):
                await engine.generate(_req(prompts[0], 4, lora="u@v1"))
            running_then, held_then = engine.stats["running"], engine.stats["adapters_held"]
            await engine.abort_request(abort_all=True)
            outs = await asyncio.gather(*tasks)
            return loaded, unloaded, v2, running_then, held_then, outs, engine.stats

    loaded, unloaded, v2, running_then, held_then, outs, stats = run(go())
    assert loaded.success and unloaded.success
    assert loaded.loaded_adapters == {"u@v1": str(adapter_dirs[0]), "u@v2": str(adapter_dirs[1])}
    assert unloaded.loaded_adapters == {"u@v2": str(adapter_dirs[1])}
    assert running_then == 4 and len(v2.output_ids) == 4 and held_then == 2  # u@v1 held while its requests run
    assert all(o.finish_reason["type"] == "abort" and len(o.weight_versions) == 1 for o in outs)
    assert stats["retractions"] == 0 and stats["adapters_held"] == 1  # u@v1 freed once its requests ended

    async def alone():  # the unloaded adapter served its request to the end: what u@v1 gives by itself
        async with _lora_engine(tiny_dir) as engine:
            await _load(engine, adapter_dirs[:1], ["u@v1"])
            return await engine.generate(GenerateRequest(input_ids=prompts[1], lora_path="u@v1",
                                                         sampling_params=greedy(len(outs[1].output_ids))))

    assert run(alone()).output_ids == outs[1].output_ids


def test_the_fused_decode_layers_add_the_dense_step_s_deltas_as_the_runner_does(tiny_hf, adapter_dirs):
    """The compiled decode's layer halves (run uncompiled here; compiled on CUDA: tests/test_gpu_lora.py) with
    the adapters inside them give the runner's logits bit for bit, base rows included."""
    from clawrl.engine.fused_decode import FusedDecode

    runner = CausalLMRunner(tiny_hf, 256)
    a0, _, _, qv = _adapters(tiny_hf, adapter_dirs)
    rows, prompts = [a0, None, qv], prompts_of([5, 8, 3], 49152, seed=11)
    plain = _one_step(runner, prompts, rows, dense=True)
    runner.fused = FusedDecode(tiny_hf, runner.spec.head_dim, backend="eager")
    try:
        fused = _one_step(runner, prompts, rows, dense=True)
    finally:
        runner.fused = None
    assert torch.equal(fused, plain)


def test_a_padded_step_with_adapters_gives_each_row_what_the_unpadded_step_gives(tiny_hf, adapter_dirs):
    """CUDA's padded fixed-shape step (run eagerly on the CPU): 3 rows padded to a bucket of 4 rows, the dense
    step over 2 slots rounded to 2 (a0 and qv); the padding rows get no adapter, the real rows theirs."""
    from clawrl.engine.cuda_graphs import GraphedDecode

    runner = CausalLMRunner(tiny_hf, 256)
    a0, _, _, qv = _adapters(tiny_hf, adapter_dirs)
    rows, prompts = [qv, None, a0], prompts_of([6, 4, 9], 49152, seed=12)
    plain = _one_step(runner, prompts, rows, dense=True)
    padded_decoder = GraphedDecode(runner, 4, capture=False, fuse=False)
    runner.decode, real_decode = padded_decoder.decode, runner.decode  # _one_step decodes through the padded path
    try:
        padded = _one_step(runner, prompts, rows, dense=True)
    finally:
        runner.decode = real_decode
    assert padded.shape == plain.shape == (3, 49152)
    torch.testing.assert_close(padded, plain, atol=ATOL, rtol=0)
