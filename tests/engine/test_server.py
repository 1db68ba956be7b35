"""The SGLang-compatible HTTP server over the real EmbeddedEngine (tiny model), over real HTTP.

Shapes are checked against SGLang 0.5.23's native API; where the embedded server
knowingly differs from real SGLang, the test says so.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest

from tests.utils.engine_server import CONTEXT, PROMPT, make_tiny_engine, running_engine_server, save_perturbed_copy
from tests.utils.fake_engine import FakeEngine
from tests.utils.gateway_process import ServerProcess, free_port
from tests.utils.waiting import join, wait_until

GREEDY8 = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from clawrl.models import load_tokenizer

    return load_tokenizer(tiny_dir)


def generate(http: httpx.Client, **body) -> dict:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(text: str) -> list:
    """The payloads of an SSE body, in order; '[DONE]' stays a string."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ------------------------------------------------------------------------------ /generate


def test_generate_returns_sglang_shape_with_aligned_logprobs(http):
    out = generate(http, input_ids=PROMPT, sampling_params=GREEDY8, return_logprob=True, top_logprobs_num=1,
                   rid="req-1")
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 8)
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 8}]
    triples = meta["output_token_logprobs"]
    assert meta["output_token_logprobs_length"] == 8
    assert [t[1] for t in triples] == out["output_ids"]  # entry i is the logprob of output_ids[i]
    assert all(t[2] is None for t in triples)  # texts only with return_text_in_logprobs
    assert all(t[0] <= 0 for t in triples)
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: no prompt logprobs
    # greedy: the sampled token is the top-1 alternative at every position, with the same logprob
    tops = meta["output_top_logprobs"]
    assert [row[0][1] for row in tops] == out["output_ids"]
    assert [row[0][0] for row in tops] == pytest.approx([t[0] for t in triples], abs=1e-6)


def test_text_prompt_fills_triple_texts_and_prompt_ids(http, tokenizer):
    out = generate(http, text="Hello there, engine", sampling_params={"max_new_tokens": 4, "temperature": 0},
                   return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True,
                   return_prompt_token_ids=True)
    meta = out["meta_info"]
    prompt_ids = out["prompt_token_ids"]
    assert meta["prompt_tokens"] == len(prompt_ids) > 0
    assert tokenizer.decode(prompt_ids) == "Hello there, engine"
    inp = meta["input_token_logprobs"]
    assert [t[1] for t in inp] == prompt_ids
    assert inp[0][0] is None  # SGLang: entry 0 never has a logprob
    assert [t[2] for t in inp] == [tokenizer.decode([t]) for t in prompt_ids]
    assert [t[2] for t in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in out["output_ids"]]


def test_prompt_scoring_with_zero_new_tokens_matches_generation_logprobs(http):
    gen = generate(http, input_ids=PROMPT, sampling_params=GREEDY8, return_logprob=True)
    response = gen["output_ids"]
    full = PROMPT + response
    scored = generate(http, input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                      logprob_start_len=0)
    meta = scored["meta_info"]
    assert (scored["text"], scored["output_ids"]) == ("", [])
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == []
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 0}]  # no output: an empty span
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(full) and inp[0][0] is None and [t[1] for t in inp] == full
    # greedy output logprobs are unscaled log_softmax, as are prompt logprobs: the last R agree
    gen_lps = [t[0] for t in gen["meta_info"]["output_token_logprobs"]]
    assert [t[0] for t in inp[-len(response):]] == pytest.approx(gen_lps, abs=1e-4)
    # the cheap variant: start at P-1 -> R+1 entries, entries 1..R are the response
    cheap = generate(http, input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                     logprob_start_len=len(PROMPT) - 1)["meta_info"]["input_token_logprobs"]
    assert len(cheap) == len(response) + 1 and cheap[0][0] is None
    assert [t[0] for t in cheap[1:]] == pytest.approx([t[0] for t in inp[-len(response):]], abs=1e-6)


