"""The embedded engine: an in-process torch engine with continuous batching, a KV cache and exact
log-probs, answering the same contract as SGLang (ref/sglang.md §2 and §4.1-4.2).

Threads. One background worker thread owns the model, the KV cache and the running batch; asyncio
callers (any loop, any number of loops) hand it requests under a lock and get results back through
``loop.call_soon_threadsafe``, so no engine call blocks an event loop. Control calls (pause,
continue, flush, weight swaps) run *on the worker, between steps*: a step never sees half a
weight update.

Scheduling. Each iteration the worker (1) admits waiting requests FIFO into free batch rows,
prefills them in one padded causal batch and samples their first token, then (2) runs one decode
step over every running sequence. A request that arrives while others decode therefore joins at
the next step. At most ``max_batch_size`` sequences run; the rest queue.

Pause and update semantics follow SGLang 0.5.23:

* while paused, new requests are held (queued), never refused;
* ``abort``: every request submitted before the pause ends now with its partial output and
  ``finish_reason.type == "abort"``; ``retract``: running requests drop their KV and go back to
  the queue, and after ``continue_generation`` they are re-prefilled from prompt + output so far
  and keep generating in the same call; ``in_place``: stop stepping, keep KV;
* a weight update while *not* paused drains: requests submitted before it finish, later ones
  wait, then the swap runs and serving resumes; while paused it runs at once. A request whose
  output spans an update reports two ``weight_versions`` spans.

Departures from SGLang, on purpose: no radix/prefix cache (``cached_tokens`` is always 0);
``stop_token_ids`` are ignored under ``ignore_eos`` *as in SGLang*; ``min_new_tokens`` masks the
stop tokens (SGLang's penalizer, so the returned log-probs see the mask) and also defers stop
strings until it is reached (SGLang lets a stop string end the request earlier); a disk update
keeps ``served_model_name`` (SGLang overwrites it with the path).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clawrl.engine.modeling import CausalLMRunner
from clawrl.engine.sampling import RowSampling, compute_prompt_logprobs, sample_next_tokens, top_logprobs
from clawrl.engine.types import (
    BadRequestError,
    EngineError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    UpdateResult,
)
from clawrl.models import load_causal_lm, load_tokenizer

PAUSE_MODES = ("abort", "retract", "in_place")
_PROMPT_LOGITS_CHUNK = 256  # positions per LM-head call when scoring a prompt: bounds memory at ~chunk·vocab floats
_PREFILL_PAD_SLACK = 1.25  # a prefill batch may spend at most 25% (+64 tokens) of its work on padding


class WeightLoadError(ValueError):
    """A checkpoint that cannot replace the served weights (missing, unreadable or mismatched)."""


# ------------------------------------------------------------------------------------------------
# weights


def served_tensors(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors a checkpoint must provide, and the aliases it may also carry.

    Returns ``(canonical, aliases)``: canonical maps each distinct parameter (and persistent
    buffer) to its first state-dict name; aliases maps the other names of a shared tensor (a tied
    ``lm_head.weight``) to the canonical one."""
    state = model.state_dict(keep_vars=True)
    canonical: dict[str, Tensor] = {}
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            canonical[name] = tensor
    return canonical, aliases


def check_weights(new: Mapping[str, Tensor], canonical: Mapping[str, Tensor], aliases: Mapping[str, str]) -> None:
    """Raise WeightLoadError unless ``new`` has every canonical key, no unknown key, and the
    served shapes (alias keys are allowed: they must have their tensor's shape and value)."""
    missing = sorted(set(canonical) - set(new))
    unknown = sorted(set(new) - set(canonical) - set(aliases))
    if missing or unknown:
        parts = []
        if missing:
            more = " ..." if len(missing) > 5 else ""
            parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:5])}{more}")
        if unknown:
            more = " ..." if len(unknown) > 5 else ""
            parts.append(f"unexpected {len(unknown)} key(s): {', '.join(unknown[:5])}{more}")
        raise WeightLoadError("; ".join(parts))
    for name, tensor in new.items():
        if not isinstance(tensor, Tensor):
            raise WeightLoadError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        want = canonical[aliases.get(name, name)].shape
        if tuple(tensor.shape) != tuple(want):
            raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} does not match the served {tuple(want)}")
    for alias, target in aliases.items():  # a tied pair must agree, or one of them would be dropped
        if alias in new and new[alias] is not new[target] and not torch.equal(new[alias], new[target]):
            raise WeightLoadError(f"{alias} is tied to {target} in the served model but their new values differ")


