import asyncio
import socket
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from clawrl.engine.types import EngineError, GenerateResult
from clawrl.judge.backends import (
    EngineJudge,
    JudgeBackend,
    JudgeBackendError,
    ProviderJudge,
    RuleJudge,
    correction_to_hint,
)
from clawrl.judge.context import build_judge_context
from clawrl.judge.parse import parse_hint, parse_score
from clawrl.judge.prompts import build_hint_messages, build_prm_messages
from clawrl.serving import serve_in_thread

from tests.utils.turns import build_next_state, build_turn
from tests.utils.waiting import Overlap

# ----------------------------------------------------------------------------------- rule judge
RULE_CASES = [
    # (next-state messages, expected score, expected hint)
    ([{"role": "user", "content": "no, that's wrong, answer in one word"}], -1, "answer in one word"),
    ([{"role": "user", "content": "thanks, that's great!"}], 1, None),
    ([{"role": "user", "content": "Perfect. Next question: what is 2+3?"}], 1, None),
    ([{"role": "user", "content": "That's not what I asked. I wanted the population."}], -1, "I wanted the population"),
    ([{"role": "user", "content": "Actually, use Celsius."}], -1, "use Celsius"),
    ([{"role": "user", "content": "shorter please"}], -1, "shorter please"),
    ([{"role": "user", "content": "in lowercase please"}], -1, "in lowercase please"),
    ([{"role": "user", "content": "Try again."}], -1, None),  # a retry request carries no instruction
    ([{"role": "user", "content": "thanks, but that's wrong"}], -1, None),  # negative evidence wins
    ([{"role": "user", "content": "Can you also tell me about Rome?"}], 0, None),
    ([{"role": "tool", "content": "Traceback (most recent call last):\n  KeyError: 'city'"}], -1, None),
    ([{"role": "tool", "content": "File not found: notes.txt"}], -1, None),
    ([{"role": "tool", "content": '{"temperature_c": 18, "sky": "sunny"}'}], 1, None),
    ([{"role": "tool", "content": "ok"}, {"role": "user", "content": "no, the other Springfield"}], -1,
     "the other Springfield"),  # a user correction outranks the successful tool result
]


def _prompts(next_messages):
    turn = build_turn([{"role": "user", "content": "What is the capital of France?"}],
                      text="It is Paris, a city in France.")
    ctx = build_judge_context(turn, build_next_state(turn, next_messages))
    return build_prm_messages(ctx, 4000), build_hint_messages(ctx, 4000)


@pytest.mark.parametrize("next_messages,score,hint", RULE_CASES)
def test_rule_judge_reads_explicit_feedback(next_messages, score, hint):
    prm, hint_prompt = _prompts(next_messages)
    judge = RuleJudge()
    votes = asyncio.run(judge.complete(prm, n=3, temperature=0.7, max_tokens=64))
    assert len(votes) == 3 and len(set(votes)) == 1  # deterministic: identical votes
    assert [parse_score(v) for v in votes] == [score] * 3
    hint_votes = asyncio.run(judge.complete(hint_prompt, n=2, temperature=0.7, max_tokens=64))
    assert parse_hint(hint_votes[0]) == ((True, hint) if hint else (False, None))


@pytest.mark.parametrize("text,expected", [
    ("no, shorter please", "shorter please"),
    ("No. That's not what I asked for: the population, not the area!", "the population, not the area"),
    ("nope", None),
    ("Thanks, but use Celsius.", "use Celsius"),
    ("wrong, I meant the city", "I meant the city"),
    ("no, try again", None),
])
def test_correction_to_hint_strips_rejecting_lead_ins(text, expected):
    assert correction_to_hint(text) == expected


def test_rule_judge_refuses_foreign_prompts_as_failed_votes():
    votes = asyncio.run(RuleJudge().complete([{"role": "user", "content": "hi"}], n=2, temperature=0, max_tokens=8))
    assert len(votes) == 2 and all(isinstance(v, ValueError) for v in votes)


def test_backends_satisfy_the_protocol(tiny_engine):
    backends = (RuleJudge(), ProviderJudge("http://x/v1", None, "m"), EngineJudge(tiny_engine, tiny_engine.tokenizer))
    assert all(isinstance(b, JudgeBackend) for b in backends)


# ------------------------------------------------------------------------------- engine judge
def test_engine_judge_returns_n_distinct_seeded_completions(tiny_engine):
    judge = EngineJudge(tiny_engine, tiny_engine.tokenizer)
    prm, _ = _prompts([{"role": "user", "content": "thanks"}])
    votes = asyncio.run(judge.complete(prm, n=3, temperature=1.0, max_tokens=12))
    assert len(votes) == 3 and all(isinstance(v, str) and v for v in votes)
    assert len(set(votes)) == 3  # seeds 0, 1, 2 give independent samples
    assert asyncio.run(judge.complete(prm, n=3, temperature=1.0, max_tokens=12)) == votes  # and reproducible
    assert [parse_score(v) for v in votes] == [None] * 3  # a random model writes no \boxed{}


class _FlakyEngine:
    """Fails the vote sampled with seed 1; answers the others."""

    async def generate(self, req):
        if req.sampling_params.sampling_seed == 1:
            raise EngineError("engine went away")
        return GenerateResult(rid=req.rid, text=r"\boxed{1}", output_ids=[1], prompt_tokens=len(req.input_ids),
                              completion_tokens=1, finish_reason={"type": "stop"}, weight_version="0")


