"""The gateway through the real openai SDK, over real HTTP, with the real tiny engine."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from clawrl.bench.gateway import gateway_own_s
from clawrl.gateway.routes import create_app
from clawrl.models import load_tokenizer
from clawrl.storage.catalog import run_query
from tests.utils.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def turns(s, where="true"):
    return run_query(s.storage.data_root, f"select * from turns where {where} order by created_at").to_pylist()


def test_plain_completion_with_logprobs_is_recorded_exactly(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="unused")
        raw = client.chat.completions.with_raw_response.create(
            model="clawrl-policy", messages=[{"role": "user", "content": "Hello there"}], logprobs=True,
            top_logprobs=2, max_tokens=8, seed=7, extra_headers={"X-Session-Id": "sess-1", "X-Turn-Type": "main"})
        resp = raw.parse()
    assert raw.headers["x-session-id"] == "sess-1" and raw.headers["x-weight-version"] == "0"
    assert resp.model_extra["session_id"] == "sess-1" and resp.model_extra["weight_version"] == "0"
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert resp.usage.completion_tokens >= len(content) >= resp.usage.completion_tokens - 1
    store.flush()
    [row] = turns(s)
    tok = load_tokenizer(s.storage.models_dir / "tiny-seed0-v1")
    expected_prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
    assert row["prompt_ids"] == list(expected_prompt)
    assert row["session_id"] == "sess-1" and row["turn_type"] == "main" and row["turn_index"] == 0
    assert len(row["output_ids"]) == len(row["rollout_logprobs"]) == resp.usage.completion_tokens
    # what the client saw is exactly what was recorded (the EOS, if any, is recorded but not shown)
    assert [c.logprob for c in content] == pytest.approx(row["rollout_logprobs"][: len(content)], abs=1e-9)
    assert row["text"] == choice.message.content
    assert row["weight_version"] == "0" and row["finish_reason"] == choice.finish_reason
    assert json.loads(row["request_messages"]) == [{"role": "user", "content": "Hello there"}]


def test_recorded_logprobs_match_a_teacher_forced_rescoring(gateway, tiny_engine):
    """The ids and log-probs in the log are the engine's own: rescoring prompt+output agrees."""
    from clawrl.engine.types import GenerateRequest, SamplingParams

    s, store, ctx = gateway()
    with ctx as gw:
        OpenAI(base_url=gw.base_url, api_key="x").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count to three"}], max_tokens=12, temperature=1.0)
        store.flush()
        [row] = turns(s)
        p = row["prompt_ids"]
        scored = gw.call(tiny_engine.generate(GenerateRequest(
            input_ids=p + row["output_ids"], sampling_params=SamplingParams(max_new_tokens=0),
            return_logprob=True, logprob_start_len=len(p) - 1)))
    assert scored.input_logprobs[1:] == pytest.approx(row["rollout_logprobs"], abs=1e-4)


def test_streaming_sends_incremental_chunks_and_usage(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "tell me a story"}], stream=True, max_tokens=16,
            logprobs=True, stream_options={"include_usage": True}, extra_body={"session_id": "stream-1"})
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # real incremental chunks, not one blob
    store.flush()
    [row] = turns(s)
    assert row["text"] == text and row["session_id"] == "stream-1"
    assert len(row["output_ids"]) == chunks[-1].usage.completion_tokens


def test_tool_call_round_trip_with_parallel_calls(gateway, tiny_engine):
    """Scripted model text (tests/utils/scripted_engine.py: a random model never writes a tool call);
    the log-probs are the real model's."""
    scripted = ScriptedEngine(tiny_engine, tiny_engine.tokenizer)
    scripted.script.extend([
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "Paris is 12C and Rome is 18C.",
    ])
    s, store, ctx = gateway(engine=scripted)
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        r1 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, extra_body={"session_id": "tools"})
        m = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
        assert [json.loads(tc.function.arguments)["city"] for tc in m.tool_calls] == ["Paris", "Rome"]
        msgs.append(m.model_dump(exclude_none=True))
        results = [{"role": "tool", "tool_call_id": tc.id, "content": t} for tc, t in zip(m.tool_calls, ["12C", "18C"])]
        msgs.extend(results)
        r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, extra_body={"session_id": "tools"})
        assert r2.choices[0].message.content == "Paris is 12C and Rome is 18C."
        store.flush()
    rows = turns(s)
    assert [r["turn_index"] for r in rows] == [0, 1]
    assert json.loads(rows[0]["tool_calls"])[1]["function"]["name"] == "get_weather"
    # the second prompt shows the first turn's calls in the model's own format, and both tool results
    prompt_text = tiny_engine.tokenizer.decode(rows[1]["prompt_ids"])
    assert prompt_text.count('<tool_call>\n{"name": "get_weather"') == 2 and "<tool_response>\n18C\n</tool_response>" in prompt_text
    [ns] = run_query(s.storage.data_root, "select * from next_states").to_pylist()
    assert ns["turn_id"] == rows[0]["turn_id"] and ns["has_next_state"]
    assert [m["content"] for m in json.loads(ns["messages"])] == ["12C", "18C"]  # every parallel result


