"""The embedded engine's worker: one thread that owns the model, the KV cache and the running batch.

Callers on any event loop hand it sequences under a lock and get results back through
``loop.call_soon_threadsafe``, so no engine call blocks an event loop. Control calls (pause,
continue, flush, weight swaps) run *on the worker, between steps*: a step never sees half a weight update.

Each iteration the worker (1) admits waiting sequences FIFO into free batch rows while the KV budget
holds their longest possible length, (2) prefills at most ``chunked_prefill_size`` prompt tokens -
whole short prompts in right-padded causal batches of similar lengths, a long prompt one chunk per
step - and samples the first token of each prompt it completes, then (3) runs one decode step over
every running sequence whose prompt is in the cache (on CUDA at padded shapes, replayed from CUDA
graphs: :mod:`clawrl.engine.cuda_graphs`). A request that arrives while others decode joins at the
next step, a long prompt never stalls the others for more than one chunk, and an abort (a client
gone, a deadline) ends it at the next chunk. At most ``max_batch_size`` sequences run; the rest
queue (at most ``max_queued_requests``, beyond which :class:`EngineOverloadedError`). Running
sequences occupy cache rows ``0..B-1``: a finished one's row is filled by moving the last one in.

A request may name a LoRA adapter (clawrl/engine/lora.py): it starts once its adapter is in memory
(a cold one is read on another thread meanwhile, while the rest run), its K/V is cached under its
adapter only, and a prefill batch or decode step mixes the rows of up to ``max_loras_per_batch``
adapters (:class:`~clawrl.engine.lora_step.StepAdapters` says which; a decode step defers the
others' rows by a step, a prefill batches them apart).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from clawrl import runtime
from clawrl.engine.control import ControlCalls, PendingUpdate
from clawrl.engine.cuda_graphs import GraphedDecode
from clawrl.engine.lora import AdapterError
from clawrl.engine.lora_step import DenseStep, GroupedStep, OneAdapter, StepAdapters
from clawrl.engine.modeling import CausalLMRunner
from clawrl.engine.prefix_cache import PrefixCache
from clawrl.engine.sampling import compute_prompt_logprobs, sample_next_tokens, token_ids_logprobs, top_logprobs
from clawrl.engine.sequence import DecodeText, Sequence, abort_reason, plan_prefill_groups
from clawrl.engine.types import BadRequestError, EngineError, EngineOverloadedError

PROMPT_LOGITS_CHUNK = 256  # positions per LM-head call when scoring a prompt: bounds memory at ~chunk·vocab floats
PREFIX_BLOCK = 64  # tokens per block of the prefix cache


class Scheduler(ControlCalls):
    """The worker thread and everything it owns (see module docstring); ``decode_text`` turns
    output ids into text (stop strings, results)."""

    def __init__(self, runner: CausalLMRunner, decode_text: DecodeText, *, max_batch_size: int, weight_version: str,
                 chunked_prefill_size: int = 2048, max_total_tokens: int | None = None, max_queued_requests: int = 0,
                 prefix_cache_tokens: int = 0, cuda_graphs: bool = True, adapters: StepAdapters | None = None):
        self.runner, self.decode_text, self.max_batch_size = runner, decode_text, max_batch_size
        self.chunked_prefill_size, self.max_queued_requests = chunked_prefill_size, max_queued_requests
        self.cache = runner.new_cache(max_batch_size, max_total_tokens)
        graphed = runner.device.type == "cuda"  # padded fixed-shape steps, from CUDA graphs unless cuda_graphs is off
        self.decoder = GraphedDecode(runner, max_batch_size, capture=cuda_graphs) if graphed else runner
        self._keep_cache = graphed and cuda_graphs  # graphs read the cache by address: kept between bursts and updates
        self.prefix = PrefixCache(PREFIX_BLOCK, prefix_cache_tokens) if prefix_cache_tokens >= PREFIX_BLOCK else None
        self.adapters = adapters  # None: LoRA off
        self.epoch = 0  # weight updates so far: K/V begun before the last one is not of the served weights
        self.weight_version = weight_version
        self.generator = torch.Generator()  # rows without a sampling_seed share it
        self.generator.seed()
        self.cv = threading.Condition(threading.RLock())
        # guarded by cv: shared with the submitting threads
        self.waiting: deque[Sequence] = deque()
        self.live: set[Sequence] = set()
        self._commands: list[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = []
        self._aborts_pending = self.closing = False
        self._stalled = False  # the waiting requests that could start wait on their adapters' reads
        self._wakes = 0  # adapter reads ended (an admission that saw none end since it began may stall)
        self._order = 0
        # owned by the worker thread
        self.running: list[Sequence] = []  # invariant: self.running[i].row == i
        self.paused, self.pause_mode = False, None
        self._updates: deque[PendingUpdate] = deque()
        self._thread: threading.Thread | None = None
        self.counters = {"steps": 0, "prefill_steps": 0, "max_batch_seen": 0, "requests_done": 0,
                         "tokens_generated": 0, "retractions": 0, "weight_updates": 0}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.closing

    def start(self) -> None:
        with self.cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self.closing = False
            self._thread = threading.Thread(target=self._worker, name="clawrl-engine", daemon=True)
            self._thread.start()
            runtime.end_at_exit(self)

    async def stop(self) -> None:
        """End the worker: requests still queued or running fail with EngineError."""
        thread = self.end_thread()
        if thread is not None:
            await asyncio.to_thread(thread.join)
            self._thread = None

    def end_thread(self) -> threading.Thread | None:
        """Tell the worker to end after its current step; its thread, or None if none was started."""
        thread = self._thread
        if thread is not None:
            with self.cv:
                self.closing = True
                self.cv.notify_all()
        return thread

    def submit(self, seq: Sequence) -> None:
        self.start()
        with self.cv:
            if self.closing:
                raise EngineError("the engine is closing")
            if any(s.req.rid == seq.req.rid for s in self.live):  # /abort_request by rid must name one request
                raise BadRequestError(f"Duplicate request ID detected: {seq.req.rid}")  # SGLang's words
            if self.max_queued_requests and len(self.waiting) >= self.max_queued_requests:
                raise EngineOverloadedError(f"the request queue is full ({len(self.waiting)} waiting)")
            self._order += 1
            seq.order = self._order
            self.waiting.append(seq)
            self.live.add(seq)
            self._stalled = False
            self.cv.notify()

    def wake(self) -> None:
        """Something a stalled admission waited on happened (an adapter's read ended): try again."""
        with self.cv:
            self._stalled, self._wakes = False, self._wakes + 1
            self.cv.notify()

    def abort(self, seqs: list[Sequence], message: str) -> None:
        """Ask the worker to end ``seqs`` with their partial output (finish reason ``abort``)."""
        if not seqs:
            return
        with self.cv:
            for s in seqs:
                if s.abort_message is None:
                    s.abort_message = message
            self._aborts_pending = True
            self.cv.notify()

    def barrier(self) -> int:
        """The order of the latest submission: pause and update barriers are drawn here."""
        with self.cv:
            return self._order

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(*args, done)`` on the worker between steps; ``fn`` resolves ``done``."""
        self.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            self._commands.append((fn, args, done))
            self.cv.notify()
        return await asyncio.wrap_future(done)

    def stats(self) -> dict[str, Any]:
        queued, cache, prefix = len(self.waiting), self.cache, self.prefix  # len() of a deque is atomic
        tokens = len(prefix) * PREFIX_BLOCK if prefix else 0
        return {**self.counters, "queued": queued, "running": len(self.running), "paused": self.paused,
                "pause_mode": self.pause_mode, "weight_version": self.weight_version, **cache.memory_stats(),
                "prefix_cache_tokens": tokens, "prefix_cache_bytes": tokens * cache.slot_bytes,
                "prefix_cache_hits": prefix.hits if prefix else 0,
                "prefix_tokens_saved": prefix.tokens_saved if prefix else 0,
                "cuda_graphs": len(getattr(self.decoder, "graphs", ())), "fused_decode": self.runner.fused is not None,
                **(self.adapters.stats() if self.adapters else {})}

    def _worker(self) -> None:
        with torch.inference_mode():  # thread-local: the worker never needs autograd
            self._serve()
        self._shutdown()

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not (self.closing or self._commands or self._aborts_pending or self._has_work()):
                    self.cv.wait()
                if self.closing:
                    break
                commands, self._commands = self._commands, []
                sweep, self._aborts_pending = self._aborts_pending, False
            for fn, args, done in commands:
                try:
                    fn(*args, done)
                except Exception as e:  # a control call must never kill the worker
                    if not done.done():
                        done.set_exception(e)
            if sweep:
                self._abort_where(lambda s: s.abort_message is not None)
            try:
                self._step()
            except Exception as e:
                self._fail_running(EngineError(f"engine step failed: {type(e).__name__}: {e}"))

    def _has_work(self) -> bool:  # caller holds cv
        if self._updates and self._drained():
            return True
        if self.paused:
            return False
        return bool(self.running) or (bool(self.waiting) and self._admissible(self.waiting[0]) and not self._stalled)

    def _admissible(self, seq: Sequence) -> bool:
        return not self._updates or seq.order <= self._updates[0].barrier

    def _drained(self) -> bool:
        """No request that must finish before the head update is still running or queued."""
        if self.running:
            return False
        barrier = self._updates[0].barrier
        with self.cv:  # re-entrant; submitters append to waiting concurrently
            return not any(s.order <= barrier for s in self.waiting)

    def _step(self) -> None:
        while self._updates and self._drained():
            self._apply_update(self._updates.popleft())
        if self.paused:
            return
        self._admit()
        if any(s.prefilling for s in self.running):
            try:
                self._prefill()
            except Exception as e:  # e.g. out of memory on a huge prompt: fail those, keep the batch
                self._fail([s for s in self.running if s.prefilling],
                           EngineError(f"prefill failed: {type(e).__name__}: {e}"))
        if any(not s.prefilling for s in self.running):
            self._decode()
        if not self.running and self.cache.capacity and not self._keep_cache:
            self.cache.reset()  # idle: give the KV memory back, to the system too

    def _admit(self) -> None:
        """Waiting sequences, FIFO, into rows while the KV budget holds every running sequence at
        its longest (the cache is rows x the longest row); positions left over from longer requests
        that finished are dropped when they stand in the way. A sequence whose adapter is not in memory
        yet is passed over until it is (others behind it start); while memory is full of adapters in use,
        no other adapter's sequence starts (those running end, and free it)."""
        need = max((s.kv_need for s in self.running), default=0)
        failed: list[tuple[Sequence, AdapterError]] = []
        stalled = full = False
        with self.cv:
            wakes = self._wakes
            for seq in list(self.waiting):
                if len(self.running) >= self.max_batch_size or not self._admissible(seq) \
                        or seq.abort_message is not None:
                    break  # an aborted one: the sweep will end it
                if self.running and \
                        self.decoder.rows(len(self.running) + 1) * max(need, seq.kv_need) > self.cache.max_tokens:
                    break  # waits for room; alone it always fits (submit refused anything longer)
                if seq.adapter is not None:
                    try:
                        ready = None if full else self.adapters.admit(seq)
                    except AdapterError as e:
                        self.waiting.remove(seq)
                        failed.append((seq, e))
                        continue
                    full, stalled = full or ready is None, stalled or not ready
                    if not ready:
                        continue
                self.waiting.remove(seq)
                need = max(need, seq.kv_need)
                seq.row, seq.prefilling = len(self.running), True
                self.running.append(seq)
            self._stalled = stalled and not self.running and self._wakes == wakes
        for seq, e in failed:
            self._finish(seq, abort_reason(str(e), 400, "BadRequestError"), e)
        rows = self.decoder.rows(len(self.running))
        if self.running and max(rows, self.cache.rows) * max(self.cache.capacity, need) > self.cache.max_tokens:
            self.cache.shrink(rows, need)

    def _prefill(self) -> None:
        """At most ``chunked_prefill_size`` tokens of the prompts not yet in the cache, oldest first:
        whole short prompts batched, else the next chunk of one; the first token of every prompt
        completed is sampled."""
        budget = self.chunked_prefill_size
        whole: list[Sequence] = []
        done: list[tuple[Sequence, Tensor]] = []
        for s in [s for s in self.running if s.prefilling]:
            if s.cache_len == 0:
                s.kv_epoch = self.epoch
            if s.cache_len == 0 and self.prefix is not None:
                limit = len(s.tokens) - 1  # the last position is computed: its logits give the next token
                if s.scores_prompt:  # the positions scored are computed too
                    limit = min(limit, max(s.req.logprob_start_len, 0))
                s.cache_len = self.prefix.load(s.tokens, limit, self.cache, s.row, s.adapter_key)
                s.cached_tokens = max(s.cached_tokens, s.cache_len)
            left = len(s.tokens) - s.cache_len
            if s.cache_len == 0 and left <= budget:
                whole.append(s)
                budget -= left
            elif budget > 0 or not (whole or done):
                n = min(left, max(budget, 1))
                if (last := self._prefill_chunk(s, n)) is not None:
                    done.append((s, last))
                budget -= n
            if budget <= 0:
                break
        same_prompt: dict[Any, list[Sequence]] = {}  # one prefill for equal prompts (a judge's m votes)
        for s in whole:
            same_prompt.setdefault((s.adapter_key, *s.tokens) if not s.scores_prompt else id(s), []).append(s)
        twins = {id(same[0]): same[1:] for same in same_prompt.values()}
        per_batch = self.adapters.slots.slots if self.adapters is not None else 0
        for group in plan_prefill_groups([same[0] for same in same_prompt.values()], per_batch):
            # the first position whose logits are needed: the last one always is
            starts = [min(s.req.logprob_start_len, len(s.tokens) - 1) if s.scores_prompt else len(s.tokens) - 1
                      for s in group]
            hidden = self.runner.prefill([s.tokens for s in group], [s.row for s in group], self.cache, starts,
                                         self._prefill_lora(group))
            self.counters["prefill_steps"] += 1
            for s, h, start in zip(group, hidden, starts):
                s.cache_len = len(s.tokens)
                if s.scores_prompt:
                    self._score_prompt(s, h[:-1], start)
                done.append((s, h[-1]))
                for twin in twins[id(s)]:
                    self.cache.ensure(len(self.running), s.cache_len)
                    self.cache.move_row(s.row, twin.row, s.cache_len)  # a copy: both rows keep it
                    twin.cache_len = s.cache_len
                    done.append((twin, h[-1]))
        if done:
            self._first_tokens(done)

    def _prefill_chunk(self, seq: Sequence, n: int) -> Tensor | None:
        """The next ``n`` tokens of ``seq`` into its row; the last position's hidden state once all are in."""
        start, tokens = seq.cache_len, seq.tokens
        scoring = seq.scores_prompt and start + n > seq.req.logprob_start_len
        keep = max(0, seq.req.logprob_start_len - start) if scoring else n - 1
        hidden = self.runner.extend(tokens[start:start + n], seq.row, start, self.cache, keep, self._prefill_lora([seq]))
        self.counters["prefill_steps"] += 1
        seq.cache_len = start + n
        complete = seq.cache_len == len(tokens)
        if scoring:
            self._score_prompt(seq, hidden[:-1] if complete else hidden, start + keep)
        return hidden[-1] if complete else None

    def _prefill_lora(self, group: list[Sequence]) -> OneAdapter | GroupedStep | DenseStep | None:
        """The adapters of a prefill batch: none, one for all (its own tensors), or each prompt its own (slots, as
        in a decode step; plan_prefill_groups keeps them within the slots)."""
        adapters = [s.adapter for s in group]
        if adapters[0] is not None and all(a is adapters[0] for a in adapters):
            return OneAdapter(adapters[0].weights)
        if not any(adapters):
            return None
        return self.adapters.rows(adapters).step(width=max(len(s.tokens) for s in group), block=self.runner.row_block)

    def _first_tokens(self, done: list[tuple[Sequence, Tensor]]) -> None:
        seqs = [s for s, _ in done]
        for s in seqs:
            if s.scores_prompt and s.input_logprobs is None:  # from the prompt's end: nothing to score
                s.begin_prompt_scores(nothing=True)
            s.prefilling, s.prefilled_once = False, True
        # one LM-head call for every completed prompt: each call streams the whole (vocab x hidden) matrix
        last_logits = self.runner.lm_head(torch.stack([h for _, h in done]))  # (N, vocab)
        sampling = [i for i, s in enumerate(seqs) if s.max_new > 0]
        for i, s in enumerate(seqs):
            if s.max_new == 0:  # prefill-only scoring (the teacher path)
                if s.sampling.top_logprobs_num > 0:
                    logits = last_logits[i] if s.sampling.greedy else last_logits[i] / s.sampling.temperature
                    s.output_top = top_logprobs(torch.log_softmax(logits[None], dim=-1),
                                                [s.sampling.top_logprobs_num])
                self._finish(s, {"type": "length", "length": 0})
        if sampling:
            self._sample_and_append([seqs[i] for i in sampling], last_logits[sampling])

    def _score_prompt(self, seq: Sequence, hidden: Tensor, first: int) -> None:
        """SGLang's input logprobs from start s: entry 0 is None, entry j >= 1 is
        log P(prompt[s+j] | prompt[:s+j]), read from the logits at position s+j-1. ``hidden`` holds
        positions ``first ..`` (all of the prompt's from s on, or the next chunk of them)."""
        if seq.input_logprobs is None:
            seq.begin_prompt_scores()
        targets, ids = seq.prompt_ids[first + 1:first + 1 + len(hidden)], seq.req.token_ids_logprob
        for a in range(0, len(targets), PROMPT_LOGITS_CHUNK):
            logits = self.runner.lm_head(hidden[a:a + PROMPT_LOGITS_CHUNK])
            seq.add_prompt_scores(*compute_prompt_logprobs(logits, targets[a:a + PROMPT_LOGITS_CHUNK],
                                                           seq.sampling.top_logprobs_num),
                                  token_ids_logprobs(logits, ids) if ids else None)

    def _decode(self) -> None:
        """One step over every row; a row whose prompt is still being prefilled, or whose adapter waits for
        a later step (``max_loras_per_batch``), rides along on a placeholder token at its next position (its
        next chunk or step overwrites that K/V) and is not sampled."""
        running = self.running
        lora, deferred = None, [False] * len(running)
        if self.adapters is not None:
            lora, deferred = self.adapters.plan([None if s.prefilling else s.adapter for s in running])
        idle = [s.prefilling or late for s, late in zip(running, deferred)]
        tokens = torch.tensor([0 if skip else s.output_ids[-1] for s, skip in zip(running, idle)], dtype=torch.long)
        positions = torch.tensor([s.cache_len for s in running], dtype=torch.long)
        logits = self.decoder.decode(tokens, positions, self.cache, lora)
        decoding = [i for i, skip in enumerate(idle) if not skip]
        seqs = [running[i] for i in decoding]
        for s in seqs:
            s.cache_len += 1
        self.counters["steps"] += 1
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], len(seqs))
        self._sample_and_append(seqs, logits if len(seqs) == len(running) else logits[decoding])

    def _sample_and_append(self, seqs: list[Sequence], logits: Tensor) -> None:
        banned = None
        blocking = [i for i, s in enumerate(seqs)
                    if s.stop_ids and len(s.output_ids) < s.req.sampling_params.min_new_tokens]
        if blocking:
            banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            for i in blocking:
                banned[i, [t for t in seqs[i].stop_ids if t < logits.shape[-1]]] = True
        out = sample_next_tokens(logits, [s.sampling for s in seqs], self.generator, banned)
        version = self.weight_version
        self.counters["tokens_generated"] += len(seqs)
        for s, tid, lp, top in zip(seqs, out.token_ids, out.logprobs, out.top):
            s.output_ids.append(tid)
            s.output_logprobs.append(lp)
            s.output_top.append(top)
            s.versions.append(version)
            reason = s.check_finish(tid, self.decode_text)
            if reason is not None:
                self._finish(s, reason)
            elif s.stream:
                s.put(s.result(self.decode_text, self.weight_version))

    def _finish(self, seq: Sequence, reason: dict[str, Any], error: EngineError | None = None) -> None:
        """End ``seq``: its caller gets the final result, or ``error``."""
        seq.finish_reason = reason
        if seq.row is not None:
            # only K/V of the weights serving now (not of a request that ran on across an in-place update)
            if self.prefix is not None and error is None and seq.kv_epoch == self.epoch \
                    and seq.cache_len >= PREFIX_BLOCK:
                self.prefix.store(seq.tokens[:seq.cache_len], self.cache, seq.row, seq.adapter_key)
            self._release_row(seq)
        if self.adapters is not None:
            self.adapters.release(seq)
        with self.cv:
            self.live.discard(seq)
        if error is not None:
            seq.put(error)
            return
        self.counters["requests_done"] += 1
        seq.put(seq.result(self.decode_text, self.weight_version))

    def _release_row(self, seq: Sequence) -> None:
        """Free ``seq``'s row by moving the last running sequence into it (one row copy)."""
        hole = seq.row
        if self.adapters is not None:  # a retracted sequence holds its adapter again when it starts again
            self.adapters.release(seq)
        last = self.running.pop()
        if last is not seq:
            self.cache.move_row(last.row, hole, last.cache_len)
            last.row = hole
            self.running[hole] = last
        seq.row = None

    def _abort_where(self, doomed: Callable[[Sequence], bool], message: str | None = None) -> None:
        """End the waiting and running sequences ``doomed`` picks with their partial output (finish
        reason ``abort`` with ``message``, else the sequence's own abort message)."""
        with self.cv:
            waiting = [s for s in self.waiting if doomed(s)]
            for s in waiting:
                self.waiting.remove(s)
        for s in waiting + [s for s in self.running if doomed(s)]:
            self._finish(s, abort_reason(message or s.abort_message))

    def _fail(self, seqs: list[Sequence], exc: EngineError) -> None:
        """End ``seqs`` with ``exc`` (their callers get the exception, not a result)."""
        for s in seqs:
            if s.finish_reason is None:
                self._finish(s, abort_reason(str(exc), 500, "EngineError"), exc)

    def _fail_running(self, exc: EngineError) -> None:
        """After a failed step: no cache row is trusted or moved any more, the whole cache goes."""
        running, self.running = self.running, []
        for s in running:
            s.row = None
        self._fail(running, exc)
        self.cache.reset()

    def _shutdown(self) -> None:
        exc = EngineError("the engine was closed")
        self._fail_running(exc)
        with self.cv:
            waiting, self.waiting = list(self.waiting), deque()
            commands, self._commands = self._commands, []
        self._fail(waiting, exc)
        for _, _, done in commands:
            done.set_exception(exc)
        for u in self._updates:
            u.done.set_exception(exc)
        self._updates.clear()
        self.paused, self.pause_mode = False, None
