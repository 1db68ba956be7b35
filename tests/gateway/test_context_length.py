"""A request that does not fit the context is answered as OpenAI answers it (HTTP 400,
``code: "context_length_exceeded"``, its wording), also when the gateway sits in front of an HTTP
engine that refuses in SGLang's words. The embedded topology is covered in
tests/reliability/test_hostile_input.py."""

from __future__ import annotations

import httpx
import pytest

from clawrl.gateway.routes import create_app
from clawrl.gateway.errors import engine_context_error
from clawrl.serving import serve_in_thread
from clawrl.storage.writer import DataStore
from tests.utils.engine_server import CONTEXT, make_tiny_engine, running_engine_server
from tests.utils.waiting import HANG_S


def test_sglangs_two_refusals_become_openais_error():
    err = engine_context_error("The input (300 tokens) is longer than the model's context length (256 tokens).")
    assert err.status == 400 and err.body()["error"] == {
        "message": "This model's maximum context length is 256 tokens. However, your messages resulted in 300 tokens. "
                   "Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    # SGLang's words when the prompt fits but prompt + max_new_tokens does not
    err = engine_context_error(
        "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a total of "
        "70000 tokens: 6000 tokens from the input messages and 64000 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit.")
    assert err.body()["error"]["message"] == (
        "This model's maximum context length is 32768 tokens. However, you requested 70000 tokens (6000 in the "
        "messages, 64000 in the completion). Please reduce the length of the messages or completion.")
    assert engine_context_error("sampling_params.temperature must be >= 0") is None


@pytest.mark.timeout(HANG_S)
def test_http_engine_overflow_reaches_the_client_as_context_length_exceeded(make_settings, tiny_dir):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT) as srv:
        s = make_settings({"engine.url": srv.url, "server.open_mode": True,
                           "ppo.max_new_tokens": 4})
        store = DataStore(s.storage.data_root)
        app = create_app(s, store=store)
        handle = serve_in_thread(app)
        try:
            url = handle.url + "/v1/chat/completions"
            long = [{"role": "user", "content": "word " * 300}]
            assert app.state.engine.max_context_len == CONTEXT  # learned from the engine's /server_info
            for stream in (False, True):  # refused before a byte of the stream
                r = httpx.post(url, json={"model": "m", "messages": long, "stream": stream}, timeout=60)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
                assert err["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, "
                                                 "your messages resulted in "), err
            ok = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
            assert ok.status_code == 200, ok.text
            # an engine that refuses by itself (the gateway has not learned its context) is answered the same way
            app.state.engine.max_context_len = None
            r = httpx.post(url, json={"model": "m", "messages": long}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            store.flush()
        finally:
            handle.stop()
            store.close()
