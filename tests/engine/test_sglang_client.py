"""SGLangClient against the embedded engine's server (real HTTP, tiny model), plus the error and
version-compatibility paths against scripted local HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from clawrl.engine.sglang_client import SGLangClient, error_message
from clawrl.engine.types import (
    BadRequestError,
    Engine,
    EngineError,
    EngineTimeoutError,
    GenerateRequest,
    SamplingParams,
)
from tests.utils.engine_server import CONTEXT, PROMPT, make_tiny_engine, running_engine_server, save_perturbed_copy
from tests.utils.waiting import wait_until_async


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT) as s:
        yield s


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def scripted_server(handler):
    """A real HTTP server on 127.0.0.1 whose every POST /generate (and GET) answers ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler if asyncio.iscoroutinefunction(handler)
                         else _async(handler))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _async(fn):
    async def handler(request):
        return fn(request)
    return handler


def test_client_implements_the_engine_protocol():
    client = SGLangClient("http://127.0.0.1:1")
    assert isinstance(client, Engine)
    run(client.close())


# ------------------------------------------------------------------------------ against the server


def test_generate_equals_the_in_process_engine(server, tiny_dir):
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1], [100]]

    async def main():
        async with SGLangClient(server.url + "/") as client:  # trailing slash tolerated
            remote = [await client.generate(GenerateRequest(input_ids=p, sampling_params=greedy(10),
                                                            return_logprob=True, top_logprobs_num=2))
                      for p in prompts]
        async with make_tiny_engine(tiny_dir) as engine:
            local = [await engine.generate(GenerateRequest(input_ids=p, sampling_params=greedy(10),
                                                           return_logprob=True, top_logprobs_num=2))
                     for p in prompts]
        return remote, local

    remote, local = run(main())
    for r, loc in zip(remote, local):
        assert r.output_ids == loc.output_ids and len(r.output_ids) == 10
        assert r.output_logprobs == pytest.approx(loc.output_logprobs, abs=1e-6)
        top_ids = [[t for _, t in row] for row in r.output_top_logprobs]
        assert top_ids == [[t for _, t in row] for row in loc.output_top_logprobs]
        assert (r.finish_reason, r.weight_version, r.prompt_tokens) == (loc.finish_reason, "0", loc.prompt_tokens)
        assert r.weight_versions == [{"version": "0", "start": 0, "end": 10}]


def test_topk_scoring_over_http_equals_the_in_process_engine(server, tiny_dir):
    """Top-k OPD's two requests (the policy's top-k ids, then token_ids_logprob at them) over SGLang's
    JSON: input_top_logprobs and input_token_ids_logprobs survive the wire as in process."""
    from clawrl.judge.teacher import compute_student_topk, compute_teacher_topk_logprobs

    output = [5, 17, 300, 2]

    async def scores(engine):
        ids, student = await compute_student_topk(engine, PROMPT, output, 3)
        sampled, teacher = await compute_teacher_topk_logprobs(engine, [9, 8] + PROMPT, output, ids)
        return ids, student, sampled, teacher

    async def main():
        async with SGLangClient(server.url) as client:
            remote = await scores(client)
        async with make_tiny_engine(tiny_dir) as engine:
            local = await scores(engine)
        return remote, local

    remote, local = run(main())
    assert remote[0] == local[0] and all(len(row) == 3 for row in remote[0])
    (_, r_student, r_sampled, r_teacher), (_, l_student, l_sampled, l_teacher) = remote, local
    assert r_sampled == pytest.approx(l_sampled, abs=1e-6)
    assert sum(r_student, []) == pytest.approx(sum(l_student, []), abs=1e-6)
    assert sum(r_teacher, []) == pytest.approx(sum(l_teacher, []), abs=1e-6)


