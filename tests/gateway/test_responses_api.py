"""OpenAI's Responses API through the real openai SDK, over real HTTP, with the real tiny engine (a
scripted engine where the model must call a tool: its text is scripted, its log-probs real)."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from openai import OpenAI

from clawrl.engine.types import EngineUnreachableError
from clawrl.storage.catalog import run_query
from tests.utils.scripted_engine import ScriptedEngine

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": False,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def rows(s, sql):
    return run_query(s.storage.data_root, sql).to_pylist()


def test_string_input_with_instructions_is_a_recorded_turn_with_exact_logprobs(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        raw = OpenAI(base_url=gw.base_url, api_key="x").responses.with_raw_response.create(
            model="clawrl-policy", input="Hello there", instructions="Answer briefly.", max_output_tokens=6,
            temperature=0.8, top_p=0.9, top_logprobs=2, metadata={"app": "test"}, user="alice",
            extra_headers={"X-Session-Id": "resp-1"})
        resp = raw.parse()
    store.flush()
    [row] = rows(s, "select * from turns")
    assert raw.headers["x-session-id"] == "resp-1" and raw.headers["x-turn-type"] == "main"
    assert resp.id == f"resp_{row['turn_id']}" and resp.object == "response"
    assert resp.model == "clawrl-policy" and resp.instructions == "Answer briefly." and resp.metadata == {"app": "test"}
    assert resp.temperature == pytest.approx(0.8) and resp.top_p == pytest.approx(0.9) and resp.max_output_tokens == 6
    assert resp.model_extra["session_id"] == "resp-1" and resp.model_extra["turn_index"] == 0
    # the instructions are the system message in front of the input, rendered by the chat template
    assert json.loads(row["request_messages"]) == [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": "Hello there"}]
    expected = tiny_engine.tokenizer.apply_chat_template(json.loads(row["request_messages"]), add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
    assert row["prompt_ids"] == list(expected)
    assert json.loads(row["request_params"])["api"] == "responses"
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and resp.output_text == row["text"]
    lps = message.content[0].logprobs
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    assert [lp.logprob for lp in lps] == pytest.approx(row["rollout_logprobs"][:len(lps)], abs=1e-9)
    assert resp.usage.input_tokens == len(row["prompt_ids"]) and resp.usage.output_tokens == len(row["output_ids"])
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # six tokens without a stop: OpenAI's incomplete status and reason; with an EOS among them, completed
    if row["finish_reason"] == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_function_call_and_its_output_round_trip_as_one_session(gateway, tiny_engine):
    """The model calls a function (function_call item); the client runs it and sends the whole input
    back with the function_call_output: one session (prompt_cache_key), the tool output is the call's
    next state, and non-function tools are left out of the prompt (said once in the log)."""
    scripted = ScriptedEngine(tiny_engine, tiny_engine.tokenizer)
    scripted.script.extend([CALL, "It is sunny in Paris."])
    s, store, ctx = gateway(engine=scripted)
    tools = [WEATHER, {"type": "web_search"}]
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        first = client.responses.create(model="m", input=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=tools, tool_choice="auto", prompt_cache_key="conv-7", store=False)
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
            "city": "Paris"} and call.call_id.startswith("call_")
        second = client.responses.create(model="m", tools=tools, prompt_cache_key="conv-7", store=False, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert second.output_text == "It is sunny in Paris."
    store.flush()
    turns = rows(s, "select * from turns order by turn_index")
    assert [(t["session_id"], t["turn_index"], t["turn_type"]) for t in turns] == [("conv-7", 0, "main"),
                                                                                   ("conv-7", 1, "main")]
    assert [t["function"]["name"] for t in json.loads(turns[0]["request_tools"])] == ["get_weather"]  # no web_search
    assert json.loads(turns[1]["request_messages"])[1:] == [
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": call.call_id}]
    [ns] = rows(s, "select * from next_states")
    assert ns["turn_id"] == turns[0]["turn_id"] and ns["reason"] == "next_request"
    assert json.loads(ns["messages"]) == [{"role": "tool", "content": "sunny, 24 C", "tool_call_id": call.call_id}]


def test_previous_response_id_continues_the_logged_conversation(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        first = client.responses.create(model="m", input="My name is Ada.", instructions="Be kind.", max_output_tokens=4)
        second = client.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                         instructions="Be brief.", max_output_tokens=4)
        not_stored = client.responses.create(model="m", input="x", store=False, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", input="y", previous_response_id=not_stored.id)
        with pytest.raises(openai.BadRequestError) as unknown:
            client.responses.create(model="m", input="y", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    assert unknown.value.body["code"] == "previous_response_not_found"
    assert second.previous_response_id == first.id
    store.flush()
    t0, t1 = rows(s, f"select * from turns where session_id = '{first.model_extra['session_id']}' order by turn_index")
    # the first response's messages and answer, its instructions replaced by the new ones (OpenAI's rule)
    assert json.loads(t1["request_messages"]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": t0["text"]}, {"role": "user", "content": "What is my name?"}]
    assert second.model_extra["session_id"] == first.model_extra["session_id"] and t1["turn_index"] == 1
    [ns] = rows(s, f"select * from next_states where turn_id = '{t0['turn_id']}'")
    assert json.loads(ns["messages"]) == [{"role": "user", "content": "What is my name?"}]


def test_streamed_response_events_follow_openais_sequence(gateway, tiny_engine):
    """The raw events (create(stream=True)) and the SDK's own accumulator (responses.stream) agree
    with the recorded turn; a streamed function call arrives as argument deltas and an item."""
    scripted = ScriptedEngine(tiny_engine, tiny_engine.tokenizer)
    scripted.script.extend(["Let me check. " + CALL])
    s, store, ctx = gateway(engine=scripted)
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        with client.responses.stream(model="m", input="Weather in Paris?", tools=[WEATHER],
                                     prompt_cache_key="st-tools") as stream:  # the scripted answer
            helper_events = [e.type for e in stream]
            final = stream.get_final_response()
        events = list(client.responses.create(model="m", input="Tell me a story", max_output_tokens=12, stream=True,
                                              include=["message.output_text.logprobs"], prompt_cache_key="st"))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert types.index("response.output_item.added") < types.index("response.content_part.added") < types.index(
        "response.output_text.delta") < types.index("response.output_text.done") < types.index(
        "response.content_part.done") < types.index("response.output_item.done")
    assert "".join(d.delta for d in deltas) == done.text == events[-1].response.output_text
    store.flush()
    story = rows(s, "select * from turns where session_id = 'st'")[0]
    assert done.text == story["text"] and events[-1].response.id == f"resp_{story['turn_id']}"
    assert [lp.logprob for lp in done.logprobs] == pytest.approx(story["rollout_logprobs"][:len(done.logprobs)],
                                                                 abs=1e-9)
    assert events[-1].response.usage.output_tokens == len(story["output_ids"])
    # the function call: text first, then the call as its own output item with argument deltas
    assert helper_events[-1] == "response.completed" and "response.function_call_arguments.delta" in helper_events
    text, call = final.output
    assert text.content[0].text.strip() == "Let me check." and call.type == "function_call"
    assert json.loads(call.arguments) == {"city": "Paris"} and final.model_extra["turn_index"] == 0


def test_stream_error_is_a_failed_response_event(gateway, tiny_engine, monkeypatch):
    s, store, ctx = gateway()

    async def broken(req):
        raise EngineUnreachableError("engine went away")
        yield  # an async generator

    with ctx as gw:
        monkeypatch.setattr(tiny_engine, "generate_stream", broken)
        events = list(OpenAI(base_url=gw.base_url, api_key="x").responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.status == "failed" and "engine went away" in events[-1].response.error.message
    assert events[-1].response.error.code == "engine_unavailable"
    store.flush()
    assert rows(s, "select count(*) n from turns")[0]["n"] == 0


def test_refusals_are_openai_shaped(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError) as long:  # the prompt and the output asked for overflow the context
            client.responses.create(model="m", input="hi", max_output_tokens=10**7)
        with pytest.raises(openai.BadRequestError) as image:
            client.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
        with pytest.raises(openai.BadRequestError) as choice:
            client.responses.create(model="m", input="hi", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "nope"})
        with pytest.raises(openai.BadRequestError) as fmt:
            client.responses.create(model="m", input="hi", text={"format": {"type": "json_object"}})
    assert long.value.body["code"] == "context_length_exceeded" and long.value.body["param"] == "input"
    assert long.value.body["message"].startswith(f"This model's maximum context length is {tiny_engine.max_context_len} ")
    assert image.value.body["param"] == "input" and "input[0].content[0]" in image.value.body["message"]
    assert choice.value.body["param"] == "tool_choice" and "'nope'" in choice.value.body["message"]
    assert fmt.value.body["param"] == "text.format"
    store.flush()
    assert rows(s, "select count(*) n from turns")[0]["n"] == 0


def test_codex_maintenance_request_is_a_side_turn(gateway, tiny_engine):
    """Codex CLI names each request's kind in x-codex-turn-metadata: anything but a turn is its own upkeep."""
    s, store, ctx = gateway()
    meta = {"request_kind": "compaction", "turn_id": "t1"}
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        client.responses.create(model="m", input="hi", prompt_cache_key="thread-1", max_output_tokens=2,
                                extra_headers={"x-codex-turn-metadata": json.dumps({**meta, "request_kind": "turn"})})
        client.responses.create(model="m", input="summarise", prompt_cache_key="thread-1", max_output_tokens=2,
                                extra_headers={"x-codex-turn-metadata": json.dumps(meta)})
    store.flush()
    assert [(t["session_id"], t["turn_type"]) for t in rows(s, "select * from turns order by turn_index")] == [
        ("thread-1", "main"), ("thread-1", "side")]


