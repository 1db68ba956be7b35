"""The promotion gate's decision rule, with hand-computed evidence."""

import math

import pytest

from clawrl.gate import PROMOTE, REFUSE, decide_promotion, paired_t


def test_equal_means_with_spread_are_promoted_with_a_t_interval():
    # d = [0.5, 0, -0.5, 0]: mean 0; s² = (0.25 + 0 + 0.25 + 0) / 3 = 1/6, s = 0.40825, se = s / 2 = 0.20412
    # t = 0 -> p = 0.5; t_{3, 0.975} = 3.18245 -> half width 3.18245 * 0.20412 = 0.64962
    d = decide_promotion([1, 1, 0.5, 0], [0.5, 1, 1, 0], tolerance=0.05, alpha=0.05)
    assert d.decision == PROMOTE and d.promoted and d.n == 4
    assert d.candidate_mean == d.champion_mean == 0.625 and d.mean_diff == 0
    assert d.p_value == pytest.approx(0.5)
    assert (d.ci_low, d.ci_high) == (pytest.approx(-0.64962, abs=1e-5), pytest.approx(0.64962, abs=1e-5))
    assert d.reason.startswith("not worse beyond the tolerance 0.05: candidate 0.625 vs champion 0.625 on 4 prompts")


def test_significantly_worse_within_the_tolerance_is_refused():
    # d = [-0.1, -0.1, -0.1, -0.2]: mean -0.125; deviations 0.025 x3, -0.075 -> s² = 0.0075 / 3 = 0.0025,
    # s = 0.05, se = 0.025, t = -5; for 3 degrees of freedom F(t) = 1/2 + (x / (1 + x²) + atan x) / π with
    # x = t / √3 = -2.88675: (-0.30929 - 1.23732) / π = -0.49231 -> p = 0.00769 < 0.05
    d = decide_promotion([0.4, 0.4, 0.4, 0.3], [0.5, 0.5, 0.5, 0.5], tolerance=0.2, alpha=0.05)
    assert d.decision == REFUSE and d.mean_diff == pytest.approx(-0.125)
    assert d.p_value == pytest.approx(0.00769, abs=1e-5)
    assert d.reason.startswith("significantly worse (p < alpha 0.05)")


def test_a_mean_difference_beyond_the_tolerance_is_refused_even_if_not_significant():
    # d = [-0.5, 0, -0.5, 0]: mean -0.25 < -0.2; s = 0.2887, se = 0.1443, t = -1.732 -> p = 0.091 > 0.05
    d = decide_promotion([0, 1, 0, 1], [0.5, 1, 0.5, 1], tolerance=0.2, alpha=0.05)
    assert d.decision == REFUSE and d.mean_diff == -0.25 and d.p_value > 0.05
    assert d.reason.startswith("worse by more than the tolerance 0.2")


def test_promotions_cannot_drift_below_the_best_promoted_score():
    # the champion itself slipped to 0.6; the best promoted version scored 0.75: 0.6 < 0.75 - 0.1
    d = decide_promotion([0.6] * 5, [0.6] * 5, tolerance=0.1, alpha=0.05, floor=0.75)
    assert d.decision == REFUSE and d.p_value == 1.0 and d.floor == 0.75
    assert d.reason.startswith("below the best promoted score 0.750")
    assert decide_promotion([0.7] * 5, [0.6] * 5, tolerance=0.1, alpha=0.05, floor=0.75).promoted  # 0.7 >= 0.65


