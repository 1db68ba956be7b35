"""The users demo's panel (clawrl/sim/panel.py) and its gate evaluator (clawrl.sim.validation:users_...)."""

from __future__ import annotations

import pytest

from clawrl.hooks import HookError, import_path
from clawrl.ids import namespace_for_key
from clawrl.sim.panel import parse_panel, persona_of_namespace, turns_needed, user_key, user_namespace, user_questions
from clawrl.sim.prompts import split_questions


def test_a_panel_keeps_its_order_and_refuses_unknown_and_repeated_personas():
    assert parse_panel(" french, concise ") == ["french", "concise"]
    with pytest.raises(ValueError, match="unknown persona 'nope'; valid: concise, signoff"):
        parse_panel("concise,nope")
    with pytest.raises(ValueError, match="persona french named twice"):
        parse_panel("french,concise,french")
    with pytest.raises(ValueError, match="no persona"):
        parse_panel(" , ")


def test_each_user_is_the_namespace_the_gateway_gives_its_key():
    assert user_namespace("french") == namespace_for_key(user_key("french")) == namespace_for_key("demo-user-french")
    assert persona_of_namespace(user_namespace("bullets"), ["concise", "bullets"]) == "bullets"
    with pytest.raises(ValueError, match="none of the panel's users"):
        persona_of_namespace(user_namespace("signoff"), ["concise", "bullets"])


def test_a_users_questions_continue_round_after_round_in_an_order_of_its_own():
    pool, held = split_questions(n_heldout=12, seed=0)
    r1, r2 = user_questions(pool, "concise", 1, 8, 0), user_questions(pool, "concise", 2, 8, 0)
    assert len(set(map(str, r1 + r2))) == 16 and not set(map(str, r1 + r2)) & set(map(str, held))
    assert user_questions(pool, "concise", 1, 16, 0) == r1 + r2  # the same schedule whatever the round size
    assert user_questions(pool, "french", 1, 8, 0) != r1  # another user, another order of the same pool
    assert user_questions(pool, "concise", 1, 8, 0) == r1  # seeded: the same in both arms


def test_turns_needed_is_the_first_measurement_at_the_level():
    # scores after 0, 8, 16, 24 own turns; the level 0.5 is first reached after 16
    assert turns_needed([0.0, 0.25, 0.5, 0.5], [0, 8, 16, 24], 0.5) == 16
    assert turns_needed([0.0, 0.25], [0, 8], 0.5) is None


def test_the_panel_gate_scores_a_users_adapter_by_its_persona_and_the_shared_policy_by_each_user_in_turn():
    evaluator = import_path("clawrl.sim.validation:users_concise_bullets")
    prompts, shared = evaluator(size=4, seed=0)
    _, concise = evaluator(size=4, seed=0, namespace=user_namespace("concise"))
    question = prompts[0][0]["content"]
    long_answer = "Fossils are remains of ancient plants and animals preserved in rock " * 3  # 33 words, on topic
    bullets = "- remains of ancient animals\n- preserved in rock"
    assert question == "What is a fossil?"
    assert (concise(0, long_answer), concise(0, bullets)) == (0.0, 1.0)  # the concise user wants <= 25 words
    short = "Remains of ancient animals preserved in rock."
    _, shared_bullets_first = import_path("clawrl.sim.validation:users_bullets_concise")(size=4, seed=0)
    # question 0 is scored by the panel's first user: short and plain suits concise, not bullets
    assert (shared(0, short), shared_bullets_first(0, short)) == (1.0, 0.0)
    with pytest.raises(HookError, match="unknown persona 'nope'"):
        import_path("clawrl.sim.validation:users_concise_nope")
