"""Chat completions with n > 1 choices through the real openai SDK, over real HTTP, on the tiny engine:
each choice a sample of its own, every choice a turn in the log, choice 0 the one that waits for
the session's next state."""

import json
from collections import defaultdict

import httpx
import openai
import pytest
from openai import OpenAI

from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.scripted_engine import ScriptedEngine

ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name three colours"}]


def query(s, sql):
    return run_query(s.storage.data_root, sql).to_pylist()


def session_turns(s, session_id):
    return query(s, f"select * from turns where session_id = '{session_id}' order by turn_index")


def ask(client, session_id, n, messages=ASK, **kw):
    return client.chat.completions.create(model="m", messages=messages, n=n, seed=11, temperature=1.0, max_tokens=8,
                                          extra_body={"session_id": session_id}, **kw)


def test_n_choices_are_samples_of_their_own_each_logged(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        first = ask(client, "n-a", 3, logprobs=True)
        again = ask(client, "n-b", 3)
        single = ask(client, "n-c", 1)
        store.flush()
        rows = session_turns(s, "n-a")
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # temperature 1, seeds 11, 12, 13: different samples
    assert [c.message.content for c in again.choices] == texts  # the same seed reproduces every choice
    assert single.choices[0].message.content == texts[0]  # choice 0 is what n = 1 answers
    # the log: one turn per choice, choice 0 the request's own (main), the others side turns after it
    assert [(r["turn_index"], r["turn_type"]) for r in rows] == [(0, "main"), (1, "side"), (2, "side")]
    assert len({r["turn_id"] for r in rows}) == 3
    assert [r["text"] for r in rows] == texts
    assert [r["finish_reason"] for r in rows] == [c.finish_reason for c in first.choices]
    assert [json.loads(r["request_params"])["sampling_seed"] for r in rows] == [11, 12, 13]
    assert {json.loads(r["request_params"])["n"] for r in rows} == {3}
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"] == rows[2]["prompt_ids"]
    for r, c in zip(rows, first.choices):  # each choice's own tokens and log-probs
        assert len(r["output_ids"]) == len(r["rollout_logprobs"])
        shown = [t.logprob for t in c.logprobs.content]
        assert shown == pytest.approx(r["rollout_logprobs"][:len(shown)], abs=1e-9)
    # usage: the prompt once, the completions summed
    assert first.usage.prompt_tokens == len(rows[0]["prompt_ids"])
    assert first.usage.completion_tokens == sum(len(r["output_ids"]) for r in rows)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.model_extra["turn_index"] == 0


def test_streamed_choices_carry_their_index_and_match_the_non_streamed_ones(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        whole = ask(client, "s-a", 2)
        chunks = list(ask(client, "s-b", 2, stream=True, stream_options={"include_usage": True}))
        store.flush()
        rows = session_turns(s, "s-b")
    text, finishes, roles = defaultdict(str), defaultdict(list), defaultdict(int)
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(c.choices) <= 1 for c in chunks)  # one choice per chunk, as OpenAI streams them
    assert sorted(text) == [0, 1] and dict(roles) == {0: 1, 1: 1}
    assert [text[0], text[1]] == [c.message.content for c in whole.choices]
    assert [finishes[0], finishes[1]] == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [(r["turn_index"], r["turn_type"], r["text"]) for r in rows] == [
        (0, "main", text[0]), (1, "side", text[1])]


def test_n_is_capped_by_max_n(gateway, monkeypatch):
    monkeypatch.setattr("clawrl.gateway.service.MAX_N", 4)
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "cap", 5)
        assert e.value.status_code == 400 and e.value.body["param"] == "n"
        assert "from 1 to 4" in e.value.body["message"] and "got 5" in e.value.body["message"]
        zero = httpx.post(gw.base_url + "/chat/completions", json={"model": "m", "messages": ASK, "n": 0})
        assert zero.status_code == 400 and zero.json()["error"]["param"] == "n"
        assert len(ask(client, "cap", 4).choices) == 4  # at the cap: served
        store.flush()
        assert [r["turn_index"] for r in session_turns(s, "cap")] == [0, 1, 2, 3]  # the refusals took none


