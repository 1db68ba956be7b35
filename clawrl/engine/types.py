"""The engine contract, shared by the embedded engine and the SGLang client.

Field names and meanings follow SGLang's native ``/generate`` API (SGLang 0.5.23): a
:class:`GenerateRequest` is one prompt of an SGLang request body and a :class:`GenerateResult` its
response. Both implementations take and return these typed records; the SGLang JSON is read by
constructing the request models (invalid input raises :class:`BadRequestError`) and by
:meth:`GenerateResult.from_sglang`, and written by :meth:`GenerateRequest.to_sglang` and
:meth:`GenerateResult.to_sglang`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from clawrl.ids import new_id

PauseMode = Literal["abort", "retract", "in_place"]

# vLLM's default max_logprobs and OpenAI's top_logprobs limit. Uncapped, one request could ask for
# the whole vocabulary at every position: 28 tokens at k = 10**6 made a 45 MB response here.
MAX_TOP_LOGPROBS = 20
MAX_PARALLEL_SAMPLES = 64  # sampling_params.n


class EngineError(RuntimeError):
    """The engine could not serve a request (unreachable, timed out, internal failure)."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the configured timeout (the gateway maps this to 504)."""


class EngineUnreachableError(EngineError):
    """The engine never answered or its connection broke (refused, reset, closed mid-body): a request
    that met this may be sent again to another engine without anyone having seen an answer."""


class EngineOverloadedError(EngineError):
    """The engine's request queue is full (SGLang answers HTTP 503; the gateway too, with Retry-After)."""


class BadRequestError(ValueError):
    """A request the engine refuses (SGLang answers these with HTTP 400)."""


class UnknownKeyError(BadRequestError):
    """``sampling_params`` holds a key SGLang does not know (SGLang 0.5.22+ refuses these too)."""


# Known SGLang sampling_params keys the embedded engine does not implement: accepted only at their
# no-op value, refused with a message that says so otherwise, rather than silently ignored.
_NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop_regex": None,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "custom_params": None, "beam_width": None, "watermark": None,
}
_BOOL = "true or false"


