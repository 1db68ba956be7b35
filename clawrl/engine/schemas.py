"""Request bodies of the SGLang-compatible engine server: their parsing and their OpenAPI documentation.

The routes read their JSON by hand, as SGLang does (its error shapes differ per failure), so the
bodies are declared to OpenAPI by ``$ref`` (:func:`body_doc`) and their schemas added to the
document's components (:func:`document_request_models`). Unknown keys are ignored, as SGLang's
io_struct dataclasses do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from clawrl.engine.types import BadRequestError, GenerateRequest

# vLLM's default max_logprobs and OpenAI's top_logprobs limit. Uncapped, one request could ask for
# the whole vocabulary at every position: 28 tokens at k = 10**6 made a 45 MB response here.
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = False


class UpdateWeightsFromDiskBody(_Body):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: relabelling aborts everything in flight


class WeightUpdateSessionBody(_Body):
    selector: Literal["all", "target", "draft"] = "all"


class AbortRequestBody(_Body):
    rid: str = ""
    abort_all: bool = False


class TokenizeBody(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    prompt: str | list[str] | SkipJsonSchema[None] = None  # exactly one of prompt / messages
    messages: list[dict[str, Any]] | SkipJsonSchema[None] = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(_Body):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class SamplingParamsBody(BaseModel):
    """The ``sampling_params`` keys this engine implements (OpenAPI only: /generate validates by
    hand, as SGLang does; other SGLang keys are accepted only at their no-op value)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(128, ge=0)  # capped at the context room; 0 = score the prompt
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 or >= 1
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = Field(1, ge=1, le=1)


_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]  # ids must also be < the vocabulary size


class GenerateBody(_Body):
    """SGLang's /generate body, the fields this server reads (OpenAPI only, see SamplingParamsBody).
    Exactly one of ``text`` / ``input_ids``; a list of prompts is a batch."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})
    text: _Text | Annotated[list[_Text], Field(min_length=1)] | SkipJsonSchema[None] = None
    input_ids: _Ids | Annotated[list[_Ids], Field(min_length=1)] | SkipJsonSchema[None] = None
    # a batch may also send one sampling_params object and one rid per prompt
    sampling_params: SamplingParamsBody | None = None
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # and < the prompt length
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


REQUEST_MODELS = (GenerateBody, PauseGenerationBody, ContinueGenerationBody, UpdateWeightsFromDiskBody,
                  WeightUpdateSessionBody, UpdateWeightVersionBody, AbortRequestBody, TokenizeBody, DetokenizeBody)


def body_doc(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body by hand: the body is ``model``."""
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def document_request_models(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the JSON schemas of request bodies that routes declare by ``$ref`` (routes that read
    their body by hand, see :func:`body_doc`) to the app's OpenAPI components. A name already
    there must hold the same schema."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in {**js.pop("$defs", {}), model.__name__: js}.items():
                    if schemas.setdefault(name, sub) != sub:
                        raise RuntimeError(f"OpenAPI component {name} is declared twice, differently")
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def is_batch(body: Mapping[str, Any]) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)) or isinstance(text, list)


def split_batch(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One /generate body per prompt; per-prompt ``sampling_params`` and ``rid`` lists are spread."""
    if not is_batch(body):
        return [dict(body)]
    key = "input_ids" if body.get("input_ids") is not None else "text"
    prompts = body[key]
    if not prompts:
        raise BadRequestError(f"{key} is an empty batch")
    n = len(prompts)
    sps, rids = body.get("sampling_params"), body.get("rid")
    if isinstance(sps, list) and len(sps) != n:
        raise BadRequestError(f"sampling_params has {len(sps)} entries for a batch of {n} prompts")
    if rids is not None and (not isinstance(rids, list) or len(rids) != n):
        raise BadRequestError(f"rid must be a list of {n} ids for a batch of {n} prompts")
    items = []
    for i, prompt in enumerate(prompts):
        item = {**body, key: prompt}
        if isinstance(sps, list):
            item["sampling_params"] = sps[i]
        if rids is not None:
            item["rid"] = rids[i]
        items.append(item)
    return items


def parse_generate(item: Mapping[str, Any]) -> GenerateRequest:
    try:
        req = GenerateRequest.from_sglang(item)
    except BadRequestError:
        raise
    except (TypeError, ValueError) as e:  # e.g. "logprob_start_len": "x" -> int() fails
        raise BadRequestError(f"invalid /generate request: {e}") from None
    if req.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS}, got {req.top_logprobs_num}")
    return req