def test_batch_generate_fans_out_and_equals_single_requests(http):
    other = [5, 6, 7]
    batch = http.post("/generate", json={"input_ids": [PROMPT, other],
                                         "sampling_params": [GREEDY8, {**GREEDY8, "max_new_tokens": 3}],
                                         "rid": ["a", "b"], "return_logprob": True})
    assert batch.status_code == 200, batch.text
    a, b = batch.json()
    assert (a["meta_info"]["id"], b["meta_info"]["id"]) == ("a", "b")
    assert len(a["output_ids"]) == 8 and len(b["output_ids"]) == 3
    assert a["output_ids"] == generate(http, input_ids=PROMPT, sampling_params=GREEDY8)["output_ids"]
    single_b = generate(http, input_ids=other, sampling_params={**GREEDY8, "max_new_tokens": 3}, return_logprob=True)
    assert b["output_ids"] == single_b["output_ids"]
    assert [t[0] for t in b["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in single_b["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_stream_sends_cumulative_events_then_done(http):
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY8, "return_logprob": True,
                                     "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    parts = events[:-1]
    assert len(parts) >= 2
    for prev, nxt in zip(parts, parts[1:]):  # cumulative: each event re-sends everything so far
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    final = parts[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(final["meta_info"]["output_token_logprobs"]) == 8
    assert final["output_ids"] == generate(http, input_ids=PROMPT, sampling_params=GREEDY8)["output_ids"]


def test_stream_with_bad_input_answers_400_not_an_event(http):
    r = http.post("/generate", json={"input_ids": [1, 10**9], "stream": True})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert "error" in r.json()


def test_mid_stream_error_is_sent_as_an_event_then_done():
    # The real engine cannot be made to fail half-way on demand; a fake engine that raises after
    # two tokens exercises the server's in-band error path (SGLang sends the same event shape).
    with running_engine_server(lambda: FakeEngine(fail_stream_after=2)) as s:
        r = httpx.post(f"{s.url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 5},
                                                  "stream": True}, timeout=30)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [e["output_ids"] for e in events[:2]] == [[2], [2, 3]]
    assert events[2] == {"error": {"message": "fake failure in the middle of the stream",
                                   "type": "invalid_request_error", "code": 400, "retryable": False}}
    assert events[3] == "[DONE]" and len(events) == 4


BAD_BODIES = {
    # name: (raw body, which SGLang error shape, a word the message must contain)
    "unknown_sampling_key": (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokenz": 3}}', "string", "max_new_tokenz"),
    "empty_ids": (b'{"input_ids": []}', "object", "input_ids"),
    "id_out_of_vocab": (b'{"input_ids": [1, 1000000000]}', "object", "1000000000"),
    "prompt_too_long": (json.dumps({"input_ids": [1] * (CONTEXT + 10)}).encode(), "object", "context"),
    "negative_max_new_tokens": (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}', "object", "max_new_tokens"),
    "logprob_start_past_prompt": (b'{"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 5}', "object", "logprob_start_len"),
    "text_and_ids": (b'{"input_ids": [1, 2], "text": "hi"}', "object", "exactly one"),
    "malformed_json": (b'{"input_ids": [1,', "object", "JSON"),
    "non_object_body": (b"[1, 2, 3]", "object", "object"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_generate_input_is_400_and_server_keeps_serving(http, name):
    raw, shape, word = BAD_BODIES[name]
    r = http.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    if shape == "string":  # SGLang 0.5.22+ typed-contract failure
        message = body["error"]
        assert isinstance(message, str)
    else:  # a ValueError inside /generate, and a body that is no JSON object
        assert set(body) == {"error"} and set(body["error"]) == {"message"}
        message = body["error"]["message"]
    assert word.lower() in message.lower()
    assert len(generate(http, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})["output_ids"]) <= 2


# ------------------------------------------------------------------------------ info and health


def test_info_routes(http, tiny_dir):
    info = http.get("/model_info").json()
    assert info == http.get("/get_model_info").json()  # deprecated alias
    assert info["weight_version"] == "0"
    assert info["is_generation"] is True
    assert Path(info["model_path"]).resolve() == Path(tiny_dir).resolve()
    srv = http.get("/server_info").json()
    assert srv["context_length"] == CONTEXT
    assert srv["max_running_requests"] == 16
    assert srv["max_total_num_tokens"] == 8 * CONTEXT  # the engine's KV budget: here a full batch of full contexts
    assert (srv["version"], srv["weight_version"]) == ("clawrl-embedded", "0")
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.get("/ready").status_code == 200
    loads = http.get("/v1/loads").json()
    assert loads["loads"][0]["dp_rank"] == 0
    assert loads["loads"][0]["num_running_reqs"] == 0
    models = http.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == CONTEXT


def test_pause_holds_requests_until_continue(http, server):
    r = http.post("/pause_generation", json={"mode": "retract"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    try:
        assert http.get("/ready").status_code == 503
        # Embedded server: 503 at once while paused. Real SGLang holds the probe behind the pause
        # and answers 503 only after SGLANG_HEALTH_CHECK_TIMEOUT (20 s).
        assert http.get("/health_generate").status_code == 503
        result: dict = {}
        held = threading.Thread(target=lambda: result.update(generate(
            httpx.Client(base_url=server.url, timeout=60), input_ids=PROMPT, sampling_params=GREEDY8)))
        held.start()
        wait_for_load(http, "num_waiting_reqs", lambda n: n == 1)  # it reached the engine's queue
        assert held.is_alive() and not result  # held, not refused
        assert http.post("/flush_cache").status_code == 200  # flushing while paused is allowed
    finally:
        r = http.post("/continue_generation", json={})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    join(held)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert http.get("/ready").status_code == 200


def wait_for_load(http: httpx.Client, key: str, pred) -> None:
    wait_until(lambda: pred(http.get("/v1/loads").json()["loads"][0][key]), f"/v1/loads {key} to change",
               poll_s=0.005)


LONG = {"max_new_tokens": CONTEXT - len(PROMPT) - 1, "temperature": 0, "ignore_eos": True}


def test_flush_cache_refused_while_busy_and_not_paused(http, server):
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(generate(
        httpx.Client(base_url=server.url, timeout=60), input_ids=PROMPT, sampling_params=LONG)))
    worker.start()
    wait_for_load(http, "num_running_reqs", lambda n: n >= 1)
    busy = http.get("/flush_cache")
    join(worker)
    assert busy.status_code == 400
    assert busy.headers["content-type"].startswith("text/plain")  # SGLang answers plain text here
    assert len(result["output_ids"]) == LONG["max_new_tokens"]
    idle = http.post("/flush_cache")
    assert (idle.status_code, idle.text) == (200, "Cache flushed.\n")


def test_abort_request_by_rid_prefix_returns_partial_output(http, server):
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(generate(
        httpx.Client(base_url=server.url, timeout=60), input_ids=PROMPT, sampling_params=LONG,
        rid="traj-17-turn-3")))
    worker.start()
    wait_for_load(http, "num_running_reqs", lambda n: n >= 1)
    r = http.post("/abort_request", json={"rid": "traj-17"})  # SGLang matches rids by prefix
    join(worker)
    assert (r.status_code, r.text) == (200, "")
    # the aborted call still answers 200, with what was generated so far
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < LONG["max_new_tokens"]


def test_a_rid_names_one_request(http, server):
    # two equal rids in one batch: refused before either runs
    r = http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "rid": ["same", "same"],
                                     "sampling_params": GREEDY8})
    assert (r.status_code, r.json()) == (400, {"error": {"message":  # SGLang's words and shape
                                                         "Duplicate request IDs detected within the request: ['same']"}})
    # a rid already in flight: refused, and the running request is untouched
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(generate(
        httpx.Client(base_url=server.url, timeout=60), input_ids=PROMPT, sampling_params=LONG, rid="busy-1")))
    worker.start()
    wait_for_load(http, "num_running_reqs", lambda n: n >= 1)
    r = http.post("/generate", json={"input_ids": PROMPT, "rid": "busy-1", "sampling_params": GREEDY8})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "Duplicate request ID detected: busy-1"}})
    http.post("/abort_request", json={"rid": "busy-1"})
    join(worker)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert generate(http, input_ids=PROMPT, rid="busy-1", sampling_params=GREEDY8)["output_ids"]  # free again


