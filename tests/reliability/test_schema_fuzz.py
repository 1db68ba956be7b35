"""Schemathesis against the OpenAPI documents of the gateway and of the engine server, over real HTTP.

Both servers run under uvicorn on a real socket with the real tiny model (engines with a small
context, so generated ``max_tokens: 10**9`` cases are clamped and stay quick). Every operation
gets a FIXED number of derandomized cases (``max_examples`` per operation and generation mode,
``derandomize=True``, no example database): the same cases on every run. Each case is sent over
HTTP and checked; failures are collected, so one run reports all of them.

Checks: ``not_a_server_error`` everywhere (zero 5xx). The gateway's OpenAI-facing routes document
their responses (``ChatCompletion``, OpenAI error bodies for 400/401/413/502/504, the SSE stream,
the Prometheus text), so their cases are also checked for status-code, content-type and
response-schema conformance. The engine server speaks SGLang's native API, whose error bodies are
not uniform and are left undocumented: only ``not_a_server_error`` applies there.

Afterwards each server still serves a normal request correctly, its serving thread is alive, and
the case count is asserted, so the test cannot silently test nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from openai import OpenAI
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from clawrl.engine.embedded import EmbeddedEngine
from clawrl.gateway.routes import create_app
from clawrl.serving import serve_in_thread
from clawrl.storage.catalog import run_query
from tests.utils.engine_server import running_engine_server
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability]

API_KEY = "fuzz-key-5f1c2a"
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
GATEWAY_OPS = {"POST /v1/chat/completions", "POST /v1/responses", "POST /v1/completions", "GET /v1/models",
               "GET /v1/sessions/{session_id}", "GET /healthz", "GET /metrics"}
GATEWAY_BUDGET = {"POST /v1/chat/completions": 60, "POST /v1/responses": 30, "POST /v1/completions": 30,
                  "GET /v1/models": 3, "GET /v1/sessions/{session_id}": 20}
GATEWAY_CONTEXT = 64  # prompt + output tokens: a generated huge max_tokens is clamped to what is left
ENGINE_CONTEXT = 32


@dataclass
class FuzzRun:
    planned: Counter = field(default_factory=Counter)  # (operation, mode) -> max_examples
    cases: Counter = field(default_factory=Counter)  # (operation, mode) -> cases sent
    statuses: Counter = field(default_factory=Counter)  # status code -> responses
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cases.values())


def fuzz(schema, base_url: str, budget: dict[str, int], default: int, *, conformance: set[str] = frozenset(),
         headers: dict[str, str] | None = None, after_case=None) -> FuzzRun:
    """Send ``budget[operation]`` (else ``default``) generated cases per operation and mode, and
    check ``not_a_server_error`` on every response; operations in ``conformance`` are also
    checked against their documented status codes, content types and response schemas.

    Negative cases (data that violates the schema) are generated only for operations with a
    request body: the others have nothing that can be made invalid."""
    run = FuzzRun()
    for result in schema.get_all_operations():
        op = result.ok()
        n = budget.get(op.label, default)
        checks = [not_a_server_error] + (CONFORMANCE if op.label in conformance else [])
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.body else [])
        fixed = not op.body and not list(op.iter_parameters())  # nothing to vary: one distinct case
        for mode in modes:
            run.planned[(op.label, mode.value)] = 1 if fixed else n
            _fuzz_operation(run, op, mode, n, base_url, checks, headers, after_case)
    return run


def _fuzz_operation(run: FuzzRun, op, mode: GenerationMode, n: int, base_url: str, checks: list,
                    headers: dict[str, str] | None, after_case) -> None:
    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=op.as_strategy(generation_mode=mode))
    def one(case):
        resp = case.call(base_url=base_url, headers=headers, timeout=30)  # a case takes < 1 s: a stall names its case
        run.cases[(op.label, mode.value)] += 1
        run.statuses[resp.status_code] += 1
        try:
            case.validate_response(resp, checks=checks, headers=headers)
        except FailureGroup as e:
            run.failures.append(f"{op.label} [{mode.value}] -> {resp.status_code} {resp.text[:120]!r}: "
                                f"{'; '.join(f.title for f in e.exceptions)}; body={case.body!r:.300}")
        if after_case is not None:
            after_case(op.label)

    one()


# ------------------------------------------------------------------------------------- gateway


@pytest.mark.timeout(HANG_S)
def test_gateway_schema_fuzz_has_no_5xx_and_keeps_serving(make_settings, monkeypatch):
    monkeypatch.setenv("CLAWRL_FUZZ_KEYS", API_KEY)
    s = make_settings({"server.api_keys_env": "CLAWRL_FUZZ_KEYS", "engine.max_context_len": GATEWAY_CONTEXT,
                       "ppo.max_new_tokens": 4, "model.device": "cpu"})
    monkeypatch.setattr("clawrl.gateway.routes.MAX_BODY_BYTES", 256 * 1024)
    handle = serve_in_thread(create_app(s))  # its own tiny engine, built from the settings
    try:
        spec = httpx.get(handle.url + "/openapi.json", timeout=30).json()
        schema = schemathesis.openapi.from_dict(spec)
        labels = {r.ok().label for r in schema.get_all_operations()}
        assert labels >= GATEWAY_OPS
        t0 = time.monotonic()
        # the OpenAI-facing routes document their responses: full conformance there; other routes
        # (admin, session reads) answer a user key with 401/403 and are held to "no 5xx"
        run = fuzz(schema, handle.url, GATEWAY_BUDGET, 1, conformance=GATEWAY_OPS,
                   headers={"Authorization": f"Bearer {API_KEY}"})
        elapsed = time.monotonic() - t0
        print(f"gateway fuzz: {run.total} cases in {elapsed:.1f} s; statuses {dict(sorted(run.statuses.items()))}")
        assert run.failures == [], "\n".join(run.failures)
        assert run.cases == run.planned and run.total >= 255  # every planned case was sent
        assert run.cases[("POST /v1/chat/completions", "positive")] == 60
        assert run.cases[("POST /v1/chat/completions", "negative")] == 60
        assert not any(code >= 500 for code in run.statuses)
        assert run.statuses[200] >= 20 and run.statuses[400] >= 20  # both paths were really exercised
        assert handle.thread.is_alive() and not handle.failure

        # still serving, and serving correctly: a normal turn is answered and recorded
        client = OpenAI(base_url=handle.url + "/v1", api_key=API_KEY, max_retries=0)
        resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "still there?"}],
                                              max_tokens=3, logprobs=True,
                                              extra_headers={"X-Session-Id": "after-fuzz"})
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert 1 <= resp.usage.completion_tokens <= 3
    finally:
        handle.stop()  # closes the store: the turn is in Parquet now
    rows = run_query(s.storage.data_root, "select turn_index, output_ids, rollout_logprobs from turns "
                                          "where session_id = 'after-fuzz'").to_pylist()
    assert len(rows) == 1 and len(rows[0]["output_ids"]) == len(rows[0]["rollout_logprobs"]) >= 1


# -------------------------------------------------------------------------------------- engine

# Aliases share a handler with a route fuzzed in full: a few cases each show they are wired.
ENGINE_BUDGET = {
    "POST /generate": 60, "PUT /generate": 5, "POST /tokenize": 15, "POST /v1/tokenize": 3,
    "POST /detokenize": 15, "POST /v1/detokenize": 3, "POST /update_weights_from_disk": 10,
    "POST /pause_generation": 5, "POST /continue_generation": 5,
    "POST /update_weight_version": 5, "POST /abort_request": 5,
}
PROBE = {"input_ids": [1, 42, 7, 99], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
         "return_logprob": True}


@pytest.mark.timeout(HANG_S)
def test_engine_schema_fuzz_has_no_5xx_and_changes_no_weights(tiny_dir):
    # A dedicated engine: the fuzz pauses it, relabels its weight version and tries weight loads.
    def make_engine():
        return EmbeddedEngine(tiny_dir, max_context_len=ENGINE_CONTEXT, max_batch_size=4)

    with running_engine_server(make_engine, model_path=str(tiny_dir), max_context_len=ENGINE_CONTEXT) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        before = http.post("/generate", json=PROBE).json()
        schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())

        def restore(label: str) -> None:
            # a paused engine holds every later /generate: resume after each pause case
            if label == "POST /pause_generation":
                assert http.post("/continue_generation").status_code == 200

        t0 = time.monotonic()
        run = fuzz(schema, srv.url, ENGINE_BUDGET, 1, after_case=restore)
        elapsed = time.monotonic() - t0
        print(f"engine fuzz: {run.total} cases in {elapsed:.1f} s; statuses {dict(sorted(run.statuses.items()))}")
        assert run.failures == [], "\n".join(run.failures)
        assert not any(code >= 500 for code in run.statuses)
        assert run.cases == run.planned and run.total == 281  # every planned case was sent (the LoRA routes: 4)
        assert run.statuses[200] >= 40 and run.statuses[400] >= 100

        # still serving, with the same weights: a greedy probe gives the same ids and log-probs
        assert http.get("/health").status_code == 200
        after = http.post("/generate", json=PROBE).json()
        assert after["output_ids"] == before["output_ids"] and len(after["output_ids"]) == 6
        lp_before = [t[0] for t in before["meta_info"]["output_token_logprobs"]]
        lp_after = [t[0] for t in after["meta_info"]["output_token_logprobs"]]
        assert lp_after == pytest.approx(lp_before, abs=1e-5)
        # a huge max_new_tokens is clamped to the context, not refused and not a hang; one beyond
        # 64 bits reaches the server as a float (orjson) and is a clear 400
        r = http.post("/generate", json={**PROBE, "sampling_params": {"max_new_tokens": 10**9, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["prompt_tokens"] + meta["completion_tokens"] == ENGINE_CONTEXT
        assert meta["finish_reason"]["type"] == "length"
        r = http.post("/generate", json={**PROBE, "sampling_params": {"max_new_tokens": 2**80}})
        assert r.status_code == 400 and "max_new_tokens must be a non-negative integer" in r.text
