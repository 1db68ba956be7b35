"""Score one weight version on a fixed evaluation set through an engine: the promotion gate's measurement.

Every prompt is answered ``samples`` times with fixed seeds (answer j of prompt i: seed ``seed + i *
samples + j``) and all requests are in flight at once, so the engine batches them; a prompt's score
is the mean of ``score(i, answer)`` over its answers. The same set, samples, seeds, budget and
temperature give the same requests for every version: scores of two versions pair up prompt by
prompt, and a decision made on them replays identically.

Two kinds of set (``[gate] eval_set``): ``validation``, the fixed prompts and scorer of ``[gate]
evaluator`` (:func:`load_eval_set`); ``replay`` (:func:`replay_eval_set`), the request messages and
tools of recent judged main turns, each answer rated by the judge model (``clawrl.judge.rating``) or
by ``[gate] evaluator``. A replay set is named by its turn ids (part of its key and of the
promotion row), so the same turns give the same requests again; with fewer than
:data:`MIN_REPLAY_PROMPTS` of them it has no prompts, and the gate refuses for want of evidence.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clawrl.chat import ChatAdapter, ChatMessage, ToolDef
from clawrl.engine.types import Engine, GenerateRequest, SamplingParams
from clawrl.hooks import HookError, import_path

Prompts = Sequence[Sequence[dict[str, Any]]]  # chat message lists
Scorer = Callable[[int, str], float | Awaitable[float]]  # (prompt index, answer text) -> score in [0, 1]
Rater = Callable[[list[dict[str, Any]], str], float | Awaitable[float]]  # (request messages, answer) -> [0, 1]
MIN_REPLAY_PROMPTS = 2  # a paired comparison on one prompt has no spread to speak of


@dataclass(frozen=True)
class EvalSet:
    """The prompts and their scorer (what ``[gate] evaluator`` returns), and what makes a run of it
    comparable with another (``key``)."""

    prompts: Prompts
    score: Scorer
    samples: int
    seed: int
    max_tokens: int
    temperature: float
    key: str
    name: str = "validation"  # [gate] eval_set
    turn_ids: tuple[str, ...] | None = None  # replay: the turn each prompt is the request of
    tools: Sequence[Sequence[dict[str, Any]] | None] | None = None  # per prompt: the tools its request declared
    note: str = ""  # why the set has no prompts
    groups: tuple[str | None, ...] | None = None  # per prompt: the group an evaluator tagged it with

    def group_indices(self, group: str) -> list[int]:
        """The prompts of ``group``; ValueError naming the groups there are when it has none."""
        idx = [i for i, g in enumerate(self.groups or ()) if g == group]
        if not idx:
            known = sorted({g for g in self.groups or () if g})
            raise ValueError(f"[gate] guard: the evaluation set has no prompts in group {group!r} "
                             f"(its groups: {', '.join(known) or 'none'})")
        return idx


def _entries(prompts: Sequence[Any], evaluator: str) -> tuple[list[list[dict[str, Any]]], list[Any], list[Any]]:
    """(messages, tools, group) of each evaluator prompt: a message list, or a dict with "messages" and
    optionally "tools" (OpenAI tool definitions) and "group" (a name, for ``[gate] guard``)."""
    out: tuple[list, list, list] = ([], [], [])
    for i, p in enumerate(prompts):
        entry = p if isinstance(p, dict) else {"messages": p}
        if not isinstance(entry.get("messages"), (list, tuple)) or set(entry) - {"messages", "tools", "group"}:
            raise HookError(f"[gate] evaluator = {evaluator!r}: prompt {i} must be a message list or a dict with "
                            "'messages' and optionally 'tools' and 'group'")
        out[0].append(list(entry["messages"]))
        out[1].append(entry.get("tools") or None)
        out[2].append(entry.get("group"))
    return out


def load_eval_set(evaluator: str, *, size: int, samples: int, seed: int, max_tokens: int,
                  temperature: float, namespace: str | None = None) -> EvalSet:
    """The evaluation set of ``evaluator`` (import path of ``fn(size, seed) -> (prompts, score)``; a prompt
    is a message list, or a dict that also names its tools and group). An evaluator that takes a
    ``namespace`` argument is given the namespace whose adapter the gate judges (None: the shared policy),
    so each user's adapter can be scored by that user's wishes. Untagged prompts keep the key they always had."""
    fn = import_path(evaluator)
    if not callable(fn):
        raise HookError(f"[gate] evaluator = {evaluator!r} is not callable")
    takes_namespace = "namespace" in inspect.signature(fn).parameters
    raw, score = fn(size=size, seed=seed, **({"namespace": namespace} if takes_namespace else {}))
    if not raw or not callable(score):
        raise HookError(f"[gate] evaluator = {evaluator!r} must return (a non-empty list of prompts, a scorer)")
    prompts, tools, groups = _entries(raw, evaluator)
    tagged = any(tools) or any(groups)
    spec = {"evaluator": evaluator, "prompts": prompts, "samples": samples, "seed": seed, "max_tokens": max_tokens,
            "temperature": temperature, **({"tools": tools, "groups": groups} if tagged else {}),
            **({"namespace": namespace} if takes_namespace else {})}  # one namespace's scorer is not another's
    return EvalSet(prompts, score, samples, seed, max_tokens, temperature,
                   hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16],
                   tools=tools if any(tools) else None, groups=tuple(groups) if any(groups) else None)


def replay_eval_set(turns: Sequence[dict[str, Any]], rate: Rater, *, scorer: str, samples: int, seed: int,
                    max_tokens: int, temperature: float) -> EvalSet:
    """The replay set of ``turns`` (rows with turn_id, request_messages, request_tools; see
    ``clawrl.storage.promotions.replay_turns``), each answer scored by ``rate(messages, answer)``;
    ``scorer`` names the rater in the key (the judge config and rating prompt, or the hook's path)."""
    turn_ids = tuple(str(t["turn_id"]) for t in turns)
    note = ""
    if len(turns) < MIN_REPLAY_PROMPTS:
        note = (f"eval_set 'replay' found {len(turns)} judged main turn(s) under this judge configuration before "
                f"the candidate's batch; it needs {MIN_REPLAY_PROMPTS}")
        turns = []
    prompts = [json.loads(t["request_messages"]) for t in turns]
    tools = [json.loads(t["request_tools"]) if t.get("request_tools") else None for t in turns]
    blob = json.dumps({"eval_set": "replay", "scorer": scorer, "turn_ids": list(turn_ids), "samples": samples,
                       "seed": seed, "max_tokens": max_tokens, "temperature": temperature}, sort_keys=True)
    return EvalSet(prompts, lambda i, answer: rate(prompts[i], answer), samples, seed, max_tokens, temperature,
                   hashlib.sha256(blob.encode()).hexdigest()[:16], name="replay", turn_ids=turn_ids, tools=tools,
                   note=note)


async def answer_prompts(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet,
                         lora_path: str | None = None) -> list[list[str]]:
    """The answers of ``engine`` to every prompt, ``samples`` per prompt, by prompt; ``lora_path``: with
    the LoRA adapter the engine holds under that name (None: the weights alone)."""
    def request(i: int, j: int, ids: list[int]) -> GenerateRequest:
        return GenerateRequest(input_ids=ids, lora_path=lora_path, sampling_params=SamplingParams(
            max_new_tokens=eval_set.max_tokens, temperature=eval_set.temperature,
            sampling_seed=eval_set.seed + i * eval_set.samples + j))

    tools = eval_set.tools or [None] * len(eval_set.prompts)
    rendered = [adapter.render([ChatMessage.model_validate(m) for m in p],
                               [ToolDef.model_validate(t) for t in tools[i]] if tools[i] else None)
                for i, p in enumerate(eval_set.prompts)]
    results = await asyncio.gather(*(engine.generate(request(i, j, ids)) for i, ids in enumerate(rendered)
                                     for j in range(eval_set.samples)))
    texts = [r.text for r in results]
    return [texts[i * eval_set.samples:(i + 1) * eval_set.samples] for i in range(len(rendered))]


async def evaluate_version(engine: Engine, adapter: ChatAdapter, eval_set: EvalSet,
                           lora_path: str | None = None) -> tuple[list[float], float]:
    """(per-prompt scores, seconds) of the version ``engine`` serves now (with the adapter ``lora_path``)."""
    t0 = time.perf_counter()
    answers = await answer_prompts(engine, adapter, eval_set, lora_path)

    async def one(i: int, answer: str) -> float:
        s = eval_set.score(i, answer)
        return float(await s) if inspect.isawaitable(s) else float(s)

    flat = await asyncio.gather(*(one(i, a) for i, texts in enumerate(answers) for a in texts))
    n = eval_set.samples
    scores = [sum(flat[i * n:(i + 1) * n]) / n for i in range(len(answers))]
    bad = [s for s in scores if not 0.0 <= s <= 1.0]
    if bad:
        raise ValueError(f"evaluation scores must lie in [0, 1], got {bad[:3]}")
    return scores, time.perf_counter() - t0