def test_left_out_tool_types_are_logged_once(gateway, tiny_engine, caplog):
    from clawrl.gateway import responses

    responses._left_out.discard("namespace")
    s, store, ctx = gateway()
    with ctx as gw, caplog.at_level(logging.WARNING, logger="clawrl.gateway"):
        client = OpenAI(base_url=gw.base_url, api_key="x")
        for _ in range(2):
            client.responses.create(model="m", input="hi", max_output_tokens=2, tools=[
                WEATHER, {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": []}])
    said = [r.getMessage() for r in caplog.records if "'namespace'" in r.getMessage()]
    assert len(said) == 1 and "left out of the prompt" in said[0]


def test_user_metadata_and_a_named_tool_choice_as_in_chat(gateway, tiny_engine):
    """``user`` and ``metadata.session_id`` name the session as in a chat completion; a named
    function tool_choice reaches the template as the chat form does."""
    scripted = ScriptedEngine(tiny_engine, tiny_engine.tokenizer)
    scripted.script.extend([CALL])
    s, store, ctx = gateway(engine=scripted)
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        forced = client.responses.create(model="m", input="Paris?", tools=[WEATHER], user="bob",
                                         tool_choice={"type": "function", "name": "get_weather"})
        by_meta = client.responses.create(model="m", input="hi", max_output_tokens=2, metadata={"session_id": "m-1"})
    assert forced.model_extra["session_id"] == "bob" and by_meta.model_extra["session_id"] == "m-1"
    assert forced.tool_choice.name == "get_weather" and forced.output[0].type == "function_call"
    assert "You must call the function get_weather." in tiny_engine.tokenizer.decode(scripted.requests[0].input_ids)
