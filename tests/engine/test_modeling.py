"""The batched forward against HF transformers' own forward (fp32), on all three model layouts."""

from __future__ import annotations

import pytest
import torch

from clawrl.engine.modeling import KVBudgetError, CausalLMRunner, KVCache, build_model_spec
from clawrl.models import load_causal_lm

# Batched, padded matmuls reduce in a different order than a batch of one; over 30 layers
# (smollm2, logits up to ~30) that moves logits by up to ~6e-5 on one CPU and ~1.5e-4 on another
# whose kernels differ (AVX-512/AMX), i.e. up to ~5e-6 relative.
ATOL = {"tiny_dir": 1e-5, "tiny_qwen3_dir": 1e-5, "smollm2_dir": 3e-4}


@pytest.fixture(scope="module")
def loaded_models():
    return {}  # fixture name -> HF model, loaded once per module (smollm2 takes seconds)


@pytest.fixture(params=["tiny_dir", "tiny_qwen3_dir", "smollm2_dir"])
def hf_and_runner(request, loaded_models):
    if request.param not in loaded_models:
        loaded_models[request.param] = load_causal_lm(request.getfixturevalue(request.param))
    model = loaded_models[request.param]
    return model, CausalLMRunner(model, max_positions=256), ATOL[request.param]


def _random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_prefill_of_uneven_prompts_matches_hf_logits(hf_and_runner):
    model, runner, atol = hf_and_runner
    prompts = _random_prompts(model.config.vocab_size, (9, 3, 14))
    cache = runner.new_cache(rows=4)
    hidden = runner.prefill(prompts, rows=[2, 0, 1], cache=cache, keep_from=[0, 0, 0])
    for prompt, h in zip(prompts, hidden):
        ours = runner.lm_head(h)  # (len, vocab)
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].float()
        assert ours.shape == (len(prompt), model.config.vocab_size)
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def test_prefill_keeps_only_requested_positions(hf_and_runner):
    model, runner, atol = hf_and_runner
    prompts = _random_prompts(model.config.vocab_size, (6, 10), seed=1)
    hidden = runner.prefill(prompts, rows=[0, 1], cache=runner.new_cache(2), keep_from=[5, 7])
    assert [h.shape[0] for h in hidden] == [1, 3]  # 6-5 and 10-7 positions
    with torch.no_grad():
        ref = model(torch.tensor([prompts[1]])).logits[0, 7:].float()
    torch.testing.assert_close(runner.lm_head(hidden[1]), ref, atol=atol, rtol=0)


def test_decode_rows_at_different_positions_match_hf(hf_and_runner):
    model, runner, atol = hf_and_runner
    vocab = model.config.vocab_size
    seqs = _random_prompts(vocab, (4, 11, 7), seed=2)
    cache = runner.new_cache(rows=3)
    runner.prefill(seqs, rows=[0, 1, 2], cache=cache, keep_from=[len(s) - 1 for s in seqs])
    g = torch.Generator().manual_seed(3)
    steps = []  # (row, position, logits)
    for _ in range(4):
        tokens = torch.randint(0, vocab, (3,), generator=g)
        positions = torch.tensor([len(s) for s in seqs])  # each row at its own position
        logits = runner.decode(tokens, positions, cache)
        for b, s in enumerate(seqs):
            steps.append((b, len(s), logits[b]))
            s.append(int(tokens[b]))
    with torch.no_grad():  # one causal HF forward per row holds the reference for every step
        refs = [model(torch.tensor([s])).logits[0].float() for s in seqs]
    for b, position, got in steps:
        torch.testing.assert_close(got, refs[b][position], atol=atol, rtol=0)