def test_prompt_scoring_equals_the_in_process_engine(server, tiny_dir):
    full = PROMPT + [11, 12, 13, 14]

    def scoring(start: int) -> GenerateRequest:
        return GenerateRequest(input_ids=full, sampling_params=SamplingParams(max_new_tokens=0),
                               return_logprob=True, logprob_start_len=start)

    async def main():
        async with SGLangClient(server.url) as client:
            remote = [await client.generate(scoring(s)) for s in (0, len(PROMPT) - 1)]
        async with make_tiny_engine(tiny_dir) as engine:
            local = [await engine.generate(scoring(s)) for s in (0, len(PROMPT) - 1)]
        return remote, local

    (r0, r_cheap), (l0, l_cheap) = run(main())
    assert (r0.output_ids, r0.text, r0.finish_reason) == ([], "", {"type": "length", "length": 0})
    assert len(r0.input_logprobs) == len(full) and r0.input_logprobs[0] is None
    assert r0.input_logprobs[1:] == pytest.approx(l0.input_logprobs[1:], abs=1e-6)
    # logprob_start_len = P-1 -> R+1 entries; entries 1..R are the 4 response tokens
    assert len(r_cheap.input_logprobs) == 5 and r_cheap.input_logprobs[0] is None
    assert r_cheap.input_logprobs[1:] == pytest.approx(l_cheap.input_logprobs[1:], abs=1e-6)
    assert r_cheap.input_logprobs[1:] == pytest.approx(r0.input_logprobs[-4:], abs=1e-6)


def test_text_prompt_returns_the_tokenized_prompt(server, tiny_dir):
    async def main():
        async with SGLangClient(server.url) as client:
            return await client.generate(GenerateRequest(text="Hello world", sampling_params=greedy(3)))

    res = run(main())
    from clawrl.models import load_tokenizer

    assert res.prompt_ids == load_tokenizer(tiny_dir).encode("Hello world")
    assert res.prompt_tokens == len(res.prompt_ids)


def test_stream_yields_cumulative_results_ending_finished(server):
    async def main():
        async with SGLangClient(server.url) as client:
            parts = [p async for p in client.generate_stream(
                GenerateRequest(input_ids=PROMPT, sampling_params=greedy(6), return_logprob=True))]
            whole = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=greedy(6),
                                                          return_logprob=True))
        return parts, whole

    parts, whole = run(main())
    assert len(parts) >= 2
    for prev, nxt in zip(parts, parts[1:]):
        assert nxt.output_ids[: len(prev.output_ids)] == prev.output_ids
        assert not prev.finished
    assert parts[-1].finished and parts[-1].output_ids == whole.output_ids
    assert parts[-1].output_logprobs == pytest.approx(whole.output_logprobs, abs=1e-6)


BAD_REQUESTS = {
    "unknown_sampling_key": lambda: GenerateRequest(input_ids=[1, 2], sampling_params=_unchecked({"max_new_tokenz": 1})),
    "id_out_of_vocab": lambda: GenerateRequest(input_ids=[1, 10**9]),
    "prompt_too_long": lambda: GenerateRequest(input_ids=[1] * (CONTEXT + 1)),
    "negative_max_new_tokens": lambda: GenerateRequest(input_ids=[1], sampling_params=_unchecked({"max_new_tokens": -3})),
    "logprob_start_past_prompt": lambda: GenerateRequest(input_ids=[1, 2], return_logprob=True, logprob_start_len=9),
}


class _Unchecked(SamplingParams):
    raw: dict = {}

    def to_dict(self) -> dict:
        return dict(self.raw)


def _unchecked(raw: dict) -> SamplingParams:
    """Sampling params that serialise arbitrary keys, unvalidated: lets the test send what a buggy caller would."""
    return _Unchecked.model_construct(raw=raw)


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_raises_bad_request_and_the_server_keeps_serving(server, name, stream):
    async def main():
        async with SGLangClient(server.url) as client:
            req = BAD_REQUESTS[name]()
            with pytest.raises(BadRequestError) as info:
                if stream:
                    async for _ in client.generate_stream(req):
                        pass
                else:
                    await client.generate(req)
            ok = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=greedy(2)))
            return str(info.value), ok, await client.health()

    message, ok, healthy = run(main())
    assert message and "HTTP" not in message  # the server's own words, not a status line
    assert len(ok.output_ids) == 2 and healthy


