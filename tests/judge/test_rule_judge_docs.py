"""The rule judge does what docs/scale-out.md tells a user trying the router: its recipe's reply is a +1,
the words it lists score as it says, and plain traffic scores 0 (no sample, so no step and no sync)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clawrl.judge.backends import judge_by_rules

PAGE = Path(__file__).resolve().parents[2] / "docs" / "scale-out.md"


def test_the_reply_in_the_routers_recipe_is_a_plus_one():
    [reply] = re.findall(r'\{"role": "user", "content": "([^"]+)"\}\]\s*# the rule judge\'s \+1', PAGE.read_text())
    assert judge_by_rules([("[user]", reply)]) == (1, "user_praise", None)


# the words the page names (as quoted there), a message with each, and its score
LISTED = [("thanks", "thanks", 1), ("great", "great, that helps", 1), ("perfect", "perfect", 1),
          ("next question", "next question: what is 2 + 2?", 1), ("no, ...", "no, that is not it", -1),
          ("wrong", "wrong city", -1), ("shorter", "shorter please", -1), ("try again", "try again", -1)]


@pytest.mark.parametrize(("word", "message", "score"), LISTED)
def test_the_words_the_page_lists_score_as_it_says(word, message, score):
    assert f'"{word}"' in PAGE.read_text()
    assert judge_by_rules([("[user]", message)])[0] == score


@pytest.mark.parametrize("message", ["What about Tuesday?", "ok", "Plan my week"])
def test_plain_traffic_scores_zero(message):
    assert judge_by_rules([("[user]", message)]) == (0, "no_signal", None)


def test_a_tool_result_scores_by_its_error_words():
    assert judge_by_rules([("[tool result]", "Error: no such city")])[0] == -1
    assert judge_by_rules([("[tool result]", "22 degrees")])[0] == 1
