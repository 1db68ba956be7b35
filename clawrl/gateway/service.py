"""Serve one chat completion through the engine and record the turn exactly.

The chat template is rendered once into prompt ids; the engine is called with ``input_ids`` and
``return_logprob`` so the turn keeps the exact prompt ids, sampled ids and their log-probs, and the
weight version that produced them. The gateway never judges, builds samples or waits on training.

Durability point: a turn is appended to the session log (a write-ahead-log write that survives a
kill -9 of this process) *before* the client receives the end of its response — the JSON body of a
non-streamed completion, or the final chunk of a stream. A response the client has received in full
is therefore always in the log. If the append fails (disk full, I/O error) the client gets a 507
``storage_error`` instead (an error event in a stream) and the session is left as if the request
had not come: its turn index stays free and a pending turn stays pending.

Choices (OpenAI's ``n``): how they are served and logged is in choices.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson

from clawrl.chat import TOOL_CALL_OPEN, ChatAdapter, ChatMessage, ParsedOutput
from clawrl.config import Settings
from clawrl.engine.types import (
    BadRequestError,
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from clawrl.gateway.choices import ChoiceStream, choice_logprobs, merged, until_stalled, usage
from clawrl.gateway.errors import GatewayError, context_length_error, engine_failure, sampling_error
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.schemas import ChatCompletionRequest
from clawrl.gateway.sessions import (
    PendingTurn,
    SessionState,
    SessionTracker,
    choice_digests,
    explicit_session_id,
    validate_session_id,
)
from clawrl.ids import new_id
from clawrl.records import NextStateRecord, TurnRecord, TurnType, utcnow


log = logging.getLogger("clawrl.gateway")

# Next-state records that could not be written (full disk) wait in memory for the next write;
# beyond this many the oldest are dropped (logged) rather than growing without bound.
MAX_UNWRITTEN_NEXT_STATES = 100_000
# Most choices (OpenAI's n) one request may ask for: each is a sample and a logged turn of its own.
MAX_N = 8
# An agent's own maintenance calls, made side turns when a request names no turn type (the system or last
# message matches, case-insensitive): OpenClaw's compaction summariser and its pre-compaction memory flush.
SIDE_TURN_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"you are a context summari[sz]ation assistant",
    r"the messages above are (a conversation|new conversation messages) to (summari[sz]e|incorporate)",
    r"^pre-compaction memory flush\b")]


@dataclass(frozen=True)
class TurnContext:
    """Who is asking and the session fields from headers (the header names the session; the body's
    turn_type and session_done win over theirs)."""

    namespace: str
    session_id: str | None = None
    turn_type: str | None = None
    session_done: bool | None = None


@dataclass
class Turn:
    """A request on its way: checked, rendered, its session opened."""

    req: ChatCompletionRequest
    state: SessionState
    session_id: str
    turn_type: str
    done: bool
    messages: list[dict[str, Any]]
    gen: GenerateRequest
    created_at: Any
    t0: float
    client_gone: bool = False  # the client went away: nothing is recorded
    turn_id: str = field(default_factory=new_id)  # choice 0's, known up front (a Responses id names it)
    params: dict[str, Any] = field(default_factory=dict)  # logged in request_params with the sampling ones
    results: list[GenerateResult] | None = None  # the engine's, once complete() has them


class ChatService:
    def __init__(self, engine: Engine, tokenizer, store, settings: Settings, generate_hook: Any = None):
        self.engine = engine
        self.adapter = ChatAdapter(tokenizer)
        self.store = store
        self.tracker = tracker = SessionTracker()
        self.settings = settings
        self.metrics = metrics = GatewayMetrics()
        self.generate_hook = generate_hook  # [hooks] generate: async fn(engine=, request=) -> GenerateResult
        # the LoRA adapter a namespace's requests are sent with (None: the base; gateway/lora.py sets it)
        self.adapter_of: Callable[[str], str | None] = lambda namespace: None
        self.weight_version = "unknown"
        self.storage_error: str | None = None  # the last append's OSError, None once one succeeds
        self._unwritten_next_states: list[NextStateRecord] = []
        self.paused = False  # POST /admin/pause: new turns get 503, turns in flight finish
        self._decode = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid]))
        # Read when /metrics is scraped: counting pending turns walks every open session, which
        # per request would cost O(open sessions) (~0.3 ms at a few thousand).
        metrics.pending_turns.set_function(lambda: tracker.pending_turns)
        metrics.open_sessions.set_function(lambda: len(tracker))

    def prepare(self, req: ChatCompletionRequest, ctx: TurnContext, prompt_ids: list[int] | None = None,
                default_turn_type: str | None = None, params: dict[str, Any] | None = None,
                score_prompt: bool = False) -> Turn:
        """The request checked, its prompt rendered (unless ``prompt_ids`` are given: a legacy
        completion's text) and its session opened: a GatewayError from here comes before any byte
        of the response. ``default_turn_type`` stands for the server's when the request names none;
        ``params`` are logged in the turn's request_params (which API it came through, say);
        ``score_prompt``: the engine returns the prompt's log-probs too (not recorded)."""
        if not 1 <= req.n <= MAX_N:
            raise GatewayError(400, f"n: expected an integer from 1 to {MAX_N}, got {req.n}", param="n")
        if req.top_logprobs and not req.logprobs:
            raise GatewayError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise GatewayError(400, "response_format other than 'text' is not supported", param="response_format")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        # which session a request belongs to: sessions.py's docstring
        session_id = ctx.session_id if ctx.session_id is not None else req.session_id
        try:
            if session_id is not None:
                validate_session_id(session_id)
        except ValueError as e:  # say where the bad id came from; it is never used to build a path
            where = "X-Session-Id header" if ctx.session_id is not None else "session_id"
            raise GatewayError(400, f"{where}: {e}", param="session_id") from None
        maintenance = self._maintenance(req.messages)
        session_id = (session_id or explicit_session_id(req.prompt_cache_key, req.user, req.metadata)
                      or self.tracker.find(ctx.namespace, messages, maintenance))
        turn_type = req.turn_type or ctx.turn_type or default_turn_type or (
            TurnType.SIDE.value if maintenance else self.settings.server.default_turn_type)
        if turn_type not in (TurnType.MAIN.value, TurnType.SIDE.value):
            raise GatewayError(400, f"turn type must be 'main' or 'side', got {turn_type!r}", param="turn_type")
        done = bool(req.session_done if req.session_done is not None else ctx.session_done)
        try:
            if prompt_ids is None:
                prompt_ids = self.adapter.render(req.messages, req.tools, req.tool_choice)
        except Exception as e:  # a template error is the client's message shape, not a server fault
            raise GatewayError(400, f"could not apply the chat template: {e}", param="messages") from None
        asked = req.max_completion_tokens or req.max_tokens
        limit = getattr(self.engine, "max_context_len", None)  # known for an in-process engine; else the engine says
        if isinstance(limit, int):  # refused before any byte is streamed
            if len(prompt_ids) >= limit:  # not even one output token fits
                raise context_length_error(limit, len(prompt_ids))
            if asked and len(prompt_ids) + asked > limit:
                raise context_length_error(limit, len(prompt_ids), asked)
        sp: dict[str, Any] = {  # from_dict leaves the engine's default where a value is None
            "max_new_tokens": asked or self.settings.ppo.max_new_tokens,  # the embedded engine cuts the default to fit
            "temperature": self.settings.ppo.temperature if req.temperature is None else req.temperature,
            "top_p": req.top_p, "stop": req.stop or None, "sampling_seed": req.seed, "min_new_tokens": req.min_tokens,
            "n": req.n,
            **{k: v for k in ("frequency_penalty", "presence_penalty", "logit_bias") if (v := getattr(req, k))},
        }
        try:
            sampling = SamplingParams.from_dict(sp)
        except BadRequestError as e:
            raise sampling_error(e) from None
        routing_key = hashlib.blake2b(f"{ctx.namespace}:{session_id}".encode(), digest_size=8).hexdigest()
        gen = GenerateRequest(input_ids=prompt_ids, sampling_params=sampling, return_logprob=True,
                              logprob_start_len=0 if score_prompt else -1,
                              top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
                              routing_key=routing_key,  # several engines: the session stays on one
                              lora_path=self.adapter_of(ctx.namespace),  # the caller's own adapter, never the model's
                              main_turn=turn_type == TurnType.MAIN.value)
        state, evicted = self.tracker.open(ctx.namespace, session_id)
        self._write_next_states(evicted)
        return Turn(req, state, session_id, turn_type, done, messages, gen, utcnow(), time.perf_counter(),
                    params=params or {})

    def _maintenance(self, messages: list[ChatMessage]) -> bool:
        """An agent's own call, made a side turn when the request names no turn type: it adds no
        user or tool message, or a system message or its last message matches ``SIDE_TURN_PATTERNS``
        (an agent's compaction summariser, say)."""
        if messages[-1].role not in ("user", "tool"):
            return True
        texts = [m.text() for m in messages if m.role in ("system", "developer")] + [messages[-1].text()]
        return any(p.search(t) for p in SIDE_TURN_PATTERNS for t in texts)

    async def complete(self, turn: Turn) -> tuple[dict[str, Any], float]:
        """The chat.completion body (schemas.ChatCompletion's shape, built as a plain dict: the
        response is serialized once, with orjson) and the seconds spent in the engine call (the rest
        of a request's time in the gateway is its own work, and the wait for the session's previous
        main turn)."""
        async with self._serving(turn):
            self._link_next_state(turn)
            results, engine_s = await self._generate(turn.gen.samples())
            turn.results = results
            if turn.client_gone:  # nobody receives it: not a turn (nginx's 499, logged as such)
                self._client_gone(turn, stream=False)
                raise GatewayError(499, "the client closed the request", "client_closed_request")
            outs, index = self._record(turn, results)
        choices = [{"index": i, "message": {"role": "assistant", "content": parsed.content,
                                            "tool_calls": parsed.tool_calls or None},
                    "logprobs": self._logprobs(result, 0, turn.req.top_logprobs) if turn.req.logprobs else None,
                    "finish_reason": finish} for i, ((parsed, finish), result) in enumerate(zip(outs, results))]
        return {**self._head(turn, "chat.completion"), "choices": choices, "usage": usage(results),
                "turn_index": index, "weight_version": results[0].weight_version}, engine_s

    async def chunks(self, turn: Turn) -> AsyncIterator[dict[str, Any]]:
        """The completion's chat.completion.chunk bodies, each carrying one choice (its ``index`` says
        which; the last of each choice also its ``weight_version`` and ``turn_index``); an error
        after the first is an error body (``{"error": ...}``), the last thing yielded."""
        req, head, samples = turn.req, self._head(turn, "chat.completion.chunk"), turn.gen.samples()
        holdback = max([len(s) for s in turn.gen.sampling_params.stop] + [len(TOOL_CALL_OPEN) if req.tools else 0, 1]) - 1
        lp = (lambda result, start: self._logprobs(result, start, req.top_logprobs)) if req.logprobs else None
        choices = [ChoiceStream(i, holdback, bool(req.tools), lp) for i in range(len(samples))]

        def chunk(entry: dict[str, Any], **more) -> dict[str, Any]:
            return {**head, "choices": [entry], **more}

        async with self._serving(turn):
            try:
                self._link_next_state(turn)
                for c in choices:
                    yield chunk(c.entry({"role": "assistant", "content": ""}))
                finals: list[GenerateResult | None] = [None] * len(samples)
                stall_s = self.settings.engine.stall_timeout_s
                streams = [until_stalled(self._engine_stream(g), stall_s) for g in samples]
                async with contextlib.aclosing(merged(streams)) as results:
                    async for i, result in results:
                        if result.finished:
                            finals[i] = result
                            if all(f is not None for f in finals):
                                break
                        elif (entry := choices[i].partial(result)) is not None:
                            yield chunk(entry)
                if any(f is None for f in finals):
                    raise GatewayError(502, "engine stream ended without a final result", "engine_unavailable")
                done: list[GenerateResult] = finals  # type: ignore[assignment]
                turn.results = done
                outs, index = self._record(turn, done)  # durable before the client sees the end
                for i, (c, result, (parsed, finish)) in enumerate(zip(choices, done, outs)):
                    yield chunk(c.final(result, parsed, finish), weight_version=result.weight_version,
                                turn_index=index + i)
                if req.stream_options and req.stream_options.include_usage:
                    yield {**head, "choices": [], "usage": usage(done), "weight_version": done[0].weight_version}
                self.metrics.requests.labels("200", "true", turn.turn_type).inc()
            except (GatewayError, TimeoutError, BadRequestError, EngineError) as e:
                err = engine_failure(e, self.settings.engine.stall_timeout_s)
                self.metrics.requests.labels(str(err.status), "true", turn.turn_type).inc()
                yield err.body()
            except (asyncio.CancelledError, GeneratorExit):  # the client went away: the engine streams are closed
                self._client_gone(turn, stream=True)
                raise
            finally:
                self.metrics.latency.labels("true").observe(time.perf_counter() - turn.t0)

    def _client_gone(self, turn: Turn, stream: bool) -> None:
        """One log line and one count (``clawrl_client_aborts``) per request whose client went away
        before its end: its engine request was aborted and nothing was recorded."""
        self.metrics.client_aborts.labels("true" if stream else "false").inc()
        log.warning("client went away: request %s of session %s abandoned after %.1f s, aborted in the engine, "
                    "nothing recorded", turn.gen.rid, turn.session_id, time.perf_counter() - turn.t0)

    async def sweep_forever(self) -> None:
        """Close idle sessions (their pending turns get no next state), every quarter of the idle
        timeout, at most 5 s apart."""
        period = max(0.05, min(5.0, self.tracker.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self._write_next_states(self.tracker.sweep())
            except Exception:  # keep sweeping; a storage hiccup must not kill the loop
                log.exception("session sweep failed")

    def read(self, query: Callable[..., Any], *args: Any) -> Any:
        """``query(con, *args)`` (clawrl.storage.queries) over the tables, once the records still in
        the write-ahead log are Parquet: a client reads its own writes."""
        from clawrl.storage.catalog import open_catalog

        self.store.flush()
        with open_catalog(self.settings.storage.data_root) as con:
            return query(con, *args)

    def restore_sessions(self) -> int:
        """After a restart, continue the sessions in the log: a session waiting for the user's reply
        comes back with its pending turn (so the reply becomes that turn's next state, and the idle
        sweep closes it if none comes), and every recent session goes on counting turn indices where
        it stopped, so a returning session never reuses one. Returns the sessions restored as open.
        (The WAL of a killed predecessor was recovered when the store opened.)"""
        from clawrl.storage.queries import session_states

        rows = self.read(session_states, 10 * self.tracker.max_sessions)  # as many as the tracker remembers
        for row in reversed(rows):  # oldest first: the tracker's order is its recency order
            pending = None if row["pending_turn_id"] is None else PendingTurn(
                row["pending_turn_id"], row["pending_turn_index"], row["pending_message_count"],
                *self._choice_digests(row))
            self.tracker.restore(row["namespace"], row["session_id"], row["next_index"], pending, row["age_s"])
        return len(self.tracker)

    def _choice_digests(self, row: dict[str, Any]) -> tuple[str | None, tuple[str, ...]]:
        """A pending turn of a request with n > 1 choices: its answer's digest and the other choices'."""
        from clawrl.storage.queries import choice_turns

        if (row.get("pending_n") or 1) <= 1:
            return None, ()
        return choice_digests(self.read(choice_turns, row["namespace"], row["session_id"],
                                        row["pending_turn_index"], row["pending_n"]), self.adapter)

    async def live_weight_version(self) -> str:
        """The engine's weight version now (a sync may have happened since the last turn), else the
        last one known."""
        with contextlib.suppress(Exception):
            self.weight_version = str((await self.engine.model_info()).get("weight_version", "unknown"))
        return self.weight_version

    @contextlib.asynccontextmanager
    async def _serving(self, turn: Turn):
        """A turn in flight (counted in the gauge). Main turns of one session take turns: the next
        state links to the previous turn. Side turns do not wait."""
        lock = turn.state.lock if turn.turn_type == TurnType.MAIN.value else contextlib.nullcontext()
        with self.metrics.in_flight.track_inprogress():
            async with lock:
                yield

    def _link_next_state(self, turn: Turn) -> None:
        if turn.turn_type == TurnType.MAIN.value:
            pending = turn.state.pending
            rec = self.tracker.link_next_state(turn.state, turn.messages)
            if rec is not None:
                try:
                    self._append(rec, "the previous turn's next state")
                except GatewayError:
                    turn.state.pending = pending  # not linked: the client's retry links it again
                    raise
                self.metrics.next_states.labels(rec.reason).inc()

    async def _generate(self, gens: list[GenerateRequest]) -> tuple[list[GenerateResult], float]:
        """The engine's result for each request, all at once, and the seconds the calls took; when
        one fails the others are cancelled (which aborts them in the engine). No deadline: an answer
        comes whole, after any time; an HTTP engine's client watches the engine (sglang_client.py)."""
        hook = self.generate_hook

        def call(gen: GenerateRequest) -> Any:
            return hook(engine=self.engine, request=gen) if hook else self.engine.generate(gen)

        t0 = time.perf_counter()
        try:
            if len(gens) == 1:
                results = [await call(gens[0])]
            else:
                tasks = [asyncio.ensure_future(call(g)) for g in gens]
                try:
                    results = list(await asyncio.gather(*tasks))
                except BaseException:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
        except (TimeoutError, BadRequestError, EngineError) as e:
            raise engine_failure(e, self.settings.engine.stall_timeout_s) from None
        elapsed = time.perf_counter() - t0
        self.metrics.engine_latency.observe(elapsed)
        return results, elapsed

    def _engine_stream(self, gen: GenerateRequest) -> AsyncIterator[GenerateResult]:
        if self.generate_hook is None:
            return self.engine.generate_stream(gen)

        async def one_chunk():  # a generate hook returns the whole result: it streams as one chunk
            yield await self.generate_hook(engine=self.engine, request=gen)

        return one_chunk()

    def _record(self, turn: Turn, results: list[GenerateResult]) -> tuple[list[tuple[ParsedOutput, str]], int]:
        """Append the request's turns, one per choice, in one write (the acknowledgement point) and
        update the session. Returns each choice's parsed output and finish reason, and the turn
        index of choice 0 (choice i has index + i)."""
        self.weight_version = results[0].weight_version
        if any(len(r.output_logprobs or []) != len(r.output_ids) for r in results):
            # Never record a turn whose log-probs do not align with its tokens (the reference pads).
            raise GatewayError(502, "engine returned log-probs that do not align with its output ids",
                               "engine_protocol_error")
        req, state, n = turn.req, turn.state, len(results)
        outs = []
        for result in results:
            parsed = self.adapter.parse(result.text, req.tools, req.tool_choice)
            finish = "tool_calls" if parsed.tool_calls else (result.finish_reason or {}).get("type", "stop")
            outs.append((parsed, finish))
        index = state.next_index  # taken by finish_turn once the turns are in the log (nothing awaits between)
        recs = [self._turn_record(turn, sample, result, parsed, finish, index + i,
                                  turn.turn_type if i == 0 else TurnType.SIDE.value, turn.turn_id if i == 0 else new_id())
                for i, (sample, result, (parsed, finish)) in enumerate(zip(turn.gen.samples(), results, outs))]
        self._append(recs[0] if n == 1 else recs, "the turn" if n == 1 else f"the {n} turns of the request's choices")
        for rec in recs:
            self.metrics.turns_recorded.labels(rec.turn_type).inc()
        self.metrics.prompt_tokens.inc(results[0].prompt_tokens)
        self.metrics.completion_tokens.inc(sum(r.completion_tokens for r in results))
        answers = [{"role": "assistant", "content": p.content, "tool_calls": p.tool_calls} for p, _ in outs]
        closing = self.tracker.finish_turn(state, recs[0].turn_id, index, turn.messages, answers[0],
                                           main=turn.turn_type == TurnType.MAIN.value, done=turn.done,
                                           others=answers[1:])
        self._write_next_states(closing)
        return outs, index

    def _turn_record(self, turn: Turn, sample: GenerateRequest, result: GenerateResult, parsed: ParsedOutput,
                     finish: str, index: int, turn_type: str, turn_id: str) -> TurnRecord:
        """The log's record of one choice (``sample``) of the request."""
        req = turn.req
        return TurnRecord(
            turn_id=turn_id,
            session_id=turn.session_id,
            turn_index=index,
            turn_type=turn_type,
            namespace=turn.state.namespace,
            model=self.settings.server.served_model_name,
            weight_version=result.weight_version,
            request_messages=_json(turn.messages),
            request_tools=json.dumps([t.model_dump(exclude_none=True) for t in req.tools]) if req.tools else None,
            request_params=_json({**sample.sampling_params.to_dict(), "n": req.n, **turn.params}),
            prompt_ids=list(turn.gen.input_ids),
            output_ids=list(result.output_ids),
            rollout_logprobs=list(result.output_logprobs or []),
            text=result.text,
            tool_calls=json.dumps(parsed.tool_calls) if parsed.tool_calls else None,
            finish_reason=finish,
            created_at=turn.created_at,
            completed_at=utcnow(),
            latency_ms=(time.perf_counter() - turn.t0) * 1000.0,
            weight_versions=_json(result.weight_versions or []),
            adapter=result.lora_path,
        )

    def _append(self, record: Any, what: str) -> None:
        """Append one record; a store that cannot write (disk full, I/O error, file size limit)
        becomes a 507 and nothing of the record counts as written (storage/wal.py: an append that
        raised is not acknowledged and leaves no torn line behind)."""
        try:
            self.store.append(record)
        except OSError as e:
            self.storage_error = f"{type(e).__name__}: {e.strerror or e}"
            log.error("could not record %s: %s", what, self.storage_error)
            raise GatewayError(507, f"could not record {what}: the data store refused the write "
                                    f"({e.strerror or type(e).__name__}); nothing was recorded, retry later",
                               "storage_error") from None
        self.storage_error = None

    def _write_next_states(self, records: list[NextStateRecord]) -> None:
        """Append next-state records that close turns already recorded (eviction, session_done,
        idle sweep). If the store refuses, they are kept and written with the next ones or by the
        sweep: the request that triggered them is not failed, its own turn is safe."""
        batch = self._unwritten_next_states + records
        if not batch:
            return
        try:
            self._append(batch, f"{len(batch)} next-state records (kept for retry)")
        except GatewayError:
            dropped = max(0, len(batch) - MAX_UNWRITTEN_NEXT_STATES)
            self._unwritten_next_states = batch[dropped:]
            if dropped:
                log.error("dropped the %d oldest unwritten next-state records", dropped)
            return
        self._unwritten_next_states = []
        for r in batch:
            self.metrics.next_states.labels(r.reason).inc()

    def _logprobs(self, result: GenerateResult, start: int, n_top: int | None) -> dict[str, Any]:
        return choice_logprobs(self._decode, result, start, n_top)

    def _head(self, turn: Turn, object_: str) -> dict[str, Any]:
        """The fields a turn's chat.completion, and each of its chat.completion.chunks, start with."""
        return {"id": f"chatcmpl-{turn.gen.rid}", "object": object_, "created": int(time.time()),
                "model": self.settings.server.served_model_name, "session_id": turn.session_id,
                "turn_type": turn.turn_type}


def _json(value: Any) -> str:
    """Compact JSON text for a log column (orjson: UTF-8 kept, about 5x faster than json.dumps);
    json for what orjson refuses (an integer beyond 64 bits in a client's message parts)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