def load_checkpoint_tensors(model_dir: str | Path, model: torch.nn.Module) -> dict[str, Tensor]:
    """Read an HF safetensors checkpoint (one file or an indexed shard set) into new tensors with
    the served dtype and device, keyed by canonical name. Raises WeightLoadError; never touches
    ``model``."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    if not d.is_dir():
        raise WeightLoadError(f"model_path {str(d)!r} is not a directory")
    index = d / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(d.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise WeightLoadError(f"unreadable {index.name}: {e}") from None
    if not files:
        raise WeightLoadError(f"no *.safetensors file in {str(d)!r}")
    loaded: dict[str, Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise WeightLoadError(f"cannot read {f.name}: {e}") from None
        dup = set(part) & set(loaded)
        if dup:
            raise WeightLoadError(f"key(s) {sorted(dup)[:3]} appear in more than one file")
        loaded.update(part)
    canonical, aliases = served_tensors(model)
    check_weights(loaded, canonical, aliases)
    return {name: t.to(dtype=canonical[name].dtype, device=canonical[name].device)
            for name, t in loaded.items() if name in canonical}


def build_version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-output-token weight versions -> SGLang's ``[{"version","start","end"}]`` spans."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


# ------------------------------------------------------------------------------------------------
# per-request state


class _Sink:
    """Delivers one request's results from the worker thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool):
        self.loop, self.stream = loop, stream
        self.future: asyncio.Future = loop.create_future()
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def partial(self, result: GenerateResult) -> None:
        if self.queue is not None:
            self._post(self.queue.put_nowait, result)

    def finish(self, result: GenerateResult) -> None:
        if self.queue is not None:
            self._post(self.queue.put_nowait, result)
        else:
            self._post(_resolve, self.future, result, None)

    def fail(self, exc: BaseException) -> None:
        if self.queue is not None:
            self._post(self.queue.put_nowait, exc)
        else:
            self._post(_resolve, self.future, None, exc)


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled by the caller meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


@dataclass(eq=False)
class _Sequence:
    req: GenerateRequest
    prompt_ids: list[int]
    max_new: int  # effective cap: min(max_new_tokens, context room)
    stop_ids: frozenset[int]  # EOS + stop_token_ids; empty under ignore_eos (SGLang)
    sampling: RowSampling
    sink: _Sink
    order: int  # submission order: FIFO admission and drain/pause barriers
    started: float
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version per output token
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None
    prefilled_once: bool = False  # prompt logprobs are computed on the first prefill only
    row: int | None = None  # KV cache row while running
    cache_len: int = 0  # tokens whose K/V sit in the cache
    finish_reason: dict[str, Any] | None = None
    stop_trim: int | None = None  # text index where a matched stop string starts
    scanned_text_len: int = 0
    abort_message: str | None = None  # set by any thread; the worker ends the request
    num_retractions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class _PendingUpdate:
    apply: Callable[[], None]
    version: str | None
    model_path: str | None
    barrier: int  # requests with order <= barrier finish before the swap
    done: concurrent.futures.Future


# ------------------------------------------------------------------------------------------------