def test_with_min_gain_only_a_gain_beyond_it_is_promoted():
    # the first test's pair: d̄ = 0, not worse (promoted without min_gain) but no gain: the champion stays
    tie = decide_promotion([1, 1, 0.5, 0], [0.5, 1, 1, 0], tolerance=0.05, alpha=0.05, min_gain=0.0)
    assert tie.decision == REFUSE and tie.mean_diff == 0 and tie.p_value == pytest.approx(0.5)
    assert tie.reason.startswith("not better than the champion by more than min_gain 0: candidate 0.625")
    # d = [0.5, 0, 0, 0]: d̄ = 0.125 > 0 -> promoted; > 0.1 too; not > 0.125 (d̄ itself)
    cand, champ = [1, 1, 1, 0], [0.5, 1, 1, 0]
    gain = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.0)
    assert gain.promoted and gain.mean_diff == 0.125
    # s² = (0.375² + 3 x 0.125²) / 3 = 0.0625, se = 0.25 / 2 = 0.125, t = 1; for 3 degrees of freedom
    # F(1) = 1/2 + (x / (1 + x²) + atan x) / π, x = 1/√3: 0.5 + (0.433013 + π/6) / π = 0.804498; half width
    # 3.18245 x 0.125 = 0.39781. The p is the "worse" test's (the only one made): "not worse", never "better"
    assert gain.p_value == pytest.approx(0.804498, abs=1e-6)
    assert gain.reason == ("not worse, and ahead of the champion by more than min_gain 0: candidate 0.750 vs champion "
                           "0.625 on 4 prompts, difference +0.125 (95% interval -0.273 .. +0.523, one-sided p 0.804 "
                           "for 'worse')")
    assert decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.1).promoted
    assert not decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.125).promoted
    # the refusing clauses come first: a gain over a champion that slipped below the floor is still refused
    low = decide_promotion([0.7] * 5, [0.6] * 5, tolerance=0.05, alpha=0.05, floor=0.8, min_gain=0.0)
    assert low.decision == REFUSE and low.reason.startswith("below the best promoted score 0.800")


def test_equal_differences_decide_by_their_sign():
    assert paired_t([-0.1, -0.1], 0.05) == (pytest.approx(-0.1), 0.0, pytest.approx(-0.1), pytest.approx(-0.1))
    assert paired_t([0.0, 0.0, 0.0], 0.05) == (0.0, 1.0, 0.0, 0.0)
    # a consistent small loss is significant, so refused although within the tolerance
    assert decide_promotion([0.45, 0.45], [0.5, 0.5], tolerance=0.1, alpha=0.05).decision == REFUSE


def test_no_prompts_and_bad_input_are_refused_or_raise():
    d = decide_promotion([], [], tolerance=0.05, alpha=0.05)
    assert d.decision == REFUSE and d.n == 0 and math.isnan(d.mean_diff) and "no evaluation prompts" in d.reason
    with pytest.raises(ValueError, match="pair up: 2 vs 3"):
        decide_promotion([1, 0], [1, 0, 1], tolerance=0.05, alpha=0.05)
    with pytest.raises(ValueError, match="alpha in"):
        decide_promotion([1], [1], tolerance=0.05, alpha=1.5)


def test_a_significant_live_drop_rolls_back():
    from clawrl.gate import decide_live_rollback

    # champion: 10 of 40 scored +1, the rest -1 -> mean -0.5; previous: 30 of 40 -> +0.5; d = -1.0
    # v = 4 p (1 - p) n / (n - 1) = 4 * 0.25 * 0.75 * 40 / 39 = 0.76923 for both; se² = 2 * 0.76923 / 40 = 0.038462,
    # se = 0.19612, t = -5.099; df = se⁴ / (2 (0.019231)² / 39) = 78.0 -> p ~ 1e-6
    c = decide_live_rollback([1] * 10 + [-1] * 30, [1] * 30 + [-1] * 10, tolerance=0.1, alpha=0.05, min_n=32)
    assert c.rollback and c.mean_diff == -1.0 and (c.n_champion, c.n_previous) == (40, 40)
    assert c.p_value == pytest.approx(1.1e-6, rel=0.5) and c.ci_high < 0
    assert c.reason.startswith("dropped by more than 0.1, significantly (p < 0.05): live judged score -0.500 (n=40)")


def test_no_live_rollback_without_enough_turns_or_within_the_tolerance():
    from clawrl.gate import decide_live_rollback

    few = decide_live_rollback([-1] * 10, [1] * 10, tolerance=0.1, alpha=0.05, min_n=32)
    assert not few.rollback and few.reason.startswith("not enough judged live turns to compare (10 and 10; 32")
    # 0.45 vs 0.5 on 400 turns each: significant? barely not, and within the tolerance 0.1 anyway
    close = decide_live_rollback([1] * 290 + [-1] * 110, [1] * 300 + [-1] * 100, tolerance=0.1, alpha=0.05, min_n=32)
    assert not close.rollback and close.mean_diff == pytest.approx(-0.05)
    assert close.reason.startswith("no significant drop beyond the tolerance")
