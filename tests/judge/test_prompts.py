import pytest

from clawrl.judge.context import build_judge_context
from clawrl.judge.prompts import (
    HINT_SYSTEM,
    NEXT_STATE_HEADER,
    PRM_SYSTEM,
    allocate_budget,
    build_hint_messages,
    build_prm_messages,
    prompt_kind,
    read_next_state,
    truncate_text,
)

from tests.utils.turns import build_next_state, build_turn

AGENT_MESSAGES = [
    {"role": "system", "content": "You are a travel assistant. Always answer in metric units."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
]
TURN_TEXT = 'It is 18 degrees and sunny.\n<tool_call>\n{"name": "book", "arguments": {}}\n</tool_call>'
TURN_CALLS = [{"id": "c2", "type": "function", "function": {"name": "book", "arguments": "{}"}}]
NEXT = [{"role": "tool", "tool_call_id": "c2", "content": "Error: booking service unavailable"},
        {"role": "user", "content": "no, I did not ask you to book anything.\nJust the weather."}]


def _ctx():
    turn = build_turn(AGENT_MESSAGES, text=TURN_TEXT, tool_calls=TURN_CALLS)
    return build_judge_context(turn, build_next_state(turn, NEXT))


def test_truncate_text_keeps_head_and_tail_and_counts_the_cut():
    text = "a" * 50 + "b" * 50
    # widest marker "\n[... 100 characters cut ...]\n" is 30 chars -> keep 40 - 30 = 10: 5 head + 5 tail;
    # 100 - 10 = 90 characters cut; the result is 5 + 29 + 5 = 39 <= 40
    out = truncate_text(text, 40)
    assert out == "aaaaa\n[... 90 characters cut ...]\nbbbbb"
    assert truncate_text(text, 100) == text
    assert truncate_text(text, 10) == "a" * 10  # no room for a marker: a hard cut, still within the limit
    # head_share 0.2 keeps the end (most recent context): keep = 70 - 30 = 40 -> 8 head + 32 tail
    assert truncate_text(text, 70, head_share=0.2) == "a" * 8 + "\n[... 60 characters cut ...]\n" + "b" * 32


def test_allocate_budget_water_fills_unused_shares():
    lengths, shares = [100, 0, 50, 0, 1000, 1000], [0.10, 0.10, 0.20, 0.10, 0.25, 0.25]
    # non-empty: 0, 2, 4, 5 with shares summing to 0.8 -> fair shares of 1000: 125, 250, 312.5, 312.5;
    # sections 0 and 2 need less (100, 50) and keep all; the 850 left split 0.25:0.25 -> 425 each
    assert allocate_budget(lengths, shares, 1000) == [100, 0, 50, 0, 425, 425]
    assert allocate_budget([10, 20], [0.5, 0.5], 100) == [10, 20]  # everything fits


def test_context_has_request_recent_context_and_labelled_next_state():
    ctx = _ctx()
    assert ctx.system_prompt == "You are a travel assistant. Always answer in metric units."
    assert ctx.user_request == "What's the weather in Paris?"
    assert ctx.context_before == [("[user]", "Hi!"), ("[assistant]", "Hello, how can I help?")]
    assert ctx.since_request == [("[assistant]", '[tool call] get_weather({"city": "Paris"})'),
                                 ("[tool result]", "18 C, sunny")]
    assert ctx.assistant_text == "It is 18 degrees and sunny."  # markup removed: the call is listed below
    assert ctx.tool_calls == ["book({})"]
    assert ctx.next_state == [("[tool result]", "Error: booking service unavailable"),
                              ("[user]", "no, I did not ask you to book anything.\nJust the weather.")]


def test_context_requires_a_next_state():
    turn = build_turn(AGENT_MESSAGES)
    with pytest.raises(ValueError, match="no next state"):
        build_judge_context(turn, build_next_state(turn, None))


def test_prm_prompt_shows_task_context_turn_and_next_state():
    system, user = build_prm_messages(_ctx(), budget_chars=8000)
    assert system == {"role": "system", "content": PRM_SYSTEM}
    body = user["content"]
    for needle in ["## System prompt of the conversation\nYou are a travel assistant.",
                   "## The user's request\nWhat's the weather in Paris?",
                   "[tool result] 18 C, sunny",
                   "## The assistant turn to judge\nIt is 18 degrees and sunny.\n[tool call] book({})",
                   NEXT_STATE_HEADER + "\n[tool result] Error: booking service unavailable\n[user] no, I did not"]:
        assert needle in body
    assert body.index("## The user's request") < body.index("## The assistant turn") < body.index(NEXT_STATE_HEADER)
    assert r"\boxed{1}, \boxed{-1} or \boxed{0}" in body
    for rule in ["+1:", "-1:", "0:", r"\boxed{1}", r"\boxed{0}", r"\boxed{-1}"]:
        assert rule in PRM_SYSTEM


def test_hint_prompt_asks_for_a_hint_block():
    system, user = build_hint_messages(_ctx(), budget_chars=8000)
    assert system["content"] == HINT_SYSTEM
    assert "[HINT_START]" in HINT_SYSTEM and "[HINT_END]" in HINT_SYSTEM and r"\boxed{-1}" in HINT_SYSTEM
    assert "[HINT_START]your hint[HINT_END]" in user["content"]


def test_budget_truncates_long_sections_and_keeps_short_ones_whole():
    long_system = "HEAD " + "x" * 20000 + " TAIL"
    messages = [{"role": "system", "content": long_system}, {"role": "user", "content": "Capital of France?"}]
    turn = build_turn(messages, text="Paris.")
    ctx = build_judge_context(turn, build_next_state(turn, [{"role": "user", "content": "thanks, that's great!"}]))
    body = build_prm_messages(ctx, budget_chars=2000)[1]["content"]
    system_section = body.split("## System prompt of the conversation\n")[1].split("\n\n## The user's request")[0]
    # the other sections need 18 ("Capital of France?") + 6 ("Paris.") + 28 ("[user] thanks, that's great!")
    # chars and keep them; the system prompt gets the rest: 2000 - 52 = 1948 (the marker fits inside)
    assert 1940 <= len(system_section) <= 1948
    assert system_section.startswith("HEAD ") and system_section.endswith(" TAIL")
    assert "characters cut ...]" in system_section
    assert "## The user's request\nCapital of France?" in body
    assert NEXT_STATE_HEADER + "\n[user] thanks, that's great!" in body


def test_empty_optional_sections_are_left_out():
    turn = build_turn([{"role": "user", "content": "2+2?"}], text="4")
    ctx = build_judge_context(turn, build_next_state(turn, [{"role": "user", "content": "ok"}]))
    body = build_prm_messages(ctx, 4000)[1]["content"]
    assert "## System prompt" not in body and "## Conversation before" not in body and "## Between" not in body


def test_read_next_state_and_prompt_kind_round_trip():
    ctx = _ctx()
    prm, hint = build_prm_messages(ctx, 8000), build_hint_messages(ctx, 8000)
    assert read_next_state(prm) == ctx.next_state  # multi-line user message included
    assert prompt_kind(prm) == "prm" and prompt_kind(hint) == "hint"
    with pytest.raises(ValueError):
        prompt_kind([{"role": "system", "content": "something else"}])