class _Refusing(BaseModel):
    """A request model whose invalid input raises BadRequestError: a validator's own message, else
    ``<field> must be <the field's description>, got <value>``."""

    _prefix: ClassVar[str] = ""  # how messages name the model's fields

    def __init__(self, /, **data: Any) -> None:  # positional-only: a JSON key "self" is just a key
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise self._refusal(e) from None

    @classmethod
    def _refusal(cls, e: ValidationError) -> BadRequestError:
        errors = e.errors(include_url=False)
        cause = errors[0].get("ctx", {}).get("error")
        if isinstance(cause, BadRequestError):  # a nested model's refusal, a rule across fields
            return cause
        unknown = sorted(str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden")
        if unknown:
            return UnknownKeyError(f"unknown {cls._prefix.rstrip('.')} key(s): {', '.join(unknown)}")
        name = str(errors[0]["loc"][0])
        rule = cls.model_fields[name].description
        return BadRequestError(f"{cls._prefix}{name} must be {rule}, got {errors[0]['input']!r:.40}")


class SamplingParams(_Refusing):
    """SGLang 0.5.23's ``sampling_params``: the keys this engine implements, with SGLang's defaults.
    :meth:`from_dict` reads the JSON object, where other SGLang keys pass only at their no-op value."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _prefix: ClassVar[str] = "sampling_params."

    # capped at the context room; 0 = score the prompt only; None = up to the context limit
    max_new_tokens: int | None = Field(128, ge=0, strict=True, description="a non-negative integer")
    min_new_tokens: int = Field(0, ge=0, strict=True, description="a non-negative integer")
    temperature: float = Field(1.0, ge=0, description=">= 0")  # <= 1e-6 means greedy
    top_p: float = Field(1.0, gt=0, le=1, description="in (0, 1]")
    top_k: Literal[-1] | Annotated[int, Field(ge=1, strict=True)] = Field(
        -1, description="-1 (the whole vocabulary) or >= 1")
    min_p: float = Field(0.0, ge=0, le=1, description="in [0, 1]")
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        (), description="a non-empty string or a list of them")
    stop_token_ids: tuple[Annotated[int, Field(ge=0, strict=True)], ...] = Field(
        (), description="a list of non-negative integers")
    ignore_eos: bool = Field(False, description=_BOOL)
    skip_special_tokens: bool = Field(True, description=_BOOL)
    spaces_between_special_tokens: bool = Field(True, description=_BOOL)
    no_stop_trim: bool = Field(False, description=_BOOL)
    # what torch seeds take
    sampling_seed: int | None = Field(None, ge=-(2**63), lt=2**64, strict=True, description="a 64-bit integer")
    n: int = Field(1, ge=1, le=MAX_PARALLEL_SAMPLES, strict=True,
                   description=f"in [1, {MAX_PARALLEL_SAMPLES}]: samples of the prompt (the HTTP route's parallel sampling)")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Read SGLang's ``sampling_params`` object: ``null`` is "not given" (but ``max_new_tokens``
        null is "up to the context limit"); raises BadRequestError naming the key."""
        kw: dict[str, Any] = {}
        for k, v in (d or {}).items():
            if k in _NEUTRAL_SAMPLING_VALUES:
                if v != _NEUTRAL_SAMPLING_VALUES[k]:
                    raise BadRequestError(f"sampling_params.{k} = {v!r} is not supported by this engine")
            elif k != "stream_interval" and (v is not None or k == "max_new_tokens"):  # streaming cadence: ignored
                kw[k] = v
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` object (``sampling_seed`` only when set)."""
        return self.model_dump(exclude={"sampling_seed"} if self.sampling_seed is None else None)


class GenerateRequest(_Refusing):
    """One prompt of SGLang's /generate body: exactly one of ``text`` / ``input_ids``. Keys this
    engine does not read are ignored (pydantic's default), and ``null`` is "not given", as in
    SGLang's io_struct."""

    input_ids: list[StrictInt] | None = Field(None, min_length=1, description="a non-empty list of token ids")
    text: str | None = Field(None, min_length=1, description="a non-empty string")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams, description="an object")
    return_logprob: bool = Field(False, description=_BOOL)
    # first prompt position to score (and < the prompt length); -1 = no prompt logprobs
    logprob_start_len: int = Field(-1, ge=-1, description=">= -1")
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description=f"in [0, {MAX_TOP_LOGPROBS}]")
    # ids whose log-probs are returned at every scored position (SGLang's token_ids_logprob)
    token_ids_logprob: list[StrictInt] | None = Field(None, description="a list of token ids")
    return_text_in_logprobs: bool = Field(False, description=_BOOL)
    return_prompt_token_ids: bool = Field(False, description=_BOOL)
    rid: str = Field(default_factory=new_id, description="a string")
    stream: bool = Field(False, description=_BOOL)
    # the LoRA adapter to decode with, by the name /load_lora_adapter registered it as (SGLang's lora_path);
    # None: the base alone
    lora_path: str | None = Field(None, min_length=1, description="the name of a loaded LoRA adapter")
    # which engine of several serves it (the gateway: the session): not part of SGLang's body; sent to
    # an SGLang router as its X-SMG-Routing-Key header
    routing_key: str | None = Field(None, exclude=True, description="a string")
    # a main turn of a session, whose answer may train the policy: a canary may serve it (clawrl.engine.canary)
    main_turn: bool = Field(False, exclude=True, description=_BOOL)

    @model_validator(mode="before")
    @classmethod
    def _from_json(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
            if isinstance(data.get("sampling_params"), Mapping):
                data["sampling_params"] = SamplingParams.from_dict(data["sampling_params"])
        return data

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise BadRequestError("exactly one of 'text' or 'input_ids' must be given")
        return self

    def samples(self) -> list[GenerateRequest]:
        """The ``sampling_params.n`` requests parallel sampling runs: sample i has rid ``<rid>_<i>``
        and, when a seed is set, seed ``sampling_seed + i`` (so the samples differ and a rerun
        reproduces each). Equal prompts in flight share one prefill in the embedded engine."""
        sp = self.sampling_params
        if sp.n == 1:
            return [self]
        return [self.model_copy(update={"rid": f"{self.rid}_{i}", "sampling_params": sp.model_copy(update={
            "n": 1, "sampling_seed": None if sp.sampling_seed is None else (sp.sampling_seed + i) % 2**64})})
            for i in range(sp.n)]

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's /generate body for this request."""
        body = self.model_dump(exclude={"sampling_params"}, exclude_none=True)
        return {**body, "sampling_params": self.sampling_params.to_dict()}


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
    # per scored prompt position, (logprob, id) of each id of the request's token_ids_logprob; entry 0 is None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    weight_versions: list[dict[str, Any]] = field(default_factory=list)  # spans over output tokens
    e2e_latency: float = 0.0
    cached_tokens: int = 0
    prompt_ids: list[int] | None = None  # the tokenized prompt (set when the request sent text)
    # the LoRA adapter that decoded it, by name (set by the gateway from its request: SGLang's answer does not say)
    lora_path: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_sglang(self, req: GenerateRequest, tokenizer: Any = None) -> dict[str, Any]:
        """SGLang's response JSON to ``req``; ``tokenizer`` decodes the triples' texts when ``req``
        asks for them (``return_text_in_logprobs``; "" without a tokenizer)."""

        def triples(pairs) -> list[list[Any]]:  # (logprob, id) pairs -> SGLang's [logprob, id, text|null]
            if not req.return_text_in_logprobs:
                return [[lp, t, None] for lp, t in pairs]
            return [[lp, t, tokenizer.decode([t]) if tokenizer is not None else ""] for lp, t in pairs]

        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens, "reasoning_tokens": 0,
            "num_retractions": 0, "weight_version": self.weight_version, "e2e_latency": self.e2e_latency}
        if self.finished:
            meta["weight_versions"] = self.weight_versions
        prompt_ids = req.input_ids if req.input_ids is not None else (self.prompt_ids or [])
        if req.return_logprob:
            meta["output_token_logprobs"] = triples(zip(self.output_logprobs or [], self.output_ids))
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            start = req.logprob_start_len
            scored = self.input_logprobs is not None and start >= 0
            meta["input_token_logprobs"] = triples(zip(self.input_logprobs, prompt_ids[start:])) if scored else []
            if self.output_top_logprobs is not None:
                meta["output_top_logprobs"] = [triples(row) for row in self.output_top_logprobs]
            if self.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [None if row is None else triples(row) for row in self.input_top_logprobs]
            if self.input_token_ids_logprobs is not None:
                meta["input_token_ids_logprobs"] = [None if row is None else triples(row)
                                                    for row in self.input_token_ids_logprobs]
        out = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if req.return_prompt_token_ids:
            out["prompt_token_ids"] = list(prompt_ids)
        return out

    @classmethod
    def from_sglang(cls, body: Mapping[str, Any]) -> GenerateResult:
        meta = body.get("meta_info") or {}
        out_lp = meta.get("output_token_logprobs")
        in_lp = meta.get("input_token_logprobs")
        out_top = meta.get("output_top_logprobs")
        in_top = meta.get("input_top_logprobs")
        in_ids = meta.get("input_token_ids_logprobs")
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
            input_token_ids_logprobs=[None if row is None else [(float(a[0]), int(a[1])) for a in row]
                                      for row in in_ids] if in_ids else None,
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
    # several workers behind a router (clawrl.engine.router): one row each (url, ok, weight_version, seconds, message)
    workers: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class LoRAUpdateResult:
    """The answer to loading or unloading a LoRA adapter (SGLang's ``LoRAUpdateOutput``)."""

    success: bool
    message: str  # SGLang's error_message: "" on success
    loaded_adapters: dict[str, str] = field(default_factory=dict)  # name -> path of every adapter registered now
    # several workers behind a router (clawrl.engine.router): one row each (url, ok, seconds, message)
    workers: tuple[dict[str, Any], ...] = ()

    def to_sglang(self) -> dict[str, Any]:
        body: dict[str, Any] = {"success": self.success, "error_message": self.message,
                                "loaded_adapters": self.loaded_adapters}
        return {**body, "workers": list(self.workers)} if self.workers else body

    @classmethod
    def from_sglang(cls, body: Any, status: int) -> LoRAUpdateResult:
        """From SGLang's JSON (``loaded_adapters`` values may be paths or LoRARef records)."""
        if not isinstance(body, Mapping) or "success" not in body:
            return cls(False, f"HTTP {status}: {str(body)[:200]}")
        def path(ref: Any) -> str:  # a path, or a LoRARef as an object or (msgspec array_like) a list
            return str(ref.get("lora_path") if isinstance(ref, Mapping) else ref[2] if isinstance(ref, list) else ref)

        loaded = {str(k): path(v) for k, v in (body.get("loaded_adapters") or {}).items()}
        return cls(bool(body["success"]) and status == 200, str(body.get("error_message") or ""), loaded,
                   tuple(body.get("workers") or ()))


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
