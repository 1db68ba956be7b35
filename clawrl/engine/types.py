"""The engine contract, shared by the embedded engine and the SGLang client.

Field names and meanings follow SGLang's native ``/generate`` API (SGLang 0.5.23), so a
:class:`GenerateRequest` maps 1:1 onto an SGLang request body and a :class:`GenerateResult` onto
its response. Both implementations return these typed records; the HTTP layer converts them to and
from SGLang's JSON with :meth:`GenerateRequest.from_sglang` / :meth:`GenerateResult.to_sglang`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from clawrl.ids import new_id

PauseMode = Literal["abort", "retract", "in_place"]


class EngineError(RuntimeError):
    """The engine could not serve a request (unreachable, timed out, internal failure)."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the configured timeout (the gateway maps this to 504)."""


class BadRequestError(ValueError):
    """A request the engine refuses (SGLang answers these with HTTP 400)."""


# SGLang 0.5.23 sampling_params keys. Keys outside this set are rejected with 400, as SGLang does
# since 0.5.22. Keys inside it that the embedded engine does not implement are rejected too, with
# a message that says so, rather than silently ignored.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
        "stop_regex", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
        "no_stop_trim", "n", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
        "sampling_seed", "stream_interval", "custom_params", "beam_width", "watermark",
    }
)