def test_parallel_sampling_answers_n_samples_each_as_its_own_request(http):
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    out = generate(http, input_ids=PROMPT, rid="votes", sampling_params={**sp, "n": 3})
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["votes_0", "votes_1", "votes_2"]
    # sample i is exactly the single request with seed 7 + i: distinct, and reproducible
    singles = [generate(http, input_ids=PROMPT, sampling_params={**sp, "sampling_seed": 7 + i}) for i in range(3)]
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in singles]
    assert len({tuple(o["output_ids"]) for o in out}) == 3 and all(len(o["output_ids"]) == 8 for o in out)
    # a batch of two prompts with n = 2: prompt-major, four entries
    batch = generate(http, input_ids=[PROMPT, PROMPT[:-1]], sampling_params={**sp, "n": 2})
    assert len(batch) == 4 and [b["output_ids"] for b in batch[:2]] == [o["output_ids"] for o in out[:2]]
    for body, what in [({"input_ids": PROMPT, "stream": True, "sampling_params": {**sp, "n": 2}}, "n > 1"),
                       ({"input_ids": PROMPT, "sampling_params": {**sp, "n": 65}}, "sampling_params.n")]:
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and what in r.text, r.text


def test_client_giving_up_on_a_held_request_aborts_it(http, server):
    http.post("/pause_generation", json={"mode": "in_place"})
    try:
        # held behind the pause, so it cannot finish on its own: once the client gives up, the
        # server (polling every 0.5 s) cancels it and the engine drops it from the queue
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY8}, timeout=0.3)
        wait_for_load(http, "num_waiting_reqs", lambda n: n == 0)
    finally:
        http.post("/continue_generation")


