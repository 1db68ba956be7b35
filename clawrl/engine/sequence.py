"""One request inside the embedded engine: what it has produced so far, when it ends, and how its
results reach the caller's event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.engine.lora import Adapter
from clawrl.engine.sampling import RowSampling
from clawrl.engine.types import GenerateRequest, GenerateResult

DecodeText = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


def build_version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-output-token weight versions -> SGLang's ``[{"version","start","end"}]`` spans."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def abort_reason(message: str, status_code: int | None = None, err_type: str | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclass(eq=False)
class Sequence:
    """One request's state on the worker."""

    req: GenerateRequest
    prompt_ids: list[int]
    max_new: int  # effective cap: min(max_new_tokens, context room)
    stop_ids: frozenset[int]  # EOS + stop_token_ids; empty under ignore_eos (SGLang)
    sampling: RowSampling
    stream: bool  # partial results are sent only for a stream
    # results (or the exception that ended the request) for the caller, on the caller's loop
    queue: asyncio.Queue[GenerateResult | BaseException] = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    order: int = 0  # submission order: FIFO admission and drain/pause barriers
    started: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version per output token
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None
    input_token_ids: list[list[tuple[float, int]] | None] | None = None  # token_ids_logprob per prompt position
    prefilled_once: bool = False  # prompt logprobs are computed on the first prefill only
    prefilling: bool = False  # holds a row, its tokens not all in the cache yet (chunked prefill)
    row: int | None = None  # KV cache row while running
    cache_len: int = 0  # tokens whose K/V sit in the cache
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    kv_epoch: int = -1  # the engine's weight epoch when this sequence's K/V began
    finish_reason: dict[str, Any] | None = None
    stop_trim: int | None = None  # text index where a matched stop string starts
    scanned_text_len: int = 0
    abort_message: str | None = None  # set by any thread; the worker ends the request
    adapter: Adapter | None = None  # its LoRA adapter (clawrl/engine/lora.py); None: the base model
    pinned: bool = False  # holds its adapter in memory (while it holds a row)

    def put(self, item: GenerateResult | BaseException) -> None:
        """Hand ``item`` from the worker thread to the caller's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def adapter_key(self) -> int:
        """What its K/V is computed under: its adapter's registration, 0 for the base model."""
        return 0 if self.adapter is None else self.adapter.uid

    @property
    def kv_need(self) -> int:
        """The most KV positions this sequence can come to hold: its prompt and every output token."""
        return len(self.prompt_ids) + self.max_new

    @property
    def scores_prompt(self) -> bool:
        """Prompt log-probs are still owed (they are computed on the first prefill only)."""
        return not self.prefilled_once and self.req.return_logprob and self.req.logprob_start_len >= 0

    def begin_prompt_scores(self, nothing: bool = False) -> None:
        """Empty prompt score lists; entry 0 (the start position itself) is None, as in SGLang,
        unless the start is the prompt's end (``nothing`` to score)."""
        first = [] if nothing or self.req.logprob_start_len >= len(self.prompt_ids) else [None]
        self.input_logprobs, self.input_top, self.input_token_ids = list(first), list(first), list(first)

    def add_prompt_scores(self, values: list[float], tops: list[list[tuple[float, int]]] | None,
                          token_ids: list[list[tuple[float, int]]] | None) -> None:
        """The scores of the next prompt positions: log-probs, top lists, ``token_ids_logprob`` pairs."""
        self.input_logprobs.extend(values)
        self.input_top.extend(tops or [])
        self.input_token_ids.extend(token_ids or [])

    def check_finish(self, tid: int, decode_text: DecodeText) -> dict[str, Any] | None:
        """The finish reason after appending ``tid``, if any. SGLang's order: length first, then
        stop tokens, then stop strings."""
        n = len(self.output_ids)
        if n >= self.max_new:
            return {"type": "length", "length": n}
        sp = self.req.sampling_params
        if n < sp.min_new_tokens:
            return None
        if tid in self.stop_ids:
            return {"type": "stop", "matched": tid}
        if sp.stop:
            text = decode_text(self.output_ids, sp.skip_special_tokens)
            # only text near the end can hold a new match (earlier text was scanned last step)
            start = max(0, self.scanned_text_len - max(len(x) for x in sp.stop))
            self.scanned_text_len = len(text)
            hits = [(i, stop) for stop in sp.stop if (i := text.find(stop, start)) >= 0]
            if hits:
                index, stop = min(hits)
                self.stop_trim = index
                return {"type": "stop", "matched": stop}
        return None

    def result(self, decode_text: DecodeText, weight_version: str) -> GenerateResult:
        """The result so far (cumulative), or the final one once ``finish_reason`` is set."""
        req, sp, reason = self.req, self.req.sampling_params, self.finish_reason
        text_ids = self.output_ids
        stopped_by_token = reason is not None and reason["type"] == "stop" and isinstance(reason["matched"], int)
        if stopped_by_token and not sp.no_stop_trim:
            text_ids = self.output_ids[:-1]  # the stop token is in output_ids, not in text
        text = decode_text(text_ids, sp.skip_special_tokens)
        if self.stop_trim is not None and not sp.no_stop_trim:
            text = text[: self.stop_trim]
        with_lp = req.return_logprob
        with_top = with_lp and req.top_logprobs_num > 0
        return GenerateResult(
            rid=req.rid, text=text, output_ids=list(self.output_ids), prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids), finish_reason=reason, weight_version=weight_version,
            output_logprobs=list(self.output_logprobs) if with_lp else None,
            input_logprobs=self.input_logprobs if with_lp and req.logprob_start_len >= 0 else None,
            output_top_logprobs=[list(t or []) for t in self.output_top] if with_top else None,
            input_top_logprobs=self.input_top if with_top else None,
            input_token_ids_logprobs=self.input_token_ids if with_lp and req.token_ids_logprob else None,
            # finished without output (aborted while waiting, a prefill-only score): an empty span of the version
            weight_versions=(build_version_spans(self.versions) or [{"version": weight_version, "start": 0, "end": 0}])
            if reason is not None else [],
            e2e_latency=time.perf_counter() - self.started, cached_tokens=self.cached_tokens,
            prompt_ids=list(self.prompt_ids) if req.input_ids is None else None,
        )


PREFILL_PAD_SLACK = 1.25  # a prefill batch may spend at most 25% (+64 tokens) of its work on padding


def plan_prefill_groups(seqs: list[Sequence], max_adapters: int = 0) -> list[list[Sequence]]:
    """Split a prefill into right-padded batches of similar lengths, so padding stays a small fraction of
    the work (sort by length and cut whenever padding would exceed the slack), each with at most
    ``max_adapters`` distinct LoRA adapters (a forward's slots)."""
    groups: list[list[Sequence]] = []
    group: list[Sequence] = []
    real = 0
    for s in sorted(seqs, key=lambda s: len(s.tokens)):
        n = len(s.tokens)
        adapters = {q.adapter_key for q in group if q.adapter is not None}
        if group and (n * (len(group) + 1) > PREFILL_PAD_SLACK * (real + n) + 64
                      or s.adapter is not None and s.adapter_key not in adapters and len(adapters) >= max_adapters):
            groups.append(group)
            group, real = [], 0
        group.append(s)
        real += n
    if group:
        groups.append(group)
    return groups