class EmbeddedEngine:
    """In-process engine implementing :class:`clawrl.engine.types.Engine` (see module docstring)."""

    def __init__(self, model_dir: Path, *, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 16,
                 max_context_len: int = 4096, weight_version: str = "0", served_model_name: str | None = None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_context_len < 2:
            raise ValueError("max_context_len must be >= 2")
        self._model_path = str(model_dir)
        self._tokenizer_path = str(model_dir)
        self._tokenizer = load_tokenizer(Path(model_dir))
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._model = load_causal_lm(Path(model_dir), dtype=dtype, device=device)
        self._runner = CausalLMRunner(self._model, max_context_len)
        self._cache = self._runner.new_cache(max_batch_size)
        self.vocab_size: int = int(self._model.config.vocab_size)
        self.eos_token_ids: frozenset[int] = self._find_eos_ids()
        self.max_batch_size = max_batch_size
        self.max_context_len = max_context_len
        self.served_model_name = served_model_name or Path(model_dir).name
        self._weight_version = str(weight_version)
        self._generator = torch.Generator()  # rows without a sampling_seed share it
        self._generator.seed()

        self._cv = threading.Condition(threading.RLock())
        # guarded by _cv: shared with the submitting threads
        self._waiting: deque[_Sequence] = deque()
        self._commands: list[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = []
        self._aborts_pending = False
        self._closing = False
        self._order = 0
        self._live: set[_Sequence] = set()
        # owned by the worker thread
        self._running: list[_Sequence] = []  # invariant: self._running[i].row == i
        self._paused = False
        self._pause_mode: str | None = None
        self._updates: deque[_PendingUpdate] = deque()
        self._thread: threading.Thread | None = None
        self._stats = {"steps": 0, "prefill_steps": 0, "max_batch_seen": 0, "requests_done": 0,
                       "tokens_generated": 0, "retractions": 0, "weight_updates": 0}

    # --------------------------------------------------------------------------------------------
    # public surface

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def model(self):
        return self._model

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: ``steps`` (decode steps), ``prefill_steps``, ``max_batch_seen`` (largest decode
        batch), ``requests_done``, ``tokens_generated``, ``retractions``, ``weight_updates``; and
        the state now: ``queued``, ``running``, ``paused``, ``pause_mode``, ``kv_capacity``."""
        with self._cv:
            queued = len(self._waiting)
        return {**self._stats, "queued": queued, "running": len(self._running), "paused": self._paused,
                "pause_mode": self._pause_mode, "weight_version": self._weight_version,
                "kv_capacity": self._cache.capacity}

    def reset_stats(self) -> None:
        """Zero the counters (benchmarks measure one run at a time)."""
        for k in self._stats:
            self._stats[k] = 0

    async def start(self) -> None:
        self._ensure_started()

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        await asyncio.to_thread(thread.join)
        self._thread = None

    async def __aenter__(self) -> EmbeddedEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        seq = self._submit(req, stream=False)
        try:
            return await seq.sink.future
        except asyncio.CancelledError:
            self._request_abort([seq], "the client cancelled the request")
            raise

    def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Validates now (raises BadRequestError), then yields cumulative partial results; the
        last one is finished. Must be called with an event loop running."""
        return self._stream(self._submit(req, stream=True))

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose rid starts with ``rid`` (SGLang's prefix match) or all; returns how many."""
        with self._cv:
            victims = [s for s in self._live if abort_all or (rid and s.req.rid.startswith(rid))]
        self._request_abort(victims, "aborted by request")
        return len(victims)

    async def model_info(self) -> dict[str, Any]:
        cfg = self._model.config
        return {
            "model_path": self._model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self._tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self._weight_version,
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(getattr(cfg, "architectures", None) or []),
        }

    async def health(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    async def update_weight_version(self, new_version: str) -> None:
        """Relabel the served weights without touching them (SGLang ``/update_weight_version``)."""

        def relabel(done: concurrent.futures.Future) -> None:
            self._weight_version = str(new_version)
            done.set_result(None)

        await self._call(relabel)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop stepping (module docstring: abort / retract / in_place); returns once done."""
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        with self._cv:
            barrier = self._order
        await self._call(self._do_pause, mode, barrier)

    async def continue_generation(self) -> None:
        await self._call(self._do_continue)

    async def flush_cache(self) -> bool:
        """Free the KV buffers; False (nothing done) while requests run and the engine is not paused,
        or while in-place-paused requests hold KV (SGLang 0.5.23)."""
        return await self._call(self._do_flush)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> UpdateResult:
        """Load an HF safetensors directory into new tensors (off the event loop, while serving),
        check every key and shape, then swap them in between two steps (draining first unless
        paused). Any failure leaves the old weights and label serving. ``weight_version`` None
        keeps the label."""
        try:
            new = await asyncio.to_thread(load_checkpoint_tensors, model_path, self._model)
        except WeightLoadError as e:
            return UpdateResult(False, f"weights not updated: {e}", self._weight_version)
        canonical, _ = served_tensors(self._model)

        def swap() -> None:
            # copy into the served storage (validated above, so no copy can fail half way) rather
            # than rebinding .data: the loaded tensors are views of the checkpoint's mmap, and
            # serving from them would tie the weights to that file and make later in-place syncs
            # page-fault through copy-on-write
            with torch.no_grad():
                for name, tensor in new.items():
                    canonical[name].copy_(tensor)

        return await self._update(swap, weight_version, model_path)

    async def update_weights_from_state_dict(self, state_dict: Mapping[str, Tensor],
                                             weight_version: str) -> UpdateResult:
        """The in-process sync path: check keys and shapes, then copy the tensors into the served
        parameters between two steps (draining first unless paused). The caller must not modify
        the tensors until this returns."""
        canonical, aliases = served_tensors(self._model)
        try:
            check_weights(state_dict, canonical, aliases)
        except WeightLoadError as e:
            return UpdateResult(False, f"weights not updated: {e}", self._weight_version)
        items = [(canonical[name], tensor) for name, tensor in state_dict.items() if name in canonical]

        def copy() -> None:
            with torch.no_grad():
                for param, tensor in items:
                    param.copy_(tensor)

        return await self._update(copy, weight_version, None)

    # --------------------------------------------------------------------------------------------
    # submission (caller threads)

    def _ensure_started(self) -> None:
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self._closing = False
            self._thread = threading.Thread(target=self._worker, name="clawrl-engine", daemon=True)
            self._thread.start()

    def _submit(self, req: GenerateRequest, stream: bool) -> _Sequence:
        loop = asyncio.get_running_loop()
        prompt = self._prompt_ids(req)
        sp = req.sampling_params
        sp.validate()
        if len(prompt) >= self.max_context_len:
            raise BadRequestError(f"prompt of {len(prompt)} tokens exceeds the context limit {self.max_context_len}")
        if req.logprob_start_len < -1:
            raise BadRequestError(f"logprob_start_len must be >= -1, got {req.logprob_start_len}")
        if req.logprob_start_len > len(prompt):
            raise BadRequestError(f"logprob_start_len {req.logprob_start_len} exceeds the prompt length {len(prompt)}")
        if req.top_logprobs_num < 0:
            raise BadRequestError(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")
        room = self.max_context_len - len(prompt)  # prompt + output <= max_context_len
        max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        stop_ids = frozenset() if sp.ignore_eos else self.eos_token_ids | frozenset(sp.stop_token_ids)
        generator = None
        if sp.sampling_seed is not None:
            generator = torch.Generator()
            generator.manual_seed(int(sp.sampling_seed))
        sampling = RowSampling(temperature=float(sp.temperature), top_k=int(sp.top_k), top_p=float(sp.top_p),
                               min_p=float(sp.min_p), generator=generator,
                               top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0)
        self._ensure_started()
        with self._cv:
            if self._closing:
                raise EngineError("the engine is closing")
            self._order += 1
            seq = _Sequence(req=req, prompt_ids=prompt, max_new=max_new, stop_ids=stop_ids, sampling=sampling,
                            sink=_Sink(loop, stream), order=self._order, started=time.perf_counter())
            self._waiting.append(seq)
            self._live.add(seq)
            self._cv.notify()
        return seq

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
            if not ids:
                raise BadRequestError("input_ids must be a non-empty list of token ids")
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequestError(f"input_ids contain {len(bad)} id(s) outside [0, {self.vocab_size}), "
                                      f"e.g. {bad[0]!r}")
            return ids
        if not isinstance(req.text, str) or not req.text:
            raise BadRequestError("exactly one of 'text' or 'input_ids' must be given, non-empty")
        with self._tok_lock:
            ids = self._tokenizer.encode(req.text)  # as SGLang: no chat template, tokenizer's defaults
        if not ids:
            raise BadRequestError("text tokenizes to no tokens")
        return ids

    async def _stream(self, seq: _Sequence) -> AsyncIterator[GenerateResult]:
        try:
            while True:
                item = await seq.sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if seq.finish_reason is None:
                self._request_abort([seq], "the client closed the stream")

    def _request_abort(self, seqs: list[_Sequence], message: str) -> None:
        if not seqs:
            return
        with self._cv:
            for s in seqs:
                if s.abort_message is None:
                    s.abort_message = message
            self._aborts_pending = True
            self._cv.notify()

    async def _call(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(*args, done)`` on the worker between steps; ``fn`` resolves ``done``."""
        self._ensure_started()
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, args, done))
            self._cv.notify()
        return await asyncio.wrap_future(done)

    async def _update(self, apply: Callable[[], None], version: str | None, model_path: str | None) -> UpdateResult:
        with self._cv:
            barrier = self._order
        return await self._call(self._do_update, apply, version, model_path, barrier)

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self._model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), self._model.config.eos_token_id,
                       self._tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        return frozenset(ids)

    # --------------------------------------------------------------------------------------------
    # the worker

    def _worker(self) -> None:
        with torch.inference_mode():  # thread-local: the worker never needs autograd
            self._serve()
        self._shutdown()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._closing or self._commands or self._aborts_pending or self._has_work()):
                    self._cv.wait()
                if self._closing:
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
                self._sweep_aborts()
            try:
                self._step()
            except Exception as e:
                self._fail_running(EngineError(f"engine step failed: {type(e).__name__}: {e}"))

    def _has_work(self) -> bool:  # caller holds _cv
        if self._updates and self._drained():
            return True
        if self._paused:
            return False
        if self._running:
            return True
        return bool(self._waiting) and len(self._running) < self.max_batch_size and self._admissible(self._waiting[0])

    def _admissible(self, seq: _Sequence) -> bool:
        return not self._updates or seq.order <= self._updates[0].barrier

    def _drained(self) -> bool:
        """No request that must finish before the head update is still running or queued."""
        if self._running:
            return False
        barrier = self._updates[0].barrier
        with self._cv:  # re-entrant; submitters append to _waiting concurrently
            return not any(s.order <= barrier for s in self._waiting)

    def _step(self) -> None:
        while self._updates and self._drained():
            self._apply_update(self._updates.popleft())
        if self._paused:
            return
        admitted = self._admit()
        if admitted:
            try:
                self._prefill(admitted)
            except Exception as e:  # e.g. out of memory on a huge prompt: fail those, keep the batch
                self._fail_admitted(admitted, EngineError(f"prefill failed: {type(e).__name__}: {e}"))
        if self._running:
            self._decode()
        if not self._running and self._cache.capacity:
            self._cache.reset()  # idle: give the KV memory back

    def _admit(self) -> list[_Sequence]:
        out: list[_Sequence] = []
        with self._cv:
            room = self.max_batch_size - len(self._running)
            while room > 0 and self._waiting and self._admissible(self._waiting[0]):
                seq = self._waiting.popleft()
                if seq.abort_message is not None:
                    self._waiting.appendleft(seq)
                    break  # the sweep will end it
                out.append(seq)
                room -= 1
        return out

    # prefill ------------------------------------------------------------------------------------

    def _prefill(self, seqs: list[_Sequence]) -> None:
        for seq in seqs:
            seq.row = len(self._running)
            self._running.append(seq)
        last_hidden: dict[int, Tensor] = {}
        for group in _plan_prefill_groups(seqs):
            prompts = [s.tokens for s in group]
            starts = [self._first_scored_position(s) for s in group]
            hidden = self._runner.prefill(prompts, [s.row for s in group], self._cache, starts)
            self._stats["prefill_steps"] += 1
            for s, h in zip(group, hidden):
                s.cache_len = len(s.tokens)
                if not s.prefilled_once and s.req.return_logprob and s.req.logprob_start_len >= 0:
                    self._score_prompt(s, h[:-1])
                s.prefilled_once = True
                last_hidden[id(s)] = h[-1]
        # one LM-head call for every new sequence: each call streams the whole (vocab x hidden) matrix
        last_logits = self._runner.lm_head(torch.stack([last_hidden[id(s)] for s in seqs]))  # (N, vocab)
        sampling = [i for i, s in enumerate(seqs) if s.max_new > 0]
        for i, s in enumerate(seqs):
            if s.max_new == 0:  # prefill-only scoring (the teacher path)
                if s.sampling.top_logprobs_num > 0:
                    lp = torch.log_softmax(_scale(last_logits[i], s.sampling)[None], dim=-1)
                    s.output_top = top_logprobs(lp, [s.sampling.top_logprobs_num])
                self._finish(s, {"type": "length", "length": 0})
        if sampling:
            self._sample_and_append([seqs[i] for i in sampling], last_logits[sampling])

    def _first_scored_position(self, seq: _Sequence) -> int:
        """First position whose logits the prefill must return (the last one is always needed)."""
        last = len(seq.tokens) - 1
        if not seq.prefilled_once and seq.req.return_logprob and seq.req.logprob_start_len >= 0:
            return min(seq.req.logprob_start_len, last)
        return last

    def _score_prompt(self, seq: _Sequence, hidden: Tensor) -> None:
        """SGLang's input logprobs from start s: entry 0 is None, entry j >= 1 is
        log P(prompt[s+j] | prompt[:s+j]), read from the logits at position s+j-1 (``hidden[j-1]``)."""
        s, prompt, top_num = seq.req.logprob_start_len, seq.prompt_ids, seq.sampling.top_logprobs_num
        targets = prompt[s + 1:]
        values: list[float | None] = [None] if s < len(prompt) else []
        tops: list[list[tuple[float, int]] | None] = [None] if s < len(prompt) else []
        for a in range(0, len(targets), _PROMPT_LOGITS_CHUNK):
            logits = self._runner.lm_head(hidden[a:a + _PROMPT_LOGITS_CHUNK])
            v, t = compute_prompt_logprobs(logits, targets[a:a + _PROMPT_LOGITS_CHUNK], top_num)
            values.extend(v)
            if t is not None:
                tops.extend(t)
        seq.input_logprobs = values
        seq.input_top = tops if top_num > 0 else None

    # decode -------------------------------------------------------------------------------------

    def _decode(self) -> None:
        running = self._running
        tokens = torch.tensor([s.output_ids[-1] for s in running], dtype=torch.long)
        positions = torch.tensor([s.cache_len for s in running], dtype=torch.long)
        logits = self._runner.decode(tokens, positions, self._cache)
        for s in running:
            s.cache_len += 1
        self._stats["steps"] += 1
        self._stats["max_batch_seen"] = max(self._stats["max_batch_seen"], len(running))
        self._sample_and_append(list(running), logits)

    def _sample_and_append(self, seqs: list[_Sequence], logits: Tensor) -> None:
        banned = None
        blocking = [i for i, s in enumerate(seqs)
                    if s.stop_ids and len(s.output_ids) < s.req.sampling_params.min_new_tokens]
        if blocking:
            banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            for i in blocking:
                banned[i, [t for t in seqs[i].stop_ids if t < logits.shape[-1]]] = True
        out = sample_next_tokens(logits, [s.sampling for s in seqs], self._generator, banned)
        version = self._weight_version
        self._stats["tokens_generated"] += len(seqs)
        for s, tid, lp, top in zip(seqs, out.token_ids, out.logprobs, out.top):
            s.output_ids.append(tid)
            s.output_logprobs.append(lp)
            s.output_top.append(top)
            s.versions.append(version)
            reason = self._check_finish(s, tid)
            if reason is not None:
                self._finish(s, reason)
            elif s.sink.stream:
                s.sink.partial(self._result(s))

    def _check_finish(self, seq: _Sequence, tid: int) -> dict[str, Any] | None:
        """SGLang's order: length first, then stop tokens, then stop strings."""
        n = len(seq.output_ids)
        if n >= seq.max_new:
            return {"type": "length", "length": n}
        sp = seq.req.sampling_params
        if n < sp.min_new_tokens:
            return None
        if tid in seq.stop_ids:
            return {"type": "stop", "matched": tid}
        if sp.stop:
            text = self._decode_text(seq.output_ids, sp.skip_special_tokens)
            # only text near the end can hold a new match (earlier text was scanned last step)
            start = max(0, seq.scanned_text_len - max(len(x) for x in sp.stop))
            seq.scanned_text_len = len(text)
            hits = [(i, stop) for stop in sp.stop if (i := text.find(stop, start)) >= 0]
            if hits:
                index, stop = min(hits)
                seq.stop_trim = index
                return {"type": "stop", "matched": stop}
        return None

    # finishing ----------------------------------------------------------------------------------

    def _finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        if seq.row is not None:
            self._release_row(seq)
        with self._cv:
            self._live.discard(seq)
        self._stats["requests_done"] += 1
        seq.sink.finish(self._result(seq))

    def _release_row(self, seq: _Sequence) -> None:
        """Free ``seq``'s row by moving the last running sequence into it (one row copy)."""
        hole = seq.row
        last = self._running.pop()
        if last is not seq:
            self._cache.move_row(last.row, hole, last.cache_len)
            last.row = hole
            self._running[hole] = last
        seq.row = None

    def _result(self, seq: _Sequence) -> GenerateResult:
        req, sp = seq.req, seq.req.sampling_params
        reason = seq.finish_reason
        text_ids = seq.output_ids
        stopped_by_token = reason is not None and reason["type"] == "stop" and isinstance(reason["matched"], int)
        if stopped_by_token and not sp.no_stop_trim:
            text_ids = seq.output_ids[:-1]  # the stop token is in output_ids, not in text
        text = self._decode_text(text_ids, sp.skip_special_tokens)
        if seq.stop_trim is not None and not sp.no_stop_trim:
            text = text[: seq.stop_trim]
        with_lp = req.return_logprob
        with_top = with_lp and req.top_logprobs_num > 0
        return GenerateResult(
            rid=req.rid,
            text=text,
            output_ids=list(seq.output_ids),
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            finish_reason=reason,
            weight_version=self._weight_version,
            output_logprobs=list(seq.output_logprobs) if with_lp else None,
            input_logprobs=seq.input_logprobs if with_lp and req.logprob_start_len >= 0 else None,
            output_top_logprobs=[list(t or []) for t in seq.output_top] if with_top else None,
            input_top_logprobs=seq.input_top if with_top else None,
            weight_versions=build_version_spans(seq.versions) if reason is not None else [],
            e2e_latency=time.perf_counter() - seq.started,
            cached_tokens=0,
            prompt_ids=list(seq.prompt_ids) if req.input_ids is None else None,
        )

    def _decode_text(self, ids: list[int], skip_special_tokens: bool) -> str:
        with self._tok_lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _abort(self, seq: _Sequence, message: str) -> None:
        self._finish(seq, {"type": "abort", "message": message, "status_code": None, "err_type": None})

    def _sweep_aborts(self) -> None:
        with self._cv:
            doomed_waiting = [s for s in self._waiting if s.abort_message is not None]
            for s in doomed_waiting:
                self._waiting.remove(s)
        for s in doomed_waiting:
            self._abort(s, s.abort_message)
        for s in [s for s in self._running if s.abort_message is not None]:
            self._abort(s, s.abort_message)

    def _fail_admitted(self, seqs: list[_Sequence], exc: EngineError) -> None:
        for s in seqs:
            if s.finish_reason is not None:
                continue
            if s.row is not None:
                self._release_row(s)
            s.finish_reason = {"type": "abort", "message": str(exc), "status_code": 500, "err_type": "EngineError"}
            with self._cv:
                self._live.discard(s)
            s.sink.fail(exc)

    def _fail_running(self, exc: EngineError) -> None:
        for s in list(self._running):
            s.finish_reason = {"type": "abort", "message": str(exc), "status_code": 500, "err_type": "EngineError"}
            with self._cv:
                self._live.discard(s)
            s.sink.fail(exc)
        self._running.clear()
        self._cache.reset()

    def _shutdown(self) -> None:
        exc = EngineError("the engine was closed")
        self._fail_running(exc)
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            commands, self._commands = self._commands, []
            self._live.clear()
        for s in waiting:
            s.sink.fail(exc)
        for _, _, done in commands:
            done.set_exception(exc)
        for u in self._updates:
            u.done.set_exception(exc)
        self._updates.clear()
        self._paused, self._pause_mode = False, None

    # control commands (run on the worker; each resolves ``done``) -------------------------------

    def _do_pause(self, mode: str, barrier: int, done: concurrent.futures.Future) -> None:
        self._paused, self._pause_mode = True, mode
        if mode == "abort":
            with self._cv:
                doomed = [s for s in self._waiting if s.order <= barrier]
                for s in doomed:
                    self._waiting.remove(s)
            for s in doomed + [s for s in self._running if s.order <= barrier]:
                self._abort(s, "generation paused (abort mode)")
        elif mode == "retract":
            retracted = list(self._running)
            for s in reversed(retracted):
                self._release_row(s)
                s.cache_len = 0
                s.num_retractions += 1
            self._stats["retractions"] += len(retracted)
            with self._cv:  # back to the queue, in submission order, ahead of later arrivals
                self._waiting = deque(sorted([*retracted, *self._waiting], key=lambda s: s.order))
        if not self._running:
            self._cache.reset()
        done.set_result(None)

    def _do_continue(self, done: concurrent.futures.Future) -> None:
        self._paused, self._pause_mode = False, None
        done.set_result(None)

    def _do_flush(self, done: concurrent.futures.Future) -> None:
        with self._cv:
            busy = bool(self._running) or (bool(self._waiting) and not self._paused)
        if not busy:
            self._cache.reset()
        done.set_result(not busy)

    def _do_update(self, apply: Callable[[], None], version: str | None, model_path: str | None, barrier: int,
                   done: concurrent.futures.Future) -> None:
        update = _PendingUpdate(apply, version, model_path, barrier, done)
        if self._paused:
            self._apply_update(update)  # the pause already stopped the stepping: swap now
        else:
            self._updates.append(update)  # drain first (see _step)

    def _apply_update(self, update: _PendingUpdate) -> None:
        try:
            update.apply()
        except Exception as e:  # copy failed part-way (e.g. dtype): report, keep the label
            update.done.set_result(UpdateResult(False, f"weights update failed: {type(e).__name__}: {e}",
                                                self._weight_version))
            return
        if update.version is not None:
            self._weight_version = str(update.version)
        if update.model_path is not None:
            self._model_path = update.model_path
        if not self._running:  # in_place-paused requests keep their (now stale) KV, as in SGLang
            self._cache.reset()
        self._stats["weight_updates"] += 1
        update.done.set_result(UpdateResult(True, "Succeeded to update model weights.", self._weight_version))


def _scale(logits: Tensor, row: RowSampling) -> Tensor:
    return logits if row.greedy else logits / row.temperature


def _plan_prefill_groups(seqs: list[_Sequence]) -> list[list[_Sequence]]:
    """Split a prefill into right-padded batches of similar lengths, so padding stays a small
    fraction of the work: sort by length and cut whenever padding would exceed the slack."""
    ordered = sorted(seqs, key=lambda s: len(s.tokens))
    groups: list[list[_Sequence]] = []
    group: list[_Sequence] = []
    real = 0
    for s in ordered:
        n = len(s.tokens)
        if group and n * (len(group) + 1) > _PREFILL_PAD_SLACK * (real + n) + 64:
            groups.append(group)
            group, real = [], 0
        group.append(s)
        real += n
    if group:
        groups.append(group)
    return groups