def test_client_hanging_up_a_stream_closes_it_in_the_engine():
    # A slow fake engine (50 ms per token, 100 tokens = 5 s) makes "closed early" unambiguous; the
    # real engine would finish a tiny-model stream before the test could hang up.
    with running_engine_server(lambda: FakeEngine(step_s=0.05)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c, c.stream(
                "POST", "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 100},
                                           "stream": True}) as r:
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the response
            assert next(lines).startswith("data: ")
            assert s.engine.running == 1
        wait_until(lambda: s.engine.running == 0, "the engine to close the stream", poll_s=0.01)
        # closed early: the stream stopped well before its 100 tokens
        assert s.engine.running == 0 and s.engine.tokens_out < 100, s.engine.tokens_out


def test_tokenize_and_detokenize(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world")
    assert (r["count"], r["max_model_len"]) == (len(r["tokens"]), CONTEXT)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat["tokens"] == list(expected) and chat["count"] == len(expected)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"text": "Hello world"}
    both = http.post("/v1/detokenize", json={"tokens": [r["tokens"], r["tokens"][:1]]}).json()["text"]
    assert both == ["Hello world", tokenizer.decode(r["tokens"][:1])]
    bad = http.post("/tokenize", json={"prompt": "x", "messages": messages})
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]


def test_memory_occupation_routes_are_tolerated(http):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = http.post(path, json={"tags": ["kv_cache"]})
        assert (r.status_code, r.text) == (200, "null")


def test_control_route_validation_error_shape(http):
    r = http.post("/pause_generation", json={"mode": "sometimes"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "mode: Input should be 'abort', 'retract' or 'in_place'"}}
    r = http.post("/update_weights_from_disk", json={"weight_version": "9"})  # model_path missing
    assert (r.status_code, r.json()) == (400, {"error": {"message": "model_path: Field required"}})


