"""The isolation bench's comparison and verdict on hand-made answers (the engine run itself is what the
bench measures; the tiny-model e2e test tests/e2e/test_namespace_adapters.py asserts isolation)."""

from __future__ import annotations

import pytest

from clawrl.bench.isolation import KINDS, compare_answers, format_isolation_section, isolation_verdict


def answer(ids, logprobs):
    return {"ids": ids, "logprobs": logprobs}


def test_identical_answers_compare_identical_with_no_difference():
    a = [answer([5, 6], [-0.5, -1.25]), answer([7], [-2.0])]
    r = compare_answers(a, [dict(x) for x in a])
    assert r == {"identical": True, "answers": 2, "token_changes": 0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0}


def test_a_negative_zero_is_not_bytes_identical_to_zero():
    r = compare_answers([answer([1], [0.0])], [answer([1], [-0.0])])
    assert r["identical"] is False and r["max_abs_diff"] == 0.0  # equal as numbers, not as bytes


def test_differences_stop_where_the_tokens_part():
    before = [answer([1, 2, 3], [-1.0, -2.0, -3.0]), answer([0, 9], [None, -1.0])]
    after = [answer([1, 4, 3], [-1.5, -0.1, -3.0]), answer([0, 9], [None, -1.25])]
    r = compare_answers(before, after)
    # answer 1: only position 0 (|-1 - -1.5| = 0.5); position 1 is another token. answer 2: the None entry
    # (an echo's first position) is skipped, position 1 gives 0.25. max 0.5, mean (0.5 + 0.25) / 2 = 0.375
    assert r["identical"] is False and r["token_changes"] == 1
    assert r["max_abs_diff"] == 0.5 and r["mean_abs_diff"] == 0.375


def test_phases_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="1 answers before, 2 after"):
        compare_answers([answer([1], [-1.0])], [answer([1], [-1.0])] * 2)


def result(broken: tuple[str, str] | None = None, a_moved: float = 0.0123) -> dict:
    same = {"identical": True, "answers": 4, "token_changes": 0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0}
    users = {u: {k: dict(same) for k in KINDS} for u in ("A", "B", "C")}
    users["A"]["echo"] = {"identical": False, "answers": 1, "token_changes": 0, "max_abs_diff": 0.05,
                          "mean_abs_diff": a_moved}
    if broken:
        users[broken[0]][broken[1]] = {**same, "identical": False, "token_changes": 1, "max_abs_diff": 2.5e-7}
    return {"model": "smollm2-135m", "device": "cpu", "dtype": "float32", "rank": 16, "lr": 1e-4, "new_tokens": 16,
            "requests": 25, "decoding": 22, "max_batch_seen": 22, "a_adapter": "A@v1", "b_adapter": "B@v1",
            "a_samples": 8, "a_step_s": 12.5, "sync_s": 0.042, "users": users, "load_1m": 3.0}


def test_verdict_needs_b_and_c_identical_and_a_moved():
    assert isolation_verdict(result()) == (True, "B and C bytes-identical in every kind; A moved")
    assert isolation_verdict(result(("C", "seeded"))) == (
        False, "not bytes-identical: C seeded; at fixed length every kind is")
    assert isolation_verdict(result(("B", "seeded_fixed")))[1] == "not bytes-identical: B seeded_fixed"
    assert isolation_verdict(result(a_moved=0.0)) == (False, "A's log-probs did not move: training A showed nothing")


def test_section_states_the_verdict_and_a_row_for_b_and_for_c():
    text = format_isolation_section(result(("B", "greedy")))
    assert "Target: B and C bytes-identical: NOT MET (not bytes-identical: B greedy; at fixed length every kind is)." in text
    assert "A's echo log-probs moved by 0.0123 on average (max 0.05), 0 of its 4 greedy answers changed" in text
    assert "`A@v1` is synced into the running engine (42 ms)" in text
    assert "its engine with `[engine] deterministic` on (batch-invariant decode steps)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| user")]
    assert rows == ["| B | `B@v1` | **no**: 1 of 4 answers' tokens changed, max 2.5e-07 | yes | yes | yes | yes |",
                    "| C | base | yes | yes | yes | yes | yes |"]