# Known SGLang keys the embedded engine does not implement: accepted only at their no-op value.
_NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop_regex": None,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "custom_params": None, "beam_width": None, "watermark": None,
}
_IGNORED_SAMPLING_KEYS = frozenset({"stream_interval"})  # streaming cadence: harmless to ignore


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = 128  # 0 = score the prompt only; None = up to the context limit
    min_new_tokens: int = 0
    temperature: float = 1.0  # <= 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Validate an SGLang ``sampling_params`` object; raises BadRequestError naming the key."""
        d = dict(d or {})
        unknown = sorted(set(d) - SGLANG_SAMPLING_KEYS)
        if unknown:
            raise BadRequestError(f"unknown sampling_params key(s): {', '.join(unknown)}")
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in cls.__dataclass_fields__:
                if v is not None or k in ("max_new_tokens", "sampling_seed"):
                    kw[k] = v
            elif k in _IGNORED_SAMPLING_KEYS or v == _NEUTRAL_SAMPLING_VALUES.get(k, object()):
                continue  # a no-op value of a feature we do not implement
            else:
                raise BadRequestError(f"sampling_params.{k} = {v!r} is not supported by this engine")
        if isinstance(kw.get("stop"), str):
            kw["stop"] = (kw["stop"],)
        for k in ("stop", "stop_token_ids"):
            if k in kw:
                kw[k] = tuple(kw[k])
        try:
            sp = cls(**kw)
        except TypeError as e:
            raise BadRequestError(f"invalid sampling_params: {e}") from None
        sp.validate()
        return sp

    def validate(self) -> None:
        def bad(msg: str) -> BadRequestError:
            return BadRequestError(f"sampling_params.{msg}")

        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0):
            raise bad(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise bad(f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad(f"top_k must be -1 or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.n != 1:
            raise bad("n > 1 is not supported; send n separate requests")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.sampling_seed is not None and not (
            isinstance(self.sampling_seed, int) and -(2**63) <= self.sampling_seed < 2**64  # what torch seeds take
        ):
            raise bad(f"sampling_seed must be a 64-bit integer, got {self.sampling_seed!r:.40}")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}  # shallow: asdict() is slow on a hot path
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return {k: v for k, v in d.items() if v is not None or k == "max_new_tokens"}


@dataclass
class GenerateRequest:
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position to score; -1 = no prompt logprobs
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str = field(default_factory=new_id)
    stream: bool = False

    @classmethod
    def from_sglang(cls, body: Mapping[str, Any]) -> GenerateRequest:
        """Parse an SGLang /generate body (single prompt); raises BadRequestError."""
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise BadRequestError("exactly one of 'text' or 'input_ids' must be given")
        if ids is not None:
            if not isinstance(ids, list) or not ids:
                raise BadRequestError("input_ids must be a non-empty list of token ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequestError("input_ids must be a flat list of integers (batches are not supported)")
        elif not isinstance(text, str) or not text:
            raise BadRequestError("text must be a non-empty string")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, Mapping):
            raise BadRequestError("sampling_params must be an object")
        start = body.get("logprob_start_len")
        req = cls(input_ids=ids, text=text, sampling_params=SamplingParams.from_dict(sp),
                  return_logprob=bool(body.get("return_logprob", False)),
                  logprob_start_len=-1 if start is None else int(start),
                  top_logprobs_num=int(body.get("top_logprobs_num") or 0),
                  return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                  stream=bool(body.get("stream", False)))
        if body.get("rid"):
            req.rid = str(body["rid"])
        if req.top_logprobs_num < 0:
            raise BadRequestError("top_logprobs_num must be >= 0")
        if req.logprob_start_len < -1:
            raise BadRequestError("logprob_start_len must be >= -1")
        return req

    def to_sglang(self) -> dict[str, Any]:
        prompt = {"input_ids": list(self.input_ids)} if self.input_ids is not None else {"text": self.text}
        return {**prompt, "sampling_params": self.sampling_params.to_dict(), "return_logprob": self.return_logprob,
                "logprob_start_len": self.logprob_start_len, "top_logprobs_num": self.top_logprobs_num,
                "return_text_in_logprobs": self.return_text_in_logprobs, "rid": self.rid, "stream": self.stream}


@dataclass
class GenerateResult:
    rid: str
    text: str
    output_ids: list[int]  # untrimmed: includes the EOS / stop token
    prompt_tokens: int
    completion_tokens: int
    # {"type": "stop", "matched": ..} | {"type": "length", "length": N} | {"type": "abort", ..}; None while streaming
    finish_reason: dict[str, Any] | None
    weight_version: str
    output_logprobs: list[float] | None = None  # logprob of output_ids[i]
    input_logprobs: list[float | None] | None = None  # entry j: logprob of input_ids[s+j]; entry 0 is None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    weight_versions: list[dict[str, Any]] = field(default_factory=list)  # spans over output tokens
    e2e_latency: float = 0.0
    cached_tokens: int = 0
    prompt_ids: list[int] | None = None  # the tokenized prompt (set when the request sent text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_sglang(self, decode_token: Callable[[int], str] | None = None, with_logprobs: bool = False,
                  input_ids: list[int] | None = None, logprob_start_len: int = -1) -> dict[str, Any]:
        """SGLang's response JSON. ``decode_token(id) -> str``, when given, fills the triples' texts."""

        def triples(pairs) -> list[list[Any]]:  # (logprob, id) pairs -> SGLang's [logprob, id, text|null]
            return [[lp, t, decode_token(t) if decode_token else None] for lp, t in pairs]

        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens, "reasoning_tokens": 0,
            "num_retractions": 0, "weight_version": self.weight_version, "e2e_latency": self.e2e_latency}
        if self.finished:
            meta["weight_versions"] = self.weight_versions
        if with_logprobs:
            meta["output_token_logprobs"] = triples(zip(self.output_logprobs or [], self.output_ids))
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            ids = input_ids if input_ids is not None else (self.prompt_ids or [])
            scored = self.input_logprobs is not None and logprob_start_len >= 0
            meta["input_token_logprobs"] = triples(zip(self.input_logprobs, ids[logprob_start_len:])) if scored else []
            if self.output_top_logprobs is not None:
                meta["output_top_logprobs"] = [triples(row) for row in self.output_top_logprobs]
            if self.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [None if row is None else triples(row) for row in self.input_top_logprobs]
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    @classmethod
    def from_sglang(cls, body: Mapping[str, Any]) -> GenerateResult:
        meta = body.get("meta_info") or {}
        out_lp = meta.get("output_token_logprobs")
        in_lp = meta.get("input_token_logprobs")
        out_top = meta.get("output_top_logprobs")
        in_top = meta.get("input_top_logprobs")
        return cls(
            rid=str(meta.get("id", "")),
            text=body.get("text", ""),
            output_ids=list(body.get("output_ids") or []),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", 0)),
            finish_reason=meta.get("finish_reason"),
            weight_version=str(meta.get("weight_version", "default")),
            output_logprobs=[float(x[0]) for x in out_lp] if out_lp is not None else None,
            input_logprobs=[None if x[0] is None else float(x[0]) for x in in_lp] if in_lp else None,
            output_top_logprobs=[[(float(a[0]), int(a[1])) for a in row or []] for row in out_top] if out_top else None,
            input_top_logprobs=[None if row is None else [(float(a[0]), int(a[1])) for a in row] for row in in_top]
            if in_top else None,
            weight_versions=list(meta.get("weight_versions") or []),
            e2e_latency=float(meta.get("e2e_latency") or 0.0),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            prompt_ids=body.get("prompt_token_ids"),
        )


@dataclass(frozen=True)
class UpdateResult:
    success: bool
    message: str
    weight_version: str | None = None


@runtime_checkable
class Engine(Protocol):
    """What the gateway, the judge and the trainer need from a serving engine."""

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Cumulative partial results (SGLang's default streaming); the last one is finished."""
        ...

    async def model_info(self) -> dict[str, Any]: ...

    async def health(self) -> bool: ...

    async def pause_generation(self, mode: PauseMode = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> UpdateResult: ...

    async def close(self) -> None: ...