def test_source_design_check_models_logprobs_and_sql(gateway):
    from typer.testing import CliRunner

    from clawrl.cli import app

    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        models = client.models.list()
        assert [m.id for m in models.data] == ["clawrl-policy"]
        r = client.chat.completions.create(model="clawrl-policy", messages=[{"role": "user", "content": "hi"}],
                                           logprobs=True, extra_headers={"X-Session-Id": "s", "X-Turn-Type": "main"})
        assert r.choices[0].logprobs.content
    store.close()  # flushes: what a separate `clawrl sql` process would then see
    out = CliRunner().invoke(app, ["sql", "select count(*) as n from turns", "--format", "csv"],
                             env={"CLAWRL__STORAGE__DATA_ROOT": str(s.storage.data_root)})
    assert out.exit_code == 0, out.output
    assert out.output.strip().splitlines()[-1] == "1"


def test_next_state_and_session_done_through_the_sdk(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
        r1 = client.chat.completions.create(model="m", messages=msgs, extra_body={"session_id": "chat"})
        # a side turn in between (a heartbeat) never becomes anyone's next state
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}],
                                       extra_body={"session_id": "chat", "turn_type": "side"})
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "no, answer in one word"}]
        client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Session-Done": "true"},
                                       extra_body={"session_id": "chat"})
        store.flush()
    rows = turns(s)
    assert [(r["turn_index"], r["turn_type"]) for r in rows] == [(0, "main"), (1, "side"), (2, "main")]
    ns = run_query(s.storage.data_root, "select * from next_states order by turn_index").to_pylist()
    assert [(n["turn_index"], n["has_next_state"], n["reason"]) for n in ns] == [
        (0, True, "next_request"), (2, False, "session_done")]
    assert json.loads(ns[0]["messages"]) == [{"role": "user", "content": "no, answer in one word"}]


def test_sessions_without_id_get_a_stable_derived_id(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        msgs = [{"role": "user", "content": "plan my trip"}]
        r1 = client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "thanks!"}]
        r2 = client.chat.completions.create(model="m", messages=msgs)
    sid = r1.model_extra["session_id"]
    assert sid.startswith("auto-") and r2.model_extra["session_id"] == sid
    assert r1.model_extra["turn_type"] == "main"  # generic clients produce training data


def test_an_agent_without_session_headers_keeps_one_session(gateway):
    """OpenClaw-shaped traffic: no session header; a system prompt that carries the time; a
    compaction that rewrites the history; the agent's own summariser call. One conversation stays
    one session, its next states link, and the summariser call is a side turn."""
    s, store, ctx = gateway(**{"ppo.temperature": 0.0})
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")

        def ask(messages, **kw):
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=6, **kw)
            return r, {"role": "assistant", "content": r.choices[0].message.content}

        def system(t):
            return {"role": "system", "content": f"You are Claw. Current time: 2026-12-01 {t} UTC."}

        # 1. prompt_cache_key names the session (an invalid id is hashed, never refused)
        r, _ = ask([system("10:00"), {"role": "user", "content": "hi"}], prompt_cache_key="agent:main/chat 1")
        assert r.model_extra["session_id"].startswith("key-")
        assert ask([{"role": "user", "content": "x"}], user="bob")[0].model_extra["session_id"] == "bob"
        # 2. derived: the time in the system prompt changes every request, the session does not
        history = [system("10:00"), {"role": "user", "content": "plan my week"}]
        r1, a1 = ask(history)
        history = [system("10:05"), *history[1:], a1, {"role": "user", "content": "and Tuesday?"}]
        r2, a2 = ask(history)
        sid = r1.model_extra["session_id"]
        assert sid.startswith("auto-") and r2.model_extra["session_id"] == sid
        # 3. the agent's summariser, quoting none of the conversation's answers: a side turn of a session of its own
        summary = [{"role": "system", "content": "You are a context summarization assistant. ..."},
                   {"role": "user", "content": "<conversation>...</conversation>\n\nThe messages above are a "
                                               "conversation to summarize. Create a structured checkpoint."}]
        rs, _ = ask(summary)
        assert rs.model_extra["turn_type"] == "side" and rs.model_extra["session_id"] != sid
        # 4. after compaction the opening is a summary; the last exchange continues the session
        compacted = [system("10:09"), {"role": "user", "content": "Summary: the user plans a week."},
                     history[3], a2, {"role": "user", "content": "thanks!"}]
        r3, _ = ask(compacted)
        assert r3.model_extra["session_id"] == sid and r3.model_extra["turn_type"] == "main"
    store.flush()
    rows = turns(s, f"session_id = '{sid}'")
    assert [(r["turn_index"], r["turn_type"]) for r in rows] == [(0, "main"), (1, "main"), (2, "main")]
    links = run_query(s.storage.data_root, f"select turn_index, reason, messages from next_states "
                                           f"where session_id = '{sid}' order by turn_index").to_pylist()
    assert [(n["turn_index"], n["reason"]) for n in links][:2] == [(0, "next_request"), (1, "next_request_realigned")]
    assert json.loads(links[1]["messages"]) == [{"role": "user", "content": "thanks!"}]


