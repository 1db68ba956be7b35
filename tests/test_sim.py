"""Simulated users: persona checks, the on-topic rule, reactions, the score and the KL estimate."""

import math

import pytest

from clawrl.sim.personas import OFF_TOPIC, PERSONAS, THANKS, get_persona, on_topic, react
from clawrl.sim.prompts import QUESTIONS, VALIDATION_QUESTIONS, split_questions, validation_questions
from clawrl.sim.users import Interaction, kl_to_reference, score


def test_persona_checks():
    assert PERSONAS["concise"].satisfied("Paris is the capital of France.")
    assert not PERSONAS["concise"].satisfied(" ".join(["word"] * 26))  # 26 words > 25
    assert PERSONAS["signoff"].satisfied("Paris. Cheers!") and not PERSONAS["signoff"].satisfied("Paris.")
    assert PERSONAS["lowercase"].satisfied("paris, of course") and not PERSONAS["lowercase"].satisfied("Paris")
    assert PERSONAS["bullets"].satisfied("- one\n- two") and not PERSONAS["bullets"].satisfied("- only one")
    assert PERSONAS["french"].satisfied("La capitale de la France est Paris.")
    assert not PERSONAS["french"].satisfied("The capital of France is Paris.")
    assert PERSONAS["detailed"].satisfied(" ".join(["word"] * 30)) and not PERSONAS["detailed"].satisfied(
        " ".join(["word"] * 29))  # at least 30 words
    assert PERSONAS["paragraphs"].satisfied("Paris.\n\nIt is in France.")
    assert not PERSONAS["paragraphs"].satisfied("Paris.\nIt is in France.\n\n  ")  # one break and a blank tail
    assert PERSONAS["plain"].satisfied("  Paris, in France.\n") and not PERSONAS["plain"].satisfied("Paris.\nFrance.")
    assert not PERSONAS["concise"].satisfied("   ")  # an empty answer satisfies nobody
    with pytest.raises(ValueError, match="valid: concise"):
        get_persona("pirate")


def test_on_topic_uses_keyword_prefixes():
    assert on_topic("Plants turn sunlight into sugar.", ("plant", "sugar"))
    assert not on_topic("I love cheese.", ("plant", "sugar"))
    q = "How does a refrigerator keep food cold?"
    assert not on_topic(q, ("heat", "cold", "refrigerant"), q)  # echoing the question is not an answer
    assert on_topic("It pumps heat out.", ("heat", "cold", "refrigerant"), q)


def test_reactions_follow_the_rules():
    concise = PERSONAS["concise"]
    kw = ("paris",)
    assert react(concise, "Paris.", kw) == (THANKS, True, True)
    assert react(concise, "Berlin.", kw) == (OFF_TOPIC, True, False)  # off topic wins over the persona
    long = "Paris " + "is lovely " * 20
    msg, liked, topical = react(concise, long, kw)
    assert msg == concise.correction and not liked and topical


def test_score_needs_both_persona_and_topic():
    xs = [Interaction("s", "q", "a", True, True, ""), Interaction("s", "q", "a", True, False, ""),
          Interaction("s", "q", "a", False, True, ""), Interaction("s", "q", "a b", False, False, "")]
    out = score(xs)
    assert out == {"score": 0.25, "persona_rate": 0.5, "on_topic_rate": 0.5, "mean_words": 1.25}


def test_kl_estimate_is_the_token_mean_of_logprob_differences():
    # tokens: (-1 - -2) + (-1 - -1.5) + (-3 - -3) = 1 + 0.5 + 0 = 1.5 over 3 tokens = 0.5
    assert kl_to_reference([[-1.0, -1.0], [-3.0]], [[-2.0, -1.5], [-3.0]]) == pytest.approx(0.5)
    assert math.isnan(kl_to_reference([], []))


def test_question_split_is_fixed_and_disjoint():
    train, held = split_questions(n_heldout=16, seed=0)
    assert len(held) == 16 and len(train) == len(QUESTIONS) - 16
    assert not {q for q, _ in train} & {q for q, _ in held}
    assert split_questions(seed=0) == (train, held)


def test_validation_questions_are_neither_trained_on_nor_held_out():
    """The gate's questions share none with QUESTIONS, whatever the held-out split takes from it."""
    val = validation_questions(32, seed=0)
    assert len(val) == 32 and set(val) == set(VALIDATION_QUESTIONS)
    assert not {q for q, _ in VALIDATION_QUESTIONS} & {q for q, _ in QUESTIONS}
    assert validation_questions(8, seed=0) == val[:8] and validation_questions(8, seed=1) != val[:8]
    with pytest.raises(ValueError, match=r"validation size must be in \[1, 32\], got 33"):
        validation_questions(33)


def test_round_questions_walk_the_pool_and_repeat_for_groups():
    from clawrl.flows.loop import round_questions

    pool = list("abcdefghij")
    assert round_questions(pool, 1, 4) == list("abcd") and round_questions(pool, 3, 4) == list("ijab")  # wraps
    assert round_questions(pool, 1, 6, group_size=2) == list("aabbcc")
    assert round_questions(pool, 2, 6, group_size=2) == list("ddeeff")  # continues after 3 distinct questions
    assert round_questions(pool, 1, 5, group_size=2) == list("aabbc")  # a last group may be smaller
    with pytest.raises(ValueError, match="group_size"):
        round_questions(pool, 1, 4, group_size=0)
