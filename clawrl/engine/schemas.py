"""Request bodies of the SGLang-compatible engine server, and /generate's batch form.

The control routes take their bodies as pydantic models, as SGLang's do; unknown keys are
ignored (pydantic's default), as SGLang's io_struct dataclasses do. /generate reads its JSON by
hand (its error shapes differ per failure, as in SGLang) into
:class:`~clawrl.engine.types.GenerateRequest` s, so its body is declared to OpenAPI by ``$ref``
(:data:`GENERATE_DOC`) and its schema added to the document's components
(:func:`document_generate_body`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from clawrl.engine.types import BadRequestError, GenerateRequest, SamplingParams


class PauseGenerationBody(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(BaseModel):
    torch_empty_cache: bool = False  # nothing to empty on this engine


class UpdateWeightsFromDiskBody(BaseModel):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightVersionBody(BaseModel):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: relabelling aborts everything in flight


class LoadLoRAAdapterBody(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT directory on the engine's machine
    pinned: bool = False  # SGLang keeps a pinned adapter in GPU memory; here every adapter in use stays held


class UnloadLoRAAdapterBody(BaseModel):
    lora_name: str = Field(min_length=1)


class AbortRequestBody(BaseModel):
    rid: str = ""
    abort_all: bool = False


class TokenizeBody(BaseModel):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    prompt: str | list[str] | SkipJsonSchema[None] = None  # exactly one of prompt / messages
    messages: list[dict[str, Any]] | SkipJsonSchema[None] = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]  # ids must also be < the vocabulary size


class GenerateBody(GenerateRequest):
    """SGLang's /generate body (OpenAPI only: :func:`split_batch` and GenerateRequest read it).
    Exactly one of ``text`` / ``input_ids``; a list of prompts is a batch, which may also send one
    ``sampling_params`` object and one ``rid`` per prompt."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})
    text: _Text | Annotated[list[_Text], Field(min_length=1)] | SkipJsonSchema[None] = None
    input_ids: _Ids | Annotated[list[_Ids], Field(min_length=1)] | SkipJsonSchema[None] = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None


GENERATE_DOC = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": f"#/components/schemas/{GenerateBody.__name__}"}}}}}


def document_generate_body(app: FastAPI) -> None:
    """Add GenerateBody's JSON schema (and the models it uses) to the app's OpenAPI components,
    which /generate's body refers to. A name already there must hold the same schema."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            js = GenerateBody.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in {**js.pop("$defs", {}), GenerateBody.__name__: js}.items():
                if schemas.setdefault(name, sub) != sub:
                    raise RuntimeError(f"OpenAPI component {name} is declared twice, differently")
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def split_batch(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """One /generate body per prompt, and whether ``body`` is a batch (a list of prompts); a batch's
    per-prompt ``sampling_params``, ``rid`` and ``lora_path`` lists are spread."""
    ids, text = body.get("input_ids"), body.get("text")
    if not ((isinstance(ids, list) and ids and isinstance(ids[0], list)) or isinstance(text, list)):
        return [dict(body)], False
    key = "text" if isinstance(text, list) else "input_ids"
    prompts = body[key]
    if not prompts:
        raise BadRequestError(f"{key} is an empty batch")
    n = len(prompts)
    sps, rids, loras = body.get("sampling_params"), body.get("rid"), body.get("lora_path")
    for name, value in (("sampling_params", sps), ("lora_path", loras)):
        if isinstance(value, list) and len(value) != n:
            raise BadRequestError(f"{name} has {len(value)} entries for a batch of {n} prompts")
    if rids is not None and (not isinstance(rids, list) or len(rids) != n):
        raise BadRequestError(f"rid must be a list of {n} ids for a batch of {n} prompts")
    spread = {k: v for k, v in ((key, prompts), ("sampling_params", sps), ("rid", rids), ("lora_path", loras))
              if isinstance(v, list)}
    return [{**body, **{k: v[i] for k, v in spread.items()}} for i in range(n)], True
