"""OpenAI's legacy completions through the real openai SDK, over real HTTP, with the real tiny engine."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.storage.catalog import run_query


def rows(s, sql):
    return run_query(s.storage.data_root, sql).to_pylist()


def test_a_completion_is_a_side_turn_with_the_prompts_own_tokens(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        raw = OpenAI(base_url=gw.base_url, api_key="x").completions.with_raw_response.create(
            model="clawrl-policy", prompt="Once upon a time", max_tokens=5, temperature=0.7, seed=3, logprobs=2,
            stop=["\n\n"])
        resp = raw.parse()
    store.flush()
    [row] = rows(s, "select * from turns")
    [choice] = resp.choices
    assert resp.object == "text_completion" and raw.headers["x-turn-type"] == "side" and row["turn_type"] == "side"
    assert row["prompt_ids"] == tiny_engine.tokenizer("Once upon a time")["input_ids"]  # no chat template
    assert choice.text == row["text"] and choice.finish_reason == row["finish_reason"]
    params = json.loads(row["request_params"])
    assert params["api"] == "completions" and params["stop"] == ["\n\n"] and params["sampling_seed"] == 3
    assert json.loads(row["request_messages"]) == [{"role": "user", "content": "Once upon a time"}]
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n in (len(row["output_ids"]), len(row["output_ids"]) - 1)  # an EOS is recorded, not shown
    assert lp.token_logprobs == pytest.approx(row["rollout_logprobs"][:n], abs=1e-9)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # each token's text starts where the previous one's ends
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert resp.usage.prompt_tokens == len(row["prompt_ids"]) and resp.usage.completion_tokens == len(row["output_ids"])


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(gateway, tiny_engine):
    """How harnesses score a continuation: the prompt's tokens come back with their log-probs (the
    first has none), equal to a teacher-forced rescoring of the prompt."""
    s, store, ctx = gateway()
    prompt = "The capital of France is Paris"
    ids = tiny_engine.tokenizer(prompt)["input_ids"]
    with ctx as gw:
        resp = OpenAI(base_url=gw.base_url, api_key="x").completions.create(
            model="m", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
        scored = gw.call(tiny_engine.generate(GenerateRequest(
            input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)))
    [choice] = resp.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and lp.tokens[0] is not None and lp.token_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == prompt and lp.text_offset[len(ids)] == len(prompt)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(scored.input_logprobs[1:], abs=1e-4)
    assert lp.top_logprobs[0] is None and all(len(top) == 1 for top in lp.top_logprobs[1:])


def test_a_list_of_prompts_is_one_turn_each_and_token_ids_are_kept(gateway, tiny_engine):
    s, store, ctx = gateway()
    ids = tiny_engine.tokenizer("count: one two")["input_ids"]
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        many = client.completions.create(model="m", prompt=["red green", "one two three"], max_tokens=3, n=2, seed=1)
        by_ids = client.completions.create(model="m", prompt=ids, max_tokens=3)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    store.flush()
    turns = rows(s, "select * from turns order by created_at")
    assert sorted(json.loads(t["request_messages"])[0]["content"] for t in turns[:4]) == [
        "one two three", "one two three", "red green", "red green"]
    assert {t["turn_type"] for t in turns} == {"side"}
    assert sorted(c.text for c in many.choices) == sorted(t["text"] for t in turns[:4])
    assert many.usage.completion_tokens == sum(len(t["output_ids"]) for t in turns[:4])
    assert turns[4]["prompt_ids"] == ids and by_ids.choices[0].text == turns[4]["text"]


def test_a_completion_named_main_in_a_session_links_its_next_state(gateway, tiny_engine):
    s, store, ctx = gateway()
    headers = {"X-Session-Id": "harness-1", "X-Turn-Type": "main"}
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        first = client.completions.create(model="m", prompt="Q: 2+2?\nA:", max_tokens=3, extra_headers=headers)
        client.completions.create(model="m", prompt="Q: 3+3?\nA:", max_tokens=3, extra_headers=headers)
    assert first.model_extra["session_id"] == "harness-1" and first.model_extra["turn_type"] == "main"
    store.flush()
    t0, t1 = rows(s, "select * from turns where session_id = 'harness-1' order by turn_index")
    assert (t0["turn_type"], t1["turn_index"]) == ("main", 1)
    [ns] = rows(s, f"select * from next_states where turn_id = '{t0['turn_id']}'")
    assert json.loads(ns["messages"]) == [{"role": "user", "content": "Q: 3+3?\nA:"}]  # the next prompt


def test_a_streamed_completion_sends_the_recorded_text_and_logprobs(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        chunks = list(client.completions.create(model="m", prompt="Hello", max_tokens=8, stream=True, logprobs=0,
                                                extra_body={"session_id": "stream-c"}))
        echoed = list(client.completions.create(model="m", prompt="Hello", max_tokens=4, stream=True, echo=True,
                                                extra_body={"session_id": "stream-e"}))
    store.flush()
    [row] = rows(s, "select * from turns where session_id = 'stream-c'")
    [echo_row] = rows(s, "select * from turns where session_id = 'stream-e'")
    assert "".join(c.choices[0].text for c in chunks) == row["text"]
    assert chunks[-1].choices[0].finish_reason == row["finish_reason"]
    lps = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(row["rollout_logprobs"][:len(lps)], abs=1e-9) and len(lps) >= len(row["output_ids"]) - 1
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert chunks[-1].model_extra["turn_index"] == 0 and chunks[-1].model_extra["weight_version"] == "0"
    assert "".join(c.choices[0].text for c in echoed) == "Hello" + echo_row["text"]


def test_completion_refusals_name_the_field(gateway, tiny_engine):
    s, store, ctx = gateway()
    with ctx as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        refusals = {}
        for name, kw in {"stream_list": {"prompt": ["a", "b"], "stream": True},
                         "stream_echo_logprobs": {"prompt": "a", "stream": True, "echo": True, "logprobs": 1},
                         "bad_id": {"prompt": [0, 10**9]}, "empty": {"prompt": ""},
                         "too_long": {"prompt": "hi", "max_tokens": 10**7}}.items():
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="m", **kw)
            refusals[name] = e.value.body
    assert refusals["stream_list"]["param"] == refusals["stream_echo_logprobs"]["param"] == "stream"
    assert refusals["bad_id"]["param"] == refusals["empty"]["param"] == "prompt"
    assert refusals["too_long"]["code"] == "context_length_exceeded" and refusals["too_long"]["param"] == "prompt"
    store.flush()
    assert rows(s, "select count(*) n from turns")[0]["n"] == 0