def test_update_weight_version_relabels_without_aborting(server):
    async def main():
        async with SGLangClient(server.url) as client:
            in_flight = asyncio.create_task(client.generate(GenerateRequest(input_ids=PROMPT,
                                                                            sampling_params=greedy(64))))
            await wait_until_async(lambda: server.engine.stats["running"] == 1, "the request running")
            relabel = await client.update_weight_version("v2")
            try:
                done = await in_flight
                info = await client.model_info()
            finally:
                await client.update_weight_version("0")
            return relabel, done, info

    relabel, done, info = run(main())
    assert (relabel.success, relabel.weight_version) == (True, "v2")
    assert done.finish_reason == {"type": "length", "length": 64}  # the client sends abort_all_requests false
    assert info["weight_version"] == "v2"


def test_api_key_is_sent_as_bearer(tiny_dir):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir), model_path=str(tiny_dir),
                               max_context_len=CONTEXT, api_key="sekret") as s:
        async def main():
            async with SGLangClient(s.url, api_key="sekret") as good, SGLangClient(s.url) as anonymous:
                info = await good.model_info()
                with pytest.raises(EngineError, match="HTTP 401"):
                    await anonymous.model_info()
                return info

        assert run(main())["weight_version"] == "0"


# ------------------------------------------------------------------------------ weight sync


async def _traffic(client: SGLangClient, stop: asyncio.Event, outcomes: list, in_flight: list[int]) -> None:
    """One user: sends greedy requests back to back until ``stop``; records each outcome."""
    while not stop.is_set():
        in_flight[0] += 1
        try:
            res = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=greedy(24),
                                                        return_logprob=True))
            outcomes.append(res)
        except Exception as e:  # counted as a failure below
            outcomes.append(e)
        finally:
            in_flight[0] -= 1


def test_sync_weights_under_concurrent_traffic_fails_no_request(tiny_dir, tmp_path):
    perturbed = save_perturbed_copy(tiny_dir, tmp_path / "perturbed")
    users = 24
    with running_engine_server(lambda: make_tiny_engine(tiny_dir, max_batch_size=32), model_path=str(tiny_dir),
                               max_context_len=CONTEXT) as s:
        async def main():
            async with SGLangClient(s.url, flush_retry_interval_s=0.05) as client:
                stop, outcomes, in_flight = asyncio.Event(), [], [0]
                tasks = [asyncio.create_task(_traffic(client, stop, outcomes, in_flight)) for _ in range(users)]
                while len(outcomes) < users:  # every user has finished at least one request
                    await asyncio.sleep(0.01)
                at_sync = in_flight[0]
                t0 = time.perf_counter()
                good = await client.sync_weights_from_disk(str(perturbed), "1")
                sync_s = time.perf_counter() - t0
                n_before_bad = len(outcomes)
                bad = await client.sync_weights_from_disk(str(tmp_path / "no-such-checkpoint"), "2")
                while len(outcomes) < n_before_bad + users:  # traffic keeps flowing after the failed sync
                    await asyncio.sleep(0.01)
                stop.set()
                await asyncio.gather(*tasks)
                return good, bad, outcomes, at_sync, sync_s, await client.model_info()

        good, bad, outcomes, at_sync, sync_s, info = run(main())

    failures = [o for o in outcomes if isinstance(o, Exception) or o.finish_reason["type"] != "length"]
    assert at_sync >= 20, f"only {at_sync} requests were in flight when the sync started"
    assert failures == []
    assert good.success and good.weight_version == "1", good.message
    assert not bad.success and bad.weight_version == "1"  # the failed sync kept the served version
    assert "not a directory" in bad.message or "no-such-checkpoint" in bad.message
    assert info["weight_version"] == "1"
    versions = {o.weight_version for o in outcomes}
    assert versions == {"0", "1"}
    # retract mode: requests in flight over the swap resume on the new weights in the same call
    spanning = [o for o in outcomes if len(o.weight_versions) == 2]
    assert spanning and all([v["version"] for v in o.weight_versions] == ["0", "1"] for o in spanning)
    print(f"sync under {at_sync} in-flight requests took {sync_s * 1000:.0f} ms; "
          f"{len(outcomes)} requests, {len(spanning)} spanning the update")