def test_the_next_request_links_to_the_choice_it_continues(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        for sid, go_on in (("go-0", 0), ("go-1", 1)):
            r = ask(client, sid, 3)
            assert r.choices[0].message.content != r.choices[go_on].message.content or go_on == 0
            more = [*ASK, {"role": "assistant", "content": r.choices[go_on].message.content},
                    {"role": "user", "content": "and three more"}]
            nxt = client.chat.completions.create(model="m", messages=more, max_tokens=4,
                                                 extra_body={"session_id": sid, "session_done": True})
            assert nxt.model_extra["turn_index"] == 3  # after the three choices
        store.flush()
        links = {sid: query(s, f"select n.*, t.turn_type from next_states n join turns t using (turn_id) "
                               f"where n.session_id = '{sid}' order by n.turn_index")
                 for sid in ("go-0", "go-1")}
        main_ids = {sid: session_turns(s, sid)[0]["turn_id"] for sid in ("go-0", "go-1")}
    # continuing choice 0: its next state is the user's reply
    assert [(n["turn_index"], n["has_next_state"], n["reason"]) for n in links["go-0"]] == [
        (0, True, "next_request"), (3, False, "session_done")]
    assert links["go-0"][0]["turn_id"] == main_ids["go-0"]
    assert json.loads(links["go-0"][0]["messages"]) == [{"role": "user", "content": "and three more"}]
    # continuing choice 1: choice 0 gets no next state (the reply answers another text); side turns none
    assert [(n["turn_index"], n["has_next_state"], n["reason"], n["turn_type"]) for n in links["go-1"]] == [
        (0, False, "other_choice_continued", "main"), (3, False, "session_done", "main")]


def test_tool_calls_are_parsed_per_choice(gateway, tiny_engine):
    """Scripted texts (tests/utils/scripted_engine.py), one per choice in order; real log-probs."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    scripted = ScriptedEngine(tiny_engine, tiny_engine.tokenizer)
    scripted.script.extend([call, "It is sunny.", call, "It is sunny."])
    s, store, ctx = gateway(engine=scripted)
    weather = [{"role": "user", "content": "weather in Oslo?"}]
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        whole = ask(client, "tools-a", 2, messages=weather, tools=tools)
        chunks = list(ask(client, "tools-b", 2, messages=weather, tools=tools, stream=True))
        store.flush()
        rows = session_turns(s, "tools-a")
    first, second = whole.choices
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert second.finish_reason == "stop" and second.message.content == "It is sunny."
    assert second.message.tool_calls is None
    assert [json.loads(r["tool_calls"] or "null") is not None for r in rows] == [True, False]
    finals = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finals[0].finish_reason == "tool_calls" and finals[0].delta.tool_calls[0].function.name == "get_weather"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == 1)
    assert finals[1].finish_reason == "stop" and streamed == "It is sunny."
    assert not any(c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].index == 0)


class FullDisk:
    """A data store whose appends fail while ``full`` (ENOSPC), as a full disk makes them."""

    def __init__(self, store):
        self.store, self.full = store, True

    def __getattr__(self, name):
        return getattr(self.store, name)

    def append(self, records):
        if self.full:
            raise OSError(28, "No space left on device")
        return self.store.append(records)


def test_the_choices_are_recorded_all_or_none_before_the_answer(gateway_settings, tiny_engine):
    s = gateway_settings()
    disk = FullDisk(DataStore(s.storage.data_root))
    app = create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=disk)
    with running_gateway(app) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, "full", 3)
        assert e.value.status_code == 507
        events = list(ask(client, "full", 2, stream=True).response.iter_lines())
        assert any('"type":"storage_error"' in line for line in events) and not any('"finish_reason":"' in x for x in events)
        disk.full = False
        r = ask(client, "full", 3)
        disk.store.flush()
        rows = session_turns(s, "full")
    assert r.model_extra["turn_index"] == 0  # the refused requests took no index
    assert [(x["turn_index"], x["text"]) for x in rows] == [(i, c.message.content) for i, c in enumerate(r.choices)]


def test_a_restarted_gateway_still_tells_which_choice_the_reply_continues(gateway_settings, tiny_engine):
    """Served by one gateway, continued through the next one on the same data root: the choices'
    answers come back from the log, so a reply to choice 1 still closes choice 0 without a next state."""
    s = gateway_settings()
    answers = {}
    for run in ("before", "after"):  # two gateway lifetimes, one data root
        store = DataStore(s.storage.data_root)
        with running_gateway(create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x")
            if run == "before":
                for sid in ("restart-0", "restart-1"):
                    answers[sid] = [c.message.content for c in ask(client, sid, 3).choices]
                assert answers["restart-1"][1] != answers["restart-1"][0]
            else:
                for sid, go_on in (("restart-0", 0), ("restart-1", 1)):
                    more = [*ASK, {"role": "assistant", "content": answers[sid][go_on]},
                            {"role": "user", "content": "and three more"}]
                    nxt = client.chat.completions.create(model="m", messages=more, max_tokens=4,
                                                         extra_body={"session_id": sid, "session_done": True})
                    assert nxt.model_extra["turn_index"] == 3
        store.close()
    links = {sid: [(n["turn_index"], n["has_next_state"], n["reason"]) for n in query(
        s, f"select * from next_states where session_id = '{sid}' order by turn_index")]
        for sid in ("restart-0", "restart-1")}
    assert links == {"restart-0": [(0, True, "next_request"), (3, False, "session_done")],
                     "restart-1": [(0, False, "other_choice_continued"), (3, False, "session_done")]}