def test_forward_reads_live_weights(tiny_dir):
    model = load_causal_lm(tiny_dir)
    runner = CausalLMRunner(model, max_positions=64)
    ids = [5, 6, 7, 8]

    def logits() -> torch.Tensor:  # every position's logits, through a fresh cache
        [hidden] = runner.prefill([ids], rows=[0], cache=runner.new_cache(rows=1), keep_from=[0])
        return runner.lm_head(hidden)

    before = logits()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    after = logits()
    assert (after - before).abs().max() > 1e-3  # the in-place edit is seen at once
    torch.testing.assert_close(after, model(torch.tensor([ids])).logits[0].float(), atol=1e-5, rtol=0)


def test_rope_tables_equal_hf_rotary_embedding(tiny_qwen3_dir):
    model = load_causal_lm(tiny_qwen3_dir)
    runner = CausalLMRunner(model, max_positions=100)
    positions = torch.tensor([[0, 1, 37, 99]])
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(runner.cos[positions[0]], ref_cos[0]) and torch.equal(runner.sin[positions[0]], ref_sin[0])
    assert runner.cos.shape == (100, 32)  # tiny-qwen3: head_dim 32 != hidden 64 / 4 heads


def test_kv_cache_grows_by_doubling_and_keeps_contents(tiny_dir):
    spec = build_model_spec(load_causal_lm(tiny_dir).config)
    cache = KVCache(spec, rows=4, max_len=300, dtype=torch.float32, device="cpu")
    assert cache.max_tokens == 4 * 300 and cache.slot_bytes == 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x dim
    cache.ensure(1, 10)
    assert (cache.rows, cache.capacity) == (1, 64)  # one row, the minimum positions
    assert torch.all(cache.k[0] == 0)  # zeroed: masked keys must be finite
    with torch.inference_mode():  # cache buffers are inference tensors
        cache.k[1][0, :, :10] = 7.0
    cache.ensure(2, 65)
    assert (cache.rows, cache.capacity) == (2, 128)  # both doubled
    assert torch.all(cache.k[1][0, :, :10] == 7.0) and torch.all(cache.k[1][1] == 0)
    cache.ensure(3, 200)
    assert (cache.rows, cache.capacity) == (4, 256)
    cache.ensure(1, 290)
    assert (cache.rows, cache.capacity) == (4, 300)  # capped at the context limit
    with pytest.raises(ValueError, match="exceeds the context limit 300"):
        cache.ensure(1, 301)
    cache.move_row(0, 2, 10)
    assert torch.all(cache.k[1][2, :, :10] == 7.0)
    cache.reset()
    assert (cache.rows, cache.capacity) == (0, 0) and cache.k == [] and cache.v == []  # every buffer dropped


def test_kv_cache_stays_within_its_token_budget(tiny_dir):
    spec = build_model_spec(load_causal_lm(tiny_dir).config)
    cache = KVCache(spec, rows=8, max_len=1000, dtype=torch.float32, device="cpu", max_tokens=1200)
    cache.ensure(1, 900)
    assert (cache.rows, cache.capacity) == (1, 900)
    with pytest.raises(KVBudgetError, match="2 rows x 900 positions exceed the KV budget of 1200"):
        cache.ensure(2, 100)  # what is cached stays (no shrinking while in use): 2 x 900
    cache.reset()
    cache.ensure(3, 100)
    cache.ensure(5, 150)  # doubling would be 6 x 200 = 1200: fits exactly
    assert (cache.rows, cache.capacity) == (6, 200)
    with pytest.raises(KVBudgetError):
        cache.ensure(5, 201)  # 6 rows stay: 6 x 201 > 1200
    cache.reset()
    cache.ensure(2, 500)  # doubling the positions would be 2 x 1000: grows only as far as the budget allows
    cache.ensure(2, 550)
    assert (cache.rows, cache.capacity) == (2, 600)
    assert sum(t.numel() for t in cache.k + cache.v) * 4 == cache.rows * cache.capacity * cache.slot_bytes


def test_unsupported_architecture_is_refused(tiny_dir):
    config = load_causal_lm(tiny_dir).config
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, qwen3"):
        build_model_spec(config)