@pytest.mark.parametrize(("path", "body", "field"), [  # SGLang's own tokenizer API tests send these
    ("/tokenize", {"prompt": 123}, "prompt"),
    ("/detokenize", {"tokens": "not_a_list"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2, "not_an_int", 4]}, "tokens"),
])
def test_tokenizer_route_type_errors_answer_like_every_other_400(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message"}
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}") and "Input should be" in message
    assert "{'type'" not in message and "[{" not in message  # not the repr of pydantic's error list


# ------------------------------------------------------------------------------ weights


def test_update_weights_from_disk_swaps_weights_or_keeps_old_ones(tiny_dir, tmp_path):
    perturbed = save_perturbed_copy(tiny_dir, tmp_path / "perturbed")
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        before = generate(http, input_ids=PROMPT, sampling_params=GREEDY8, return_logprob=True)

        bad = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing"),
                                                           "weight_version": "1"})
        assert bad.status_code == 400
        assert bad.json()["success"] is False and bad.json()["num_paused_requests"] == 0
        assert http.get("/model_info").json()["weight_version"] == "0"
        same = generate(http, input_ids=PROMPT, sampling_params=GREEDY8, return_logprob=True)
        assert same["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

        ok = http.post("/update_weights_from_disk", json={"model_path": str(perturbed), "weight_version": "1"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["success"] is True
        assert http.get("/model_info").json()["weight_version"] == "1"
        after = generate(http, input_ids=PROMPT, sampling_params=GREEDY8, return_logprob=True)
        assert after["meta_info"]["weight_version"] == "1"
        first_before = before["meta_info"]["output_token_logprobs"][0]
        first_after = after["meta_info"]["output_token_logprobs"][0]
        assert abs(first_after[0] - first_before[0]) > 1e-4 or first_after[1] != first_before[1]


def test_update_weight_version_relabels_and_by_default_aborts_in_flight(http, server):
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(generate(
        httpx.Client(base_url=server.url, timeout=60), input_ids=PROMPT, sampling_params=LONG)))
    worker.start()
    wait_for_load(http, "num_running_reqs", lambda n: n >= 1)
    try:
        r = http.post("/update_weight_version", json={"new_version": "v9"})  # abort_all_requests defaults to true
        join(worker)
        assert r.json() == {"success": True, "message": "Weight version updated to v9", "new_version": "v9"}
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert http.get("/model_info").json()["weight_version"] == "v9"
        out = generate(http, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
        assert out["meta_info"]["weight_version"] == "v9"
    finally:
        http.post("/update_weight_version", json={"new_version": "0", "abort_all_requests": False})
    assert http.get("/model_info").json()["weight_version"] == "0"


# ------------------------------------------------------------------------------ auth, CLI


def test_api_key_is_required_except_for_health(tiny_dir):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT, api_key="k-123") as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        r = httpx.get(f"{s.url}/model_info")
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert httpx.get(f"{s.url}/model_info", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{s.url}/model_info", headers={"Authorization": "Bearer k-123"}).status_code == 200


@pytest.mark.slow
def test_cli_engine_serves_the_configured_model(tmp_path, model_cache):
    port = free_port()
    overlay = tmp_path / "engine.toml"
    overlay.write_text(f'[model]\ndevice = "cpu"\n[engine]\nmax_context_len = {CONTEXT}\n'
                       f'[storage]\ndata_root = "{tmp_path}"\nmodel_cache = "{model_cache}"\n')
    engine = ServerProcess(["engine", "--model", "tiny", "--port", str(port), "--config", str(overlay)], port,
                           {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "engine.log", ready_path="/health")
    engine.start()
    url = engine.url
    try:
        engine.wait_ready()
        info = httpx.get(f"{url}/model_info").json()
        assert info["weight_version"] == "0"
        assert httpx.get(f"{url}/server_info").json()["context_length"] == CONTEXT
        out = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY8}, timeout=30).json()
        assert len(out["output_ids"]) == 8
    finally:
        engine.stop()