def test_failed_sync_keeps_old_version_and_still_resumes(server, tmp_path):
    async def main():
        async with SGLangClient(server.url, flush_retry_interval_s=0.05) as client:
            result = await client.sync_weights_from_disk(str(tmp_path / "missing"), "7")
            after = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=greedy(2)))
            return result, after, await client.model_info()

    result, after, info = run(main())
    ready = httpx.get(server.url + "/ready").status_code
    assert (result.success, result.weight_version) == (False, "0")
    assert info["weight_version"] == "0" and after.weight_version == "0"
    assert ready == 200  # continue_generation ran although the update failed


# ------------------------------------------------------------------------------ errors and compatibility


def test_unreachable_engine_raises_engine_error_fast():
    async def main():
        async with SGLangClient("http://127.0.0.1:1", timeout_s=5) as client:
            with pytest.raises(EngineError) as info:
                await client.generate(GenerateRequest(input_ids=[1]))
            return str(info.value), await client.health()

    message, healthy = run(main())
    # refused, not timed out (EngineTimeoutError after 5 s would name the timeout)
    assert message == "engine at http://127.0.0.1:1 unreachable: connection refused"
    assert healthy is False


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (400, {"error": "unknown sampling_params key(s): foo"}, "unknown sampling_params key(s): foo"),
        (400, {"error": {"message": "prompt too long"}}, "prompt too long"),
        (400, {"object": "error", "message": "bad field", "type": "Bad Request", "param": None, "code": 400}, "bad field"),
    ],
)
def test_each_sglang_400_shape_becomes_bad_request(status, body, expected):
    async def main():
        async with scripted_server(lambda request: web.json_response(body, status=status)) as url:
            async with SGLangClient(url) as client:
                with pytest.raises(BadRequestError) as info:
                    await client.generate(GenerateRequest(input_ids=[1]))
                return str(info.value)

    assert run(main()) == expected


