import pytest

from clawrl.judge.parse import parse_hint, parse_score, visible_text

SCORE_CASES = [
    # (judge output, expected score)
    (r"The user thanked the assistant. \boxed{1}", 1),
    (r"\boxed{-1}", -1),
    (r"\boxed{0}", 0),
    (r"\boxed{ -1 }", -1),
    (r"\boxed{+1}", 1),
    (r"\boxed {1}", 1),
    (r"\boxed{\text{1}}", 1),
    (r"\boxed{\text{ -1 }}", -1),
    (r"\boxed{\mathbf{0}}", 0),
    (r"$\boxed{-1}$", -1),
    ("\\boxed{\u22121}", -1),  # unicode minus sign
    ("\\boxed{\u20131}", -1),  # en dash used as a minus
    (r"\boxed{1.0}", 1),
    (r"\boxed{-0}", 0),
    # several boxes: the last one decides
    (r"Maybe \boxed{1}? No, on reflection \boxed{-1}", -1),
    (r"\boxed{-1} ... \boxed{0}", 0),
    # the last box is malformed: no fallback to an earlier, valid one
    (r"\boxed{1} final: \boxed{yes}", None),
    (r"\boxed{1} final: \boxed{1", None),  # unclosed (cut off by max_tokens)
    # thinking is not the answer
    (r"<think>clearly \boxed{1}</think> The user complained. \boxed{-1}", -1),
    (r"<think>\boxed{-1}</think>", None),
    (r"\boxed{1} <think>hmm, or \boxed{-1}", 1),  # an unclosed <think> hides what follows
    (r"<think>still thinking \boxed{1}", None),
    (r"reasoning whose <think> was in the prompt \boxed{-1}</think> answer \boxed{1}", 1),  # stray </think>
    (r"<THINK>\boxed{-1}</THINK>\boxed{0}", 0),
    # missing / out of range / junk
    ("", None),
    (None, None),
    ("The answer is 1.", None),
    (r"\boxed{}", None),
    (r"\boxed{2}", None),
    (r"\boxed{10}", None),
    (r"\boxed{-2}", None),
    (r"\boxed{1/2}", None),
    (r"\boxed{positive}", None),
    (r"\boxed{1 1}", None),
    (r"\boxed{--1}", None),
]


@pytest.mark.parametrize("text,expected", SCORE_CASES)
def test_parse_score_table(text, expected):
    assert parse_score(text) == expected


HINT_CASES = [
    (r"\boxed{1} [HINT_START] Answer in one word. [HINT_END]", (True, "Answer in one word.")),
    (r"\boxed{1}" + "\n[HINT_START]\nUse metric units.\n[HINT_END]", (True, "Use metric units.")),
    (r"[HINT_START]old[HINT_END] [HINT_START]Use the newest API.[HINT_END] \boxed{1}", (True, "Use the newest API.")),
    (r"\boxed{1} no hint block", (True, None)),
    (r"\boxed{1} [HINT_START]   [HINT_END]", (True, None)),
    (r"\boxed{1} [HINT_START] never closed", (True, None)),
    (r"\boxed{-1} [HINT_START]ignored[HINT_END]", (False, None)),
    (r"\boxed{-1}", (False, None)),
    (r"\boxed{0} [HINT_START]x[HINT_END]", (None, None)),  # 0 is not a hint decision
    (r"no decision [HINT_START]x[HINT_END]", (None, None)),
    (r"<think>\boxed{1}[HINT_START]draft[HINT_END]</think>\boxed{-1}", (False, None)),
    (r"<think>[HINT_START]draft[HINT_END]</think>\boxed{1}[HINT_START]Final hint.[HINT_END]", (True, "Final hint.")),
    (None, (None, None)),
]


@pytest.mark.parametrize("text,expected", HINT_CASES)
def test_parse_hint_table(text, expected):
    assert parse_hint(text) == expected


def test_visible_text_drops_closed_unclosed_and_stray_thinking():
    assert visible_text("a<think>x</think>b<think>y") == "ab"
    assert visible_text("thought</think>answer") == "answer"
    assert visible_text("<think>a<think>b</think>c</think>d") == "d"  # nested: everything up to the last close
