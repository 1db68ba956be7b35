import json

import pytest

from clawrl.gateway.sessions import (
    BadSessionError,
    SessionTracker,
    derive_session_id,
    explicit_session_id,
    validate_session_id,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_next_state_is_messages_added_after_the_assistant_turn():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    first = msgs(("system", "be brief"), ("user", "hi"))
    assert tr.link_next_state(s, first) is None  # nothing pending yet
    tr.finish_turn(s, "t0", s.next_index, first, main=True, done=False)
    second = first + msgs(("assistant", "hello"), ("user", "no, shorter please"))
    rec = tr.link_next_state(s, second)
    assert rec.turn_id == "t0" and rec.turn_index == 0 and rec.has_next_state
    assert json.loads(rec.messages) == [{"role": "user", "content": "no, shorter please"}]
    assert rec.reason == "next_request"
    assert s.pending is None


def test_choices_take_an_index_each_and_a_reply_to_another_choice_is_not_choice_0s():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    first = msgs(("system", "be brief"), ("user", "hi"))
    answers = [{"role": "assistant", "content": t, "tool_calls": None} for t in ("hello", "hey", "hello")]
    for sid, went_on, reason in (("a", "hello", "next_request"), ("b", "hey", "other_choice_continued"),
                                 ("c", "howdy", "next_request")):  # "howdy": no choice's text, choice 0's as ever
        s, _ = tr.open("ns", sid)
        tr.finish_turn(s, "t0", s.next_index, first, answers[0], main=True, done=False, others=answers[1:])
        assert s.next_index == 3 and s.pending.turn_index == 0
        rec = tr.link_next_state(s, first + msgs(("assistant", went_on), ("user", "and?")))
        assert (rec.turn_id, rec.reason, rec.has_next_state) == ("t0", reason, reason == "next_request")
        assert (rec.messages is None) == (reason != "next_request")
    # a request going on with another choice, without a session id, still finds its session
    assert tr.find("ns", [{"role": "user", "content": "other"}, *first[1:], answers[1]]) == "c"


def test_parallel_tool_results_all_belong_to_the_next_state():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    first = msgs(("user", "weather in Paris and Rome?"))
    tr.finish_turn(s, "t0", s.next_index, [{"role": "user"}], main=True, done=False)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]}
    results = [{"role": "tool", "tool_call_id": "a", "content": "12C"},
               {"role": "tool", "tool_call_id": "b", "content": "18C"}]
    rec = tr.link_next_state(s, first + [call] + results)
    assert json.loads(rec.messages) == results


def test_side_turns_never_become_pending_and_indices_count_all_turns():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    tr.finish_turn(s, "side0", s.next_index, [{"role": "user"}], main=False, done=False)
    assert s.pending is None
    i = s.next_index
    tr.finish_turn(s, "main1", i, [{"role": "user"}], main=True, done=False)
    assert i == 1 and s.pending.turn_id == "main1" and s.next_index == 2


def test_session_done_closes_with_no_next_state():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    out = tr.finish_turn(s, "t0", s.next_index, [{"role": "user"}], main=True, done=True)
    assert len(out) == 1 and out[0].has_next_state is False and out[0].reason == "session_done"
    assert len(tr) == 0
    s2, _ = tr.open("ns", "s1")  # a returning session continues its indices
    assert s2.next_index == 1


def test_idle_timeout_sweeps_pending_turns():
    clock = Clock()
    tr = SessionTracker(idle_timeout_s=10, max_sessions=10, clock=clock)
    s, _ = tr.open("ns", "s1")
    tr.finish_turn(s, "t0", s.next_index, [{"role": "user"}], main=True, done=False)
    clock.t = 9.9
    assert tr.sweep() == []
    clock.t = 10.0
    out = tr.sweep()
    assert [(r.turn_id, r.reason, r.has_next_state) for r in out] == [("t0", "idle_timeout", False)]
    assert len(tr) == 0


def test_memory_is_bounded_and_eviction_records_no_next_state():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=2)
    for i in range(2):
        s, ev = tr.open("ns", f"s{i}")
        tr.finish_turn(s, f"t{i}", s.next_index, [{"role": "user"}], main=True, done=False)
        assert ev == []
    _, evicted = tr.open("ns", "s2")
    assert len(tr) == 2
    assert [(r.turn_id, r.reason) for r in evicted] == [("t0", "evicted")]


