"""`clawrl bench tools`: two versions on the tools scenario's held-out split, compared per task."""

from __future__ import annotations

import pytest

from clawrl.bench.tools_eval import answer_rows, compare, format_section, paired, per_task, verdict
from clawrl.sim.prompts import QUESTIONS
from clawrl.sim.tools import unseen_plain_tasks


def _row(q: str, tool: bool, **kw) -> dict:
    return {"question": q, "needs_tool": tool, "correct_call": False, "calls": False, "solved": False, **kw}


def test_per_task_rates_and_the_paired_statistics_by_hand():
    first = [_row("a", True, correct_call=True), _row("a", True), _row("b", True), _row("b", True),
             _row("p", False, solved=True), _row("p", False, solved=True)]
    second = [_row("a", True, correct_call=True), _row("a", True, correct_call=True),
              _row("b", True, correct_call=True), _row("b", True), _row("p", False, solved=True), _row("p", False)]
    assert per_task(first, "correct_call", True) == {"a": 0.5, "b": 0.0}
    # diffs a: +0.5, b: +0.5 -> mean 0.5, sd 0: no t; plain p: 1.0 -> 0.5
    assert paired(per_task(first, "correct_call", True), per_task(second, "correct_call", True)) == {
        "tasks": 2, "diff": 0.5, "t": None, "up": 2, "down": 0}
    # diffs +0.5 and -0.5 over two tasks: mean 0, sd sqrt(0.5), t 0
    assert paired({"x": 0.0, "y": 1.0}, {"x": 0.5, "y": 0.5}) == {"tasks": 2, "diff": 0.0, "t": 0.0, "up": 1,
                                                                   "down": 1}
    # diffs 1, 0, 0.5: mean 0.5, sd 0.5, t = 0.5 / (0.5 / sqrt 3) = sqrt 3
    assert paired({"x": 0, "y": 0, "z": 0}, {"x": 1, "y": 0, "z": 0.5})["t"] == pytest.approx(3 ** 0.5)
    rows = {r["rate"]: r for r in compare(first, second)}
    assert (rows["tool_use"]["first"], rows["tool_use"]["second"]) == (0.25, 0.75)
    assert (rows["plain_quality"]["first"], rows["plain_quality"]["second"], rows["plain_quality"]["down"]) == \
        (1.0, 0.5, 1)
    # the gate's rule: tool_use rose on both tasks (no spread: p of a drop 1) -> not worse; plain fell by 0.5 > 0.05
    assert (rows["tool_use"]["p"], rows["tool_use"]["not_worse"]) == (1.0, True)
    assert (rows["plain_quality"]["p"], rows["plain_quality"]["not_worse"]) == (0.0, False)
    text = format_section(list(rows.values()), ("base", "v000016"), samples=2, machine="Machine: m.")
    assert "| tool_use | 0.250 | 0.750 | 2 | +0.500 | n/a | 1 | 2 | 0 | yes |" in text
    assert "| plain_quality | 1.000 | 0.500 | 1 | -0.500 | n/a | 0 | 0 | 1 | **no** |" in text
    assert "tolerance 0.05, alpha 0.05" in text
    assert "plain_quality_unseen" not in rows  # neither version was asked unseen questions


def test_the_verdict_is_the_gate_rule_on_the_per_task_rates():
    a = {"x": 0.5, "y": 1.0, "z": 0.75, "w": 0.25}
    # diffs -0.25, 0, 0, +0.25: mean 0, t 0, p 0.5 -> not worse
    assert verdict(a, {"x": 0.25, "y": 1.0, "z": 0.75, "w": 0.5}, tolerance=0.05, alpha=0.05) == \
        {"p": pytest.approx(0.5), "not_worse": True}
    # diffs -0.125, -0.125, 0, 0: mean -0.0625 < -0.05 -> worse by more than the tolerance, also at a large alpha
    assert not verdict(a, {"x": 0.375, "y": 0.875, "z": 0.75, "w": 0.25}, tolerance=0.05, alpha=0.01)["not_worse"]
    # within a tolerance of 0.1 the same drop is not worse at alpha 0.01: t = -0.0625 / (0.0722 / 2) = -1.73,
    # p = 0.091 with 3 degrees of freedom
    v = verdict(a, {"x": 0.375, "y": 0.875, "z": 0.75, "w": 0.25}, tolerance=0.1, alpha=0.01)
    assert v["not_worse"] and v["p"] == pytest.approx(0.0908, abs=5e-4)
    # false calls: lower is better, so a rise on every task is worse and a fall is not
    assert not verdict({"x": 0.0, "y": 0.0}, {"x": 0.25, "y": 0.25}, tolerance=0.05, alpha=0.05,
                       lower_is_better=True)["not_worse"]
    assert verdict({"x": 0.25, "y": 0.25}, {"x": 0.0, "y": 0.0}, tolerance=0.05, alpha=0.05,
                   lower_is_better=True) == {"p": 1.0, "not_worse": True}


def test_unseen_plain_questions_are_kept_apart_and_compared_on_their_own():
    unseen = unseen_plain_tasks()
    assert len(unseen) == 28 and not {t.question for t in unseen} & {q for q, _ in QUESTIONS}
    assert all(not t.needs_tool and t.keywords for t in unseen)
    assert not any("capital" in t.question.lower() or "how many" in t.question.lower() for t in unseen)
    first = [_row("p", False, solved=True), _row("u", False, unseen=True), _row("u", False, unseen=True, solved=True)]
    second = [_row("p", False), _row("u", False, unseen=True, solved=True), _row("u", False, unseen=True, solved=True)]
    rows = {r["rate"]: r for r in compare(first, second)}
    assert (rows["plain_quality"]["first"], rows["plain_quality"]["second"]) == (1.0, 0.0)  # "p" alone
    assert (rows["plain_quality_unseen"]["first"], rows["plain_quality_unseen"]["second"]) == (0.5, 1.0)
    assert rows["plain_quality_unseen"]["tasks"] == 1 and rows["plain_quality_unseen"]["up"] == 1


def test_answer_rows_ask_every_held_out_task_through_the_gateway(make_settings, tiny_dir):
    s = make_settings({"server.open_mode": True, "ppo.temperature": 0.3, "engine.max_batch_size": 8})
    rows = answer_rows(s, tiny_dir, samples=2, heldout=4, seed=0, max_tokens=4, unseen=3)
    assert len(rows) == 14  # (2 tool tasks + 2 plain questions + 3 unseen plain questions) x 2 answers
    assert sum(r["needs_tool"] for r in rows) == 4 and len({r["question"] for r in rows}) == 7
    assert sum(r["unseen"] for r in rows) == 6 and not any(r["needs_tool"] for r in rows if r["unseen"])
    held = {r["question"] for r in rows if not r["unseen"]}
    assert held.isdisjoint(t.question for t in unseen_plain_tasks())
    assert all(isinstance(r[k], bool) for r in rows for k in ("correct_call", "calls", "solved"))
    assert not (s.storage.data_root / "tables").exists()  # the comparison's turns never enter the run's data