def test_engine_judge_returns_a_failed_vote_as_its_exception(tiny_engine):
    judge = EngineJudge(_FlakyEngine(), tiny_engine.tokenizer)
    votes = asyncio.run(judge.complete([{"role": "user", "content": "x"}], n=3, temperature=1.0, max_tokens=4))
    assert votes[0] == r"\boxed{1}" and votes[2] == r"\boxed{1}"
    assert isinstance(votes[1], EngineError)


# ----------------------------------------------------------------------------- provider judge
@dataclass
class _ProviderState:
    bodies: list = field(default_factory=list)
    auth: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    overlap: Overlap = field(default_factory=Overlap)  # a test that sends n at once sets together = n


def _provider_app(state: _ProviderState) -> FastAPI:
    """Stands in for a remote OpenAI-compatible provider (what ProviderJudge talks to in production)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        state.paths.append(request.url.path)
        async with state.overlap.held():
            if body["model"] == "slow":
                await asyncio.sleep(2.0)  # a slow provider, on purpose
        if body["model"] == "broken":
            return JSONResponse({"error": {"message": "model overloaded", "type": "server_error"}}, status_code=503)
        if body["model"] == "malformed":
            return {"choices": []}
        content = f"vote {len(state.bodies)} \\boxed{{1}}"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}

    return app


@pytest.fixture
def provider():
    state = _ProviderState()
    server = serve_in_thread(_provider_app(state))
    try:
        yield server.url, state
    finally:
        server.stop()


MESSAGES = [{"role": "system", "content": "judge"}, {"role": "user", "content": "turn + next state"}]


def _votes(url, model, n=1, api_key=None, **kw):
    judge = ProviderJudge(url, api_key, model, **kw)
    return asyncio.run(judge.complete(MESSAGES, n=n, temperature=0.6, max_tokens=256))


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_provider_judge_issues_n_concurrent_requests(provider, suffix):
    url, state = provider
    state.overlap.together = 3
    votes = _votes(url + suffix, "judge-model", n=3, api_key="sk-test", timeout_s=120)
    assert len(votes) == 3 and [parse_score(v) for v in votes] == [1, 1, 1]
    assert state.paths == ["/v1/chat/completions"] * 3  # a trailing slash on base_url does not double it
    assert state.overlap.max_in_flight == 3  # all three in flight at once
    assert state.auth == ["Bearer sk-test"] * 3
    assert state.bodies[0] == {"model": "judge-model", "messages": MESSAGES, "temperature": 0.6, "max_tokens": 256}
    assert all("n" not in b for b in state.bodies)


def test_provider_judge_without_a_key_sends_no_authorization(provider, monkeypatch):
    url, state = provider
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-provider")  # the SDK's own env var is not used
    assert [parse_score(v) for v in _votes(url + "/v1", "m", n=2)] == [1, 1]
    assert state.auth == [None, None]


def test_provider_judge_reports_http_errors_with_the_provider_message(provider):
    url, state = provider
    votes = _votes(url + "/v1", "broken", n=2, max_retries=1)
    assert len(votes) == 2
    for v in votes:
        assert isinstance(v, JudgeBackendError)
        assert "HTTP 503" in str(v) and "model overloaded" in str(v) and "/v1/chat/completions" in str(v)
    assert len(state.bodies) == 4  # each vote retried once: max_retries reaches the SDK


def test_provider_judge_reports_timeouts_and_malformed_replies(provider):
    url, _ = provider
    slow = _votes(url + "/v1", "slow", timeout_s=0.5, max_retries=0)
    assert isinstance(slow[0], JudgeBackendError) and "timed out after 0.5 s" in str(slow[0])
    bad = _votes(url + "/v1", "malformed", max_retries=0)
    assert isinstance(bad[0], JudgeBackendError) and "malformed reply" in str(bad[0])


def test_provider_judge_reports_an_unreachable_provider():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    votes = _votes(f"http://127.0.0.1:{port}/v1", "m", n=2, timeout_s=5, max_retries=0)
    assert all(isinstance(v, JudgeBackendError) and "unreachable" in str(v) for v in votes)
    with pytest.raises(ValueError):
        ProviderJudge("", None, "m")


def test_cancelling_a_provider_judge_cancels_its_requests(provider):
    url, state = provider
    state.overlap.together = 3  # held until all three are in
    judge = ProviderJudge(url + "/v1", None, "slow", timeout_s=120)

    async def cancel_mid_flight():
        task = asyncio.create_task(judge.complete(MESSAGES, n=3, temperature=0, max_tokens=8))
        while state.overlap.in_flight < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # not returned as three failed votes
            await task

    asyncio.run(cancel_mid_flight())
    assert len(state.bodies) == 3


def test_a_reward_hook_that_never_answers_is_a_failed_vote_after_the_timeout():
    from clawrl.judge.backends import RewardHookBackend

    async def hangs(turn, next_state):
        await asyncio.sleep(3600)

    turn = build_turn([{"role": "user", "content": "hi"}])
    backend = RewardHookBackend(hangs, turn, build_next_state(turn, [{"role": "user", "content": "ok"}]),
                                timeout_s=0.2)
    votes = asyncio.run(backend.complete([], n=3, temperature=0.0, max_tokens=8))
    assert len(votes) == 3 and all(isinstance(v, JudgeBackendError) for v in votes)
    assert str(votes[0]) == "reward hook timed out after 0.2 s"
