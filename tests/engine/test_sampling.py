"""Sampling and log-prob maths, with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from clawrl.engine.sampling import RowSampling, compute_prompt_logprobs, sample_next_tokens

# logits [1, 2, 3]: logsumexp = log(e + e^2 + e^3) = log(2.71828 + 7.38906 + 20.08554) = log(30.19288) = 3.40761
LSE_123 = math.log(math.e + math.e**2 + math.e**3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_picks_argmax_with_unscaled_logprob():
    out = sample_next_tokens(torch.tensor([[1.0, 2.0, 3.0]]), [RowSampling(temperature=0.0)])
    assert out.token_ids == [2]
    assert out.logprobs[0] == pytest.approx(3.0 - LSE_123, abs=1e-6)  # 3 - 3.40761 = -0.40761


def test_sampled_logprob_is_temperature_scaled_full_vocab_softmax():
    # T = 2: logits/T = [0.5, 1, 1.5]; lse = log(e^.5 + e + e^1.5) = log(1.64872 + 2.71828 + 4.48169) = 2.18027
    lse = math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    out = sample_next_tokens(torch.tensor([[1.0, 2.0, 3.0]]), [RowSampling(temperature=2.0, generator=_gen(0))])
    tid = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx([0.5, 1.0, 1.5][tid] - lse, abs=1e-6)


def test_top_k_truncates_sampling_but_not_the_logprob():
    # top_k = 1 always samples the argmax; the logprob is NOT renormalised to 0 (SGLang)
    rows = [RowSampling(temperature=1.0, top_k=1, generator=_gen(s)) for s in range(20)]
    out = sample_next_tokens(torch.tensor([[1.0, 2.0, 3.0]] * 20), rows)
    assert out.token_ids == [2] * 20
    assert out.logprobs[0] == pytest.approx(3.0 - LSE_123, abs=1e-6)


def _frequencies(logits: list[float], row: RowSampling, n: int) -> list[float]:
    out = sample_next_tokens(torch.tensor([logits] * n), [row] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits))
    return (counts.float() / n).tolist()


def test_top_p_keeps_tokens_whose_preceding_mass_is_within_p():
    # probs [0.5, 0.3, 0.2]; mass before each: [0, 0.5, 0.8]; top_p 0.6 keeps the first two,
    # renormalised to 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    freq = _frequencies(logits, RowSampling(top_p=0.6, generator=_gen(1)), 4000)
    assert freq[2] == 0.0
    assert freq[0] == pytest.approx(0.625, abs=0.03)


def test_min_p_drops_tokens_below_fraction_of_the_best():
    # probs [0.5, 0.3, 0.2]; min_p 0.5 -> threshold 0.25 drops token 2; keeps 0.5/0.8 and 0.3/0.8
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    freq = _frequencies(logits, RowSampling(min_p=0.5, generator=_gen(2)), 4000)
    assert freq[2] == 0.0
    assert freq[1] == pytest.approx(0.375, abs=0.03)


def test_untruncated_sampling_follows_the_softmax():
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    freq = _frequencies(logits, RowSampling(generator=_gen(3)), 4000)
    # binomial std at p=0.2, n=4000: sqrt(.2*.8/4000) = 0.0063; 0.03 is ~5 std
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


def test_seeded_row_samples_the_same_tokens_whatever_its_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    alone = sample_next_tokens(logits[:1], [RowSampling(temperature=0.9, generator=_gen(42))]).token_ids[0]
    mates = [RowSampling(temperature=0.0), RowSampling(top_p=0.5, top_k=7, generator=_gen(5)),
             RowSampling(temperature=1.3, min_p=0.1)]
    for perm in ([0, 1, 2, 3], [3, 2, 0, 1]):
        rows = [RowSampling(temperature=0.9, generator=_gen(42))] + mates
        batch_rows = [rows[i] for i in perm]
        out = sample_next_tokens(logits[perm], batch_rows, shared_generator=_gen(9))
        assert out.token_ids[perm.index(0)] == alone


def test_seed_sequence_is_reproducible():
    torch.manual_seed(1)
    logits = torch.randn(1, 500)

    def draw(seed):
        g = _gen(seed)
        return [sample_next_tokens(logits, [RowSampling(generator=g)]).token_ids[0] for _ in range(10)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_logprobs_are_sorted_pairs_of_the_returned_distribution():
    out = sample_next_tokens(torch.tensor([[1.0, 3.0, 2.0]]), [RowSampling(temperature=0.0, top_logprobs_num=2)])
    (first, second) = out.top[0]
    assert first[1] == 1 and second[1] == 2
    assert first[0] == pytest.approx(3.0 - LSE_123, abs=1e-6)
    assert second[0] == pytest.approx(2.0 - LSE_123, abs=1e-6)
    assert sample_next_tokens(torch.tensor([[1.0, 3.0]]), [RowSampling(temperature=0.0)]).top == [None]


def test_banned_tokens_are_excluded_and_logprobs_see_the_mask():
    banned = torch.tensor([[False, False, True]])
    out = sample_next_tokens(torch.tensor([[1.0, 2.0, 3.0]]), [RowSampling(temperature=0.0)], banned=banned)
    # token 2 masked: greedy picks 1, logprob = 2 - log(e + e^2) = 2 - 2.31326 = -0.31326
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(2.0 - math.log(math.e + math.e**2), abs=1e-6)


def test_prompt_logprobs_are_plain_log_softmax_of_each_target():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    values, tops = compute_prompt_logprobs(logits, [0, 1], top_num=1)
    # row 0: 1 - 3.40761 = -2.40761; row 1: uniform, log(1/3) = -1.09861
    assert values == pytest.approx([1.0 - LSE_123, -math.log(3.0)], abs=1e-6)
    assert tops[0] == [(pytest.approx(3.0 - LSE_123, abs=1e-6), 2)]