def test_namespaces_isolate_sessions():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    a, _ = tr.open("key-a", "shared-id")
    tr.finish_turn(a, "ta", a.next_index, [{"role": "user"}], main=True, done=False)
    b, _ = tr.open("key-b", "shared-id")
    assert b is not a and b.pending is None
    assert tr.link_next_state(b, msgs(("user", "x"), ("assistant", "y"), ("user", "z"))) is None
    assert a.pending.turn_id == "ta"


def test_realigns_when_history_was_truncated():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    tr.finish_turn(s, "t0", s.next_index, [{"role": "user"}] * 5, main=True, done=False)
    rec = tr.link_next_state(s, msgs(("assistant", "old"), ("user", "and then?")))
    assert rec.reason == "next_request_realigned"
    assert json.loads(rec.messages) == [{"role": "user", "content": "and then?"}]


def test_a_request_without_any_answer_left_links_what_follows_the_turns_request():
    """Codex CLI compacting in the middle of a turn: the tool call and its output became a summary
    message after the turn's own request; that message is the next state, not the whole conversation."""
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    s, _ = tr.open("ns", "s1")
    request = msgs(("developer", "d"), ("user", "env"), ("user", "list the files"))
    tr.finish_turn(s, "t0", 0, request, main=True, done=False)
    rec = tr.link_next_state(s, [*request, {"role": "user", "content": "Summary: ls printed a.txt."}])
    assert rec.reason == "next_request_realigned"
    assert json.loads(rec.messages) == [{"role": "user", "content": "Summary: ls printed a.txt."}]
    tr.finish_turn(s, "t1", 1, request, main=True, done=False)  # a shorter history still gives its last message
    assert json.loads(tr.link_next_state(s, msgs(("user", "hi"))).messages) == [{"role": "user", "content": "hi"}]


def test_session_id_validation_and_derivation():
    assert validate_session_id("abc-123_x.y:z@w") == "abc-123_x.y:z@w"
    for bad in ["", "a" * 129, "has space", "semi;colon", "ünï"]:
        with pytest.raises(BadSessionError):
            validate_session_id(bad)
    m1 = msgs(("system", "s"), ("user", "u"))
    m2 = m1 + msgs(("assistant", "a"), ("user", "next"))
    assert derive_session_id("ns", m1) == derive_session_id("ns", m2)  # same conversation
    assert derive_session_id("ns", m1) != derive_session_id("other", m1)
    assert validate_session_id(derive_session_id("ns", m1))
    # Pinned: a derived id must not change across versions (a conversation that continues after an
    # upgrade keeps its session). sha256 of '["ns", null, "s", "u"]' (json.dumps, sort_keys, ASCII):
    assert derive_session_id("ns", m1) == "auto-829f743b500215853aab"
    # what an agent changes on every request does not split the conversation: dates, times, weekdays
    day1 = msgs(("system", "You are Claw. Today is Tuesday, December 1, 2026, 23:59 UTC."), ("user", "u"))
    day2 = msgs(("system", "You are Claw. Today is Wednesday, December 2, 2026, 00:01 UTC."), ("user", "u"))
    other = msgs(("system", "You are Paw. Today is Tuesday, December 1, 2026, 23:59 UTC."), ("user", "u"))
    assert derive_session_id("ns", day1) == derive_session_id("ns", day2) != derive_session_id("ns", other)


def test_an_id_in_openai_fields_names_the_session():
    assert explicit_session_id("oc-session-7", "alice", {"session_id": "m"}) == "oc-session-7"  # the first set
    assert explicit_session_id(None, "alice", {"session_id": "m"}) == "alice"
    assert explicit_session_id("", None, {"session_id": "m"}) == "m"
    assert explicit_session_id(None, None, {"other": 1}) is None and explicit_session_id(None, None, None) is None
    # a value that is not a valid id (a slash, a space) becomes a stable hash of it, never a 400
    hashed = explicit_session_id("agent:main/telegram chat 42", None, None)
    assert hashed == explicit_session_id("agent:main/telegram chat 42", None, None) != explicit_session_id("x y", None, None)
    assert hashed.startswith("key-") and validate_session_id(hashed)