def test_errors_are_openai_shaped(gateway, monkeypatch):
    monkeypatch.setattr("clawrl.gateway.routes.MAX_BODY_BYTES", 2048)
    s, store, ctx = gateway()
    with ctx as gw:
        url = gw.base_url + "/chat/completions"
        bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
        missing = httpx.post(url, json={"model": "m"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        n0 = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0})
        assert n0.status_code == 400 and n0.json()["error"]["param"] == "n"
        bad_sid = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                             headers={"X-Session-Id": "bad id;"})
        assert bad_sid.status_code == 400 and bad_sid.json()["error"]["param"] == "session_id"
        big = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
        role = httpx.post(url, json={"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
        assert role.status_code == 400
        client = OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=9)
        assert e.value.body["param"] == "n" and "from 1 to 8" in e.value.body["message"]  # [server] max_n
        # still serving
        ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert ok.choices[0].message is not None
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'clawrl_requests_total{status="400",stream="false",turn_type="main"}' in metrics
        assert "clawrl_request_latency_seconds_bucket" in metrics and "clawrl_pending_turns" in metrics
        health = httpx.get(gw.url + "/healthz").json()
        assert health["status"] == "ok" and health["weight_version"] == "0"
        # the gauges are read at scrape time and agree with /healthz: two more main turns in new
        # sessions each leave one turn waiting for its next state; a side turn leaves none
        for sid, kind in (("g-a", "main"), ("g-b", "main"), ("g-c", "side")):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}], max_tokens=2,
                                           extra_headers={"X-Session-Id": sid, "X-Turn-Type": kind})
        health2 = httpx.get(gw.url + "/healthz").json()
        assert health2["pending_turns"] == health["pending_turns"] + 2
        assert health2["open_sessions"] == health["open_sessions"] + 3
        gauges = dict(line.split(" ") for line in httpx.get(gw.url + "/metrics").text.splitlines()
                      if line.startswith(("clawrl_pending_turns ", "clawrl_open_sessions ")))
        assert float(gauges["clawrl_pending_turns"]) == health2["pending_turns"]
        assert float(gauges["clawrl_open_sessions"]) == health2["open_sessions"]


def test_a_request_without_model_is_refused_as_openai_does(gateway):
    """Chat completions, Responses and legacy completions each need ``model``: a 400 naming it, with
    OpenAI's words and code, and nothing recorded. Sent through the openai SDK (``omit`` leaves the
    field out of the body)."""
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        calls = {"chat": lambda: client.chat.completions.create(model=openai.omit, messages=[{"role": "user",
                                                                                             "content": "hi"}]),
                 "responses": lambda: client.responses.create(model=openai.omit, input="hi"),
                 "completions": lambda: client.completions.create(model=openai.omit, prompt="hi")}
        for name, call in calls.items():
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.status_code == 400 and e.value.body == {
                "message": "Missing required parameter: 'model'.", "type": "invalid_request_error", "param": "model",
                "code": "missing_required_parameter"}, (name, e.value.body)
        # a value of the wrong type: OpenAI's invalid_type; an out-of-range one: invalid_value
        wrong = httpx.post(gw.base_url + "/chat/completions", json={"model": 5, "messages": []}).json()["error"]
        assert (wrong["param"], wrong["code"], wrong["message"]) == (
            "messages", "invalid_value", "messages: List should have at least 1 item after validation, not 0 "
                                         "(and 1 more)")
        typed = httpx.post(gw.base_url + "/chat/completions", json={"model": 5, "messages": [{"role": "user",
                                                                                               "content": "x"}]})
        assert typed.json()["error"] == {"message": "model: Input should be a valid string",
                                         "type": "invalid_request_error", "param": "model", "code": "invalid_type"}
    store.flush()
    assert turns(s) == []