def test_error_message_reads_plain_text_and_fastapi_detail():
    assert error_message(400, b"Cache not flushed.\n") == "Cache not flushed."
    assert error_message(404, b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(502, b"") == "HTTP 502"


def test_5xx_and_timeout_become_engine_errors_naming_the_url():
    async def slow(request):
        await asyncio.sleep(5)
        return web.json_response({})

    async def main():
        async with scripted_server(lambda request: web.Response(status=503, text="overloaded")) as url:
            async with SGLangClient(url + "/") as client:
                with pytest.raises(EngineError) as e5:
                    await client.model_info()
            m503 = str(e5.value).replace(url, "URL")
        async with scripted_server(lambda request: web.Response(status=502, text="bad gateway")) as url:
            async with SGLangClient(url) as client:
                with pytest.raises(EngineError) as e502:
                    await client.generate(GenerateRequest(input_ids=[1]))
            m502 = str(e502.value).replace(url, "URL")
        async with scripted_server(slow) as url:
            async with SGLangClient(url + "/", timeout_s=1) as client:
                with pytest.raises(EngineTimeoutError) as et:
                    await client.generate(GenerateRequest(input_ids=[1]))
            mt = str(et.value).replace(url, "URL")
        return m503, m502, mt

    e5, e502, et = run(main())
    assert e5 == "engine at URL answered HTTP 503 on GET /model_info: overloaded"
    assert e502 == "engine at URL answered HTTP 502 on POST /generate: bad gateway"
    # a non-streamed answer is awaited while /health answers; this server answers nothing
    assert et == "engine at URL has not answered POST /generate, and GET /health did not answer healthy (asked every 1 s)"


def _final(n: int, done: bool) -> dict:
    return {"text": "x" * n, "output_ids": list(range(n)), "meta_info": {
        "id": "r", "prompt_tokens": 1, "completion_tokens": n, "weight_version": "0",
        "finish_reason": {"type": "length", "length": n} if done else None}}


def _pacing_server(gaps: list[float], health_ok: bool = True):
    """/generate streams one event after each of ``gaps`` seconds (the last one final), or when
    not streamed answers once after all of them; /health answers at once, 200 or 503."""
    async def handler(request):
        if request.path == "/health":
            return web.Response(status=200 if health_ok else 503)
        body = await request.json()
        if not body.get("stream"):
            await asyncio.sleep(sum(gaps))
            return web.json_response(_final(len(gaps), True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, gap in enumerate(gaps, 1):
            await asyncio.sleep(gap)
            await resp.write(b"data: " + json.dumps(_final(i, i == len(gaps))).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return handler


def test_timeout_is_on_silence_not_on_the_length_of_the_answer():
    async def main():
        req = GenerateRequest(input_ids=[1])
        # 2 s of allowed silence against 0.4 s gaps: a margin a busy machine's scheduling delays cannot eat
        async with scripted_server(_pacing_server([0.4] * 6)) as url, SGLangClient(url, timeout_s=2) as client:
            t0 = time.monotonic()
            parts = [r async for r in client.generate_stream(req)]  # 2.4 s of stream, never 2 s silent
            whole = await client.generate(req)  # 2.4 s for the whole answer; /health answers meanwhile
            took = time.monotonic() - t0
        async with scripted_server(_pacing_server([0.1, 0.1, 30.0])) as url, SGLangClient(url, timeout_s=1) as client:
            with pytest.raises(EngineTimeoutError) as stalled:  # two events, then silence
                [r async for r in client.generate_stream(req)]
        async with scripted_server(_pacing_server([30.0], health_ok=False)) as url, \
                SGLangClient(url, timeout_s=1) as client:
            with pytest.raises(EngineTimeoutError) as unhealthy:
                await client.generate(req)
        return parts, whole, took, str(stalled.value).replace(url, "URL"), str(unhealthy.value).replace(url, "URL")

    parts, whole, took, stalled, unhealthy = run(main())
    assert [len(p.output_ids) for p in parts] == [1, 2, 3, 4, 5, 6] and parts[-1].finished
    assert whole.finished and len(whole.output_ids) == 6 and took >= 4.8
    assert stalled.startswith("engine at ") and stalled.endswith("sent nothing for 1 s on POST /generate")
    assert unhealthy == "engine at URL has not answered POST /generate, and GET /health did not answer healthy (asked every 1 s)"


def test_generate_transport_failures_are_engine_errors():
    async def main():
        async with scripted_server(lambda request: web.Response(text="<html>proxy login</html>")) as url:
            async with SGLangClient(url) as client:
                with pytest.raises(EngineError, match="non-JSON: '<html>proxy login</html>'"):
                    await client.generate(GenerateRequest(input_ids=[1]))
        async with SGLangClient("http://127.0.0.1:1") as client:  # nothing listens on port 1
            with pytest.raises(EngineError, match="unreachable: connection refused"):
                await client.generate(GenerateRequest(input_ids=[1]))

    run(main())


def test_stream_reads_events_longer_than_a_read_buffer_and_mid_stream_errors():
    # one event of ~200 KB (the log-probs of a long answer), then an error event
    n = 12000
    final = {"text": "x" * n, "output_ids": list(range(n)), "meta_info": {
        "id": "r", "prompt_tokens": 1, "completion_tokens": n, "finish_reason": {"type": "length", "length": n},
        "weight_version": "7"}}

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = await request.json()
        if body["sampling_params"].get("temperature") == 2.0:
            await resp.write(b'data: {"error": {"message": "engine fell over", "code": 500}}\n\n')
        else:
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def main():
        async with scripted_server(stream) as url:
            async with SGLangClient(url) as client:
                results = [r async for r in client.generate_stream(GenerateRequest(input_ids=[1]))]
                with pytest.raises(EngineError, match="failed mid-stream \\(code 500\\): engine fell over"):
                    async for _ in client.generate_stream(GenerateRequest(
                            input_ids=[1], sampling_params=SamplingParams(temperature=2.0))):
                        pass
        return results

    [last] = run(main())
    assert last.finished and len(last.output_ids) == n and last.weight_version == "7" and last.text == "x" * n


def test_non_json_answer_is_an_engine_error():
    async def main():
        async with scripted_server(lambda request: web.Response(text="<html>proxy login</html>")) as url:
            async with SGLangClient(url) as client:
                with pytest.raises(EngineError, match="answered GET /model_info with non-JSON: "
                                                      "'<html>proxy login</html>'"):
                    await client.model_info()

    run(main())


def test_flush_cache_retries_while_busy():
    calls: list[int] = []

    def handler(request: web.Request) -> web.Response:
        calls.append(1)
        return web.Response(status=200 if len(calls) == 3 else 400, text="busy")

    async def main():
        async with scripted_server(handler) as url:
            async with SGLangClient(url, flush_retries=5, flush_retry_interval_s=0) as client:
                first = await client.flush_cache()
                n_first = len(calls)
                calls.extend([1] * 10)  # from now on every answer is 400
                async with SGLangClient(url, flush_retries=2, flush_retry_interval_s=0) as stubborn:
                    second = await stubborn.flush_cache()
            return first, n_first, second

    first, n_first, second = run(main())
    assert (first, n_first) == (True, 3)  # 400, 400, 200
    assert second is False and len(calls) == 3 + 10 + 3  # 1 try + 2 retries


def test_sync_resumes_generation_even_when_the_update_call_blows_up():
    seen: list[str] = []
    body_types: set[str] = set()

    def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.method == "POST":
            body_types.add(request.content_type)
        if request.path == "/update_weights_from_disk":
            return web.Response(status=500, text="scheduler died")
        if request.path == "/model_info":
            return web.json_response({"weight_version": "3"})
        return web.json_response({"message": "ok", "status": "ok"})

    async def main():
        async with scripted_server(handler) as url, SGLangClient(url) as client:
            with pytest.raises(EngineError, match="HTTP 500"):
                await client.sync_weights_from_disk("/ckpt", "4")

    run(main())
    assert seen == ["/model_info", "/pause_generation", "/flush_cache", "/update_weights_from_disk",
                    "/continue_generation"]
    assert body_types == {"application/json"}  # SGLang's FastAPI routes parse only JSON bodies


def test_lora_adapters_load_and_unload_by_name_and_a_request_names_its_adapter():
    """SGLang's LoRA API as its server answers it: 200 with success, 400 with error_message; /generate's body
    names the adapter in lora_path."""
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append((request.path, body))
        if request.path == "/generate":
            return web.json_response({"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {
                "type": "length", "length": 0}, "prompt_tokens": 2, "completion_tokens": 0, "weight_version": "0"}})
        if body["lora_name"] == "key-a@v2":
            return web.json_response({"success": False, "error_message": "LoRA adapter key-a@v2 is already loaded",
                                      "loaded_adapters": {}}, status=400)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": {"key-a@v1": "/a/v1"}})

    async def main():
        async with scripted_server(handler) as url, SGLangClient(url) as client:
            loaded = await client.load_lora_adapter("key-a@v1", "/a/v1")
            refused = await client.load_lora_adapter("key-a@v2", "/a/v2")
            unloaded = await client.unload_lora_adapter("key-a@v1")
            await client.generate(GenerateRequest(input_ids=[1, 2], sampling_params=greedy(0), lora_path="key-a@v1"))
            return loaded, refused, unloaded

    loaded, refused, unloaded = run(main())
    assert (loaded.success, refused.success, refused.message, unloaded.success) == (
        True, False, "LoRA adapter key-a@v2 is already loaded", True)
    assert [(p, b.get("lora_name"), b.get("lora_path")) for p, b in seen] == [
        ("/load_lora_adapter", "key-a@v1", "/a/v1"), ("/load_lora_adapter", "key-a@v2", "/a/v2"),
        ("/unload_lora_adapter", "key-a@v1", None), ("/generate", None, "key-a@v1")]