def test_a_compacted_conversation_is_found_by_its_last_answer():
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    first = msgs(("system", "s"), ("user", "plan my week"))
    sid = tr.find("ns", first)
    state, _ = tr.open("ns", sid)
    tr.finish_turn(state, "t0", 0, first, {"role": "assistant", "content": "Monday: gym."}, main=True, done=False)
    # the agent compacted: a summary replaces the opening, the last exchange is kept
    compacted = msgs(("system", "s"), ("user", "Summary of the earlier conversation: ..."),
                     ("user", "plan my week"), ("assistant", "Monday: gym."), ("user", "and Tuesday?"))
    assert derive_session_id("ns", compacted) != sid and tr.find("ns", compacted) == sid
    # another conversation whose answer differs does not land there; nor does another namespace
    assert tr.find("ns", compacted[:3] + msgs(("assistant", "Rest."), ("user", "ok"))) != sid
    assert tr.find("other", compacted) != sid


def test_a_request_continues_the_answer_even_after_per_request_context():
    """OpenClaw appends its internal-context block as a last user message to each request; the next
    request's history no longer has it, so the answer is found by the message before it too."""
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    block = ("user", "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> none <<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
    first = msgs(("system", "s"), ("user", "hello"), block)
    sid = tr.find("ns", first)
    state, _ = tr.open("ns", sid)
    tr.finish_turn(state, "t0", 0, first, {"role": "assistant", "content": "Hi!"}, main=True, done=False)
    compacted = msgs(("system", "s2"), ("user", "hello"), ("assistant", "Hi!"), ("user", "and now?"), block)
    assert derive_session_id("ns", compacted) != sid and tr.find("ns", compacted) == sid
    # a tool result asked for the answer: found by it
    state2, _ = tr.open("ns", "x")
    with_tool = msgs(("system", "s"), ("user", "list"), ("assistant", "calling ls"), ("tool", "a.txt"), block)
    tr.finish_turn(state2, "t1", 0, with_tool, {"role": "assistant", "content": "One file."}, main=True, done=False)
    later = msgs(("system", "other"), ("tool", "a.txt"), ("assistant", "One file."), ("user", "thanks"))
    assert tr.find("ns", later) == "x"
    assert tr.find("ns", msgs(("system", "other"), ("tool", "b.txt"), ("assistant", "One file."))) != "x"


def test_an_agent_boundary_suffix_on_prompt_cache_key_is_left_out():
    """OpenClaw's prompt_cache_key is '<session>:<compactions>' (its summariser's the bare session)."""
    assert [explicit_session_id(k, None, None) for k in ("s1:0", "s1:12", "s1", "a:b:3")] == \
        ["s1", "s1", "s1", "a:b"]
    assert explicit_session_id(":7", None, None) == ":7"  # nothing left: the key as sent
    assert explicit_session_id(None, "alice:2", None) == "alice:2"  # only prompt_cache_key


def test_an_answer_kept_after_a_summary_finds_its_session():
    """An agent that compacts puts its summary where the message that asked for the kept answer was:
    a long enough answer is found on its own, a short one is not (it would match any conversation)."""
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    first = msgs(("system", "s"), ("user", "plan my week"))
    state, _ = tr.open("ns", tr.find("ns", first))
    answer = "Monday: gym. Tuesday: groceries and the dentist."
    tr.finish_turn(state, "t0", 0, first, {"role": "assistant", "content": answer}, main=True, done=False)
    compacted = msgs(("system", "s"), ("user", "Summary: the user plans a week."), ("assistant", answer),
                     ("user", "and Wednesday?"))
    assert tr.find("ns", compacted) == state.session_id and tr.find("other", compacted) != state.session_id
    short = SessionTracker(idle_timeout_s=60, max_sessions=10)
    st, _ = short.open("ns", "a")
    short.finish_turn(st, "t0", 0, first, {"role": "assistant", "content": "Monday: gym."}, main=True, done=False)
    assert short.find("ns", msgs(("system", "s"), ("user", "Summary"), ("assistant", "Monday: gym."),
                                 ("user", "ok"))) != "a"


def test_a_summariser_call_and_the_compacted_conversation_find_the_session_they_quote():
    """Without a session id: the summariser's request quotes the conversation's answers, so it lands
    in that session (as its side turn); its summary, quoted by the request after the compaction, puts
    that request there too."""
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    opening = msgs(("system", "s"), ("user", "hello"))
    state, _ = tr.open("ns", tr.find("ns", opening))
    sid, answer = state.session_id, "Hello! I can list files and keep notes for you."
    tr.finish_turn(state, "t0", 0, opening, {"role": "assistant", "content": answer}, main=True, done=False)
    tr.open("ns", "someone-else")  # a more recent session that is not quoted
    summarise = msgs(("system", "You summarise."), ("user", f"<conversation>\n[User]: hello\n\n[Assistant]: {answer}\n"
                                                            "</conversation>\nSummarise the messages above."))
    assert tr.find("ns", summarise) != sid  # only an agent's own (maintenance) call is searched for quotes
    assert tr.find("ns", summarise, maintenance=True) == sid
    summary = "The user said hello; the assistant offered to list files."
    tr.finish_turn(state, "t1", 1, summarise, {"role": "assistant", "content": summary}, main=False, done=False)
    after = msgs(("system", "s"), ("user", f"The conversation so far was compacted:\n<summary>\n{summary}\n</summary>"),
                 ("user", "what can you do?"))
    assert derive_session_id("ns", after) != sid and tr.find("ns", after) == sid
    assert tr.find("other-namespace", after) != sid


def test_a_summary_of_a_split_turn_quoting_only_the_users_message_finds_its_session():
    """OpenClaw compacting after a long answer keeps that answer and summarises the first part of its
    turn: the summariser quotes only the user's message, without the envelope OpenClaw sent it in (a
    bracketed date, runtime lines after it). It lands in the session that message asked in, and so
    does the request after the compaction, which quotes its summary."""
    tr = SessionTracker(idle_timeout_s=60, max_sessions=10)
    block = ("user", "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> none <<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
    ask = "Please tell me a long story about the sea."
    opening = msgs(("system", "s"), ("user", f"[Sun 2026-12-06 20:26 UTC] {ask}\n\nRuntime: agent=main | session=s1"),
                   block)
    state, _ = tr.open("ns", tr.find("ns", opening))
    sid = state.session_id
    tr.finish_turn(state, "t0", 0, opening, {"role": "assistant", "content": "The old boat left at dawn. " * 20},
                   main=True, done=False)
    other = msgs(("system", "s"), ("user", "[Sun 2026-12-06 20:27 UTC] Please list the files in my workspace."))
    st_other, _ = tr.open("ns", tr.find("ns", other))  # a more recent session whose user asked something else
    tr.finish_turn(st_other, "u0", 0, other, {"role": "assistant", "content": "Two files: a.txt and b.txt."},
                   main=True, done=False)
    prefix = msgs(("system", "You are a context summarization assistant."),
                  ("user", f"<conversation>\n[User]: {ask}\n</conversation>\n\nThis is the PREFIX of a turn that "
                           "was too large to keep. The SUFFIX (recent work) is retained."))
    assert tr.find("ns", prefix) != sid  # only an agent's own (maintenance) call is searched for quotes
    assert tr.find("ns", prefix, maintenance=True) == sid and tr.find("other", prefix, maintenance=True) != sid
    summary = "Summary of the turn so far: the user asked for a long story about the sea."
    tr.finish_turn(state, "t1", 1, prefix, {"role": "assistant", "content": summary}, main=False, done=False)
    after = msgs(("system", "s"), ("user", f"The conversation history before this point was compacted:\n{summary}"),
                 ("user", "[Sun 2026-12-06 20:28 UTC] Thanks. What did we talk about?"))
    assert tr.find("ns", after) == sid
    # a quoted answer tells sessions apart before a quoted question: the more recent session's user asked
    # the same, the answer quoted is this session's
    st_other.asked.append(ask)
    quoting_answer = msgs(("system", "You are a context summarization assistant."),
                          ("user", f"[User]: {ask}\n[Assistant]: {'The old boat left at dawn. ' * 20}"))
    assert tr.find("ns", quoting_answer, maintenance=True) == sid
    # a message too short to tell conversations apart is not remembered
    short = SessionTracker(idle_timeout_s=60, max_sessions=10)
    st, _ = short.open("ns", "a")
    short.finish_turn(st, "t0", 0, msgs(("user", "[Sun 09:00] Tell me a story.")),
                      {"role": "assistant", "content": "Once upon a time, far away."}, main=True, done=False)
    assert short.find("ns", msgs(("system", "You summarise."), ("user", "[User]: Tell me a story.")),
                      maintenance=True) != "a"