def test_session_headers_are_read_and_documented(gateway):
    s, store, ctx = gateway()
    with ctx as gw:
        url = gw.base_url + "/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # the first of a repeated header counts; the turn type is read case-blind
        r = httpx.post(url, json=body, headers=[("X-Session-Id", "s-1"), ("X-Turn-Type", "Side"),
                                                ("X-Session-Id", "s-2")], timeout=60)
        assert r.status_code == 200 and r.headers["x-session-id"] == "s-1" and r.json()["turn_type"] == "side"
        bad = httpx.post(url, json=body, headers={"X-Session-Done": "maybe"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Session-Done"
        assert bad.json()["error"]["message"] == "X-Session-Done must be true or false, got 'maybe'"
        op = httpx.get(gw.url + "/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    headers = {p["name"]: p["schema"] for p in op["parameters"] if p["in"] == "header"}
    assert headers["X-Turn-Type"]["enum"] == ["main", "side"] and headers["X-Session-Id"]["pattern"].startswith("^[")
    assert "X-Session-Done" in headers
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_api_keys_and_namespaces(gateway, monkeypatch):
    monkeypatch.setenv("CLAWRL_API_KEYS", "key-alpha,key-beta")
    s, store, ctx = gateway(server__open_mode=False)
    with ctx as gw:
        anon = OpenAI(base_url=gw.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            anon.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        assert httpx.post(gw.base_url + "/chat/completions", json={"messages": []}).status_code == 401
        spec = httpx.get(gw.url + "/openapi.json").json()  # /docs offers to authorize with a bearer key
        assert spec["components"]["securitySchemes"]["apiKey"] == {
            "type": "http", "scheme": "bearer", "description": "An API key from the env var named by server.api_keys_env."}
        assert {p: [op.get("security") for op in ops.values()] for p, ops in spec["paths"].items()
                if p.startswith("/v1/")} == {"/v1/chat/completions": [[{"apiKey": []}]],
                                             "/v1/responses": [[{"apiKey": []}]],
                                             "/v1/completions": [[{"apiKey": []}]],
                                             "/v1/models": [[{"apiKey": []}]],
                                             "/v1/sessions/{session_id}": [[{"apiKey": []}]]}
        assert "security" not in spec["paths"]["/healthz"]["get"]
        for key in ("key-alpha", "key-beta"):
            OpenAI(base_url=gw.base_url, api_key=key).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={"session_id": "same"})
        store.flush()
    rows = turns(s)
    assert len({r["namespace"] for r in rows}) == 2  # same session id, two separate sessions
    assert [r["turn_index"] for r in rows] == [0, 0]
    assert all("key-alpha" not in r["namespace"] for r in rows)  # the key itself is never stored


def test_open_mode_must_be_explicit(gateway_settings, monkeypatch):
    from clawrl.config import ConfigError

    monkeypatch.delenv("CLAWRL_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="open_mode"):
        create_app(gateway_settings(server__open_mode=False))


def test_server_timing_splits_engine_and_gateway_time(gateway, tiny_engine):
    """A non-streamed completion says how long its engine call took and how long the gateway's own
    work did (W3C Server-Timing, ms); an engine that sleeps 1 s shows up in the engine part only (1 s, not
    less: on a busy machine the gateway's own few milliseconds grow many times over)."""
    class SlowEngine:
        def __getattr__(self, name):
            return getattr(tiny_engine, name)

        async def generate(self, req):
            await asyncio.sleep(1.0)  # a slow engine, on purpose
            return await tiny_engine.generate(req)

    s, store, ctx = gateway(engine=SlowEngine())
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="unused")
        t0 = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model="clawrl-policy", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4)
        elapsed_ms = 1000 * (time.perf_counter() - t0)
        raw.parse()
    metrics = {}
    for part in raw.headers["server-timing"].split(","):
        name, dur = part.strip().split(";")
        assert dur.startswith("dur=")
        metrics[name] = float(dur[4:])
    assert set(metrics) == {"gateway", "engine"}
    assert metrics["engine"] >= 1000.0 and metrics["gateway"] > 0.0
    assert metrics["gateway"] < 1000.0  # the sleep is not counted as the gateway's own time
    assert metrics["engine"] + metrics["gateway"] <= elapsed_ms


def test_server_timing_reader_of_the_bench():
    assert gateway_own_s("gateway;dur=0.612, engine;dur=66.801") == pytest.approx(0.000612)
    assert gateway_own_s('engine;dur=3, gateway;desc="own";dur=1.5') == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="no gateway;dur"):
        gateway_own_s("engine;dur=3")
