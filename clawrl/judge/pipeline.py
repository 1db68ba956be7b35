"""Judge one turn: PRM votes and hint votes (concurrently), teacher log-probs, the sample, its fate.

Every turn that reaches :meth:`Judge.judge` leaves with exactly one :class:`~clawrl.records.FateRecord`
(nothing is dropped silently) and, when the judge ran, a :class:`~clawrl.records.JudgeVerdict`
holding every raw judge output. Which turns make samples:

| method  | judge calls    | sample when          | reward          | teacher log-probs | else (fate) |
|---------|----------------|----------------------|-----------------|-------------------|-------------|
| grpo    | m PRM votes    | score = ±1           | score           | none              | score_zero  |
| opd     | m PRM + h hint | a usable hint        | 0.0             | prompt + hint     | no_hint     |
| combine | m PRM + h hint | score = ±1 or a hint | score (±1 or 0) | only with a hint  | score_zero  |

With ``hint_demonstrations`` (under combine), a -1 turn whose hint holds tool calls of the turn's
declared tools also yields a demonstration sample: those calls as the reply, reward +1, no teacher
term (:meth:`Judge._demonstration`).

opd is ``Method.OPD`` (``on_policy_distillation``). Masks: the response mask is all ones over
``output_ids`` for every sample (the trainer masks the prompt); ``has_teacher`` tells the loss
whether the OPD term applies, so a combine RL-only sample carries no pseudo-teacher term. OPD
runs the PRM votes too: their score is no reward there, but it is the progress metric a user watches.

For every method: a side turn -> ``side_turn`` and a turn without a next state ->
``no_next_state`` (the caller passes these too; the judge is not called); a judge stage whose
every vote failed (backend errors, after the caller's retries) or a failed teacher call ->
``judge_error``, with the error text and all raw outputs in the verdict. A stage where only some
votes failed goes on with the votes that did not.

With a ``reference`` engine (the frozen initial weights, the KL reference the trainer would
otherwise run a forward of), each sample also carries ``ref_logprobs``: its output scored under its
own prompt, prefill only, in flight with the teacher's request.

With ``top_k`` = k (top-k OPD), a sample with a teacher also carries, per output token, the policy's
k most likely ids and their log-probs (the serving engine, ``policy``, scoring the turn's own prompt
prefill-only at judge time: the weights that sampled the turn unless a sync came in between) and the
teacher's log-probs of those ids under the hinted prompt (the same single teacher request that
gives ``teacher_logprobs``).

The teacher is checked against the turn before it is trusted: rendering the turn's own messages
with ``teacher_tokenizer`` must give back the turn's ``prompt_ids`` exactly, otherwise the teacher
would score other tokens than the policy sampled (different tokenizer or template).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.engine.types import BadRequestError, Engine, EngineError
from clawrl.judge.backends import JudgeBackend, RewardHookBackend
from clawrl.judge.context import build_judge_context
from clawrl.judge.parse import parse_hint, parse_score
from clawrl.judge.prompts import PROMPTS_VERSION, build_hint_messages, build_prm_messages
from clawrl.judge.teacher import (TeacherAlignmentError, build_teacher_prompt_ids, compute_student_topk,
                                  compute_teacher_logprobs, compute_teacher_topk_logprobs, demonstration_ids)
from clawrl.judge.voting import hint_problem, majority_vote, select_hint
from clawrl.records import (Fate, FateRecord, JudgeVerdict, Method, NextStateRecord, SampleRecord, TurnRecord,
                            TurnType)

ERROR_PREFIX = "[judge error] "  # how a failed vote appears among the raw outputs
# How the judge asks, fixed: votes are sampled at 0.6 (they must differ to be votes), from the turn and its
# context cut to 6,000 characters; one hint vote a turn (its hint, when usable, is appended to the last user
# message). judge_config_hash hashes these, so changing one judges every stored turn afresh.
TEMPERATURE = 0.6
BUDGET_CHARS = 6000
HINT_SAMPLES = 1


@dataclass
class JudgeOutcome:
    verdict: JudgeVerdict | None  # None when the judge was not called (side turn, no next state)
    sample: SampleRecord | None
    fate: FateRecord
    demonstration: SampleRecord | None = None  # the reply a tool-call hint spells out ([opd] hint_demonstrations)

    @property
    def failed(self) -> bool:
        """The judge or teacher failed: the caller may retry the turn."""
        return self.fate.fate == Fate.JUDGE_ERROR.value


def judge_config_hash(*, backend: str, model: str, method: Method | str, judge_samples: int, max_tokens: int,
                      teacher: str = "", prompts_version: str = PROMPTS_VERSION, demonstrations: bool = False,
                      top_k: int = 0) -> str:
    """A short stable hash of everything that changes what the judge decides; samples and verdicts
    are keyed by it, so a new configuration judges turns afresh and a rerun of the same one
    overwrites."""
    values = {
        "backend": backend, "model": model, "method": Method(method).value, "judge_samples": judge_samples,
        "hint_samples": HINT_SAMPLES, "temperature": TEMPERATURE, "max_tokens": max_tokens,
        "budget_chars": BUDGET_CHARS, "teacher": teacher, "prompts_version": prompts_version,
        # the hint choice and placement, settings once and fixed now: kept so that stored hashes stay valid
        "hint_policy": "longest", "hint_placement": "append_last_user",
    }
    if demonstrations:  # a key only when on: hashes of configurations without it stay as they were
        values["demonstrations"] = True
    if top_k:  # likewise
        values["top_k"] = top_k
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def make_sample_id(turn_id: str, config_hash: str) -> str:
    """Deterministic: one turn judged under one configuration is one sample, however often rerun."""
    return hashlib.sha256(f"{turn_id}\x00{config_hash}".encode()).hexdigest()[:24]


def _raw(r: str | Exception) -> str:
    return r if isinstance(r, str) else f"{ERROR_PREFIX}{type(r).__name__}: {r}"


async def _complete(judge: JudgeBackend, messages: list[dict[str, Any]], n: int, temperature: float,
                    max_tokens: int) -> list[str | Exception]:
    try:
        out = await judge.complete(messages, n=n, temperature=temperature, max_tokens=max_tokens)
    except Exception as e:  # noqa: BLE001 - a backend that raises despite the contract fails all its votes
        return [e] * n
    if len(out) != n:
        return [RuntimeError(f"judge backend returned {len(out)} completions, asked for {n}")] * n
    return out


def _stage_error(name: str, raw: list[str | Exception]) -> str | None:
    if raw and all(isinstance(r, Exception) for r in raw):
        kinds = sorted({_raw(r) for r in raw})
        return f"{name}: all {len(raw)} votes failed: " + " | ".join(kinds)
    return None


def _turn_rendering(turn: TurnRecord, tokenizer) -> tuple[list, list | None, str | None]:
    """(messages, tools, tool_choice) that render back into the turn's prompt ids with ``tokenizer``."""
    messages = json.loads(turn.request_messages)
    tools = json.loads(turn.request_tools) if turn.request_tools else None
    # TurnRecord does not keep tool_choice; it only changes the rendering when tools are present.
    for tool_choice in ([None, "none", "required"] if tools else [None]):
        if build_teacher_prompt_ids(tokenizer, messages, tools, None, tool_choice=tool_choice) == turn.prompt_ids:
            return messages, tools, tool_choice
    raise TeacherAlignmentError(
        "the teacher tokenizer does not reproduce the turn's prompt ids from its messages (different tokenizer "
        "or chat template); its log-probs would describe other tokens than the policy sampled")


@dataclass
class Judge:
    """One judge configuration with its live backends: :meth:`judge` turns a turn into an outcome."""

    backend: JudgeBackend
    method: Method
    judge_samples: int
    max_tokens: int
    teacher: Engine | None  # needed by opd and combine
    teacher_tokenizer: Any
    config_hash: str
    backend_name: str
    reward_hook: Any = None  # [hooks] reward: async fn(turn=, next_state=) -> (score, hint | None)
    hook_timeout_s: float | None = None  # a reward hook's call past this is a failed vote
    hint_demonstrations: bool = False  # [opd] hint_demonstrations: a hint holding tool calls -> a demonstration
    policy: Engine | None = None  # scores a demonstration's behaviour log-probs (the teacher when None)
    reference: Engine | None = None  # the frozen initial weights: each sample's KL-reference log-probs
    top_k: int = 0  # [opd] top_k: > 0 scores the teacher at the policy's top-k ids too (needs ``policy``)

    def __post_init__(self) -> None:
        self.method = Method(self.method)
        needs_hint = self.method in (Method.OPD, Method.COMBINE)
        if needs_hint and (self.teacher is None or self.teacher_tokenizer is None):
            raise ValueError(f"{self.method.value} needs a teacher engine and its tokenizer")
        if needs_hint and self.top_k > 0 and self.policy is None:
            raise ValueError("top-k OPD needs the serving engine (the policy's top-k at each output position): "
                             "in this process, or engine.kind = 'http'")

    async def judge(self, turn: TurnRecord, next_state: NextStateRecord | None) -> JudgeOutcome:
        """Judge ``turn`` given its ``next_state`` (module docstring)."""
        def outcome(kind: Fate, detail: str, verdict: JudgeVerdict | None = None,
                    sample: SampleRecord | None = None) -> JudgeOutcome:
            return JudgeOutcome(verdict, sample, FateRecord(turn.turn_id, turn.session_id, self.config_hash,
                                                            kind.value, detail))

        if turn.turn_type != TurnType.MAIN.value:
            return outcome(Fate.SIDE_TURN, f"turn type {turn.turn_type!r} is never trained on")
        if next_state is None or not next_state.has_next_state:
            return outcome(Fate.NO_NEXT_STATE, "no next state recorded" if next_state is None else next_state.reason)
        if len(turn.rollout_logprobs) != len(turn.output_ids):
            raise ValueError(f"turn {turn.turn_id}: {len(turn.rollout_logprobs)} rollout log-probs for "
                             f"{len(turn.output_ids)} output ids")
        verdict = await self._verdict(turn, next_state)
        if verdict.error:
            return outcome(Fate.JUDGE_ERROR, verdict.error, verdict)
        score, use_teacher = verdict.score, verdict.hint is not None
        makes_sample = {Method.GRPO: score != 0, Method.OPD: use_teacher, Method.COMBINE: score != 0 or use_teacher}
        if not makes_sample[self.method]:
            if self.method == Method.OPD:
                return outcome(Fate.NO_HINT, f"no usable hint among {HINT_SAMPLES} votes", verdict)
            return outcome(Fate.SCORE_ZERO, f"score 0 ({verdict.score_reason}; votes {verdict.votes})", verdict)
        teacher_logprobs = rendering = None
        topk: dict[str, Any] = {}
        ref_task = asyncio.ensure_future(self._reference_logprobs(turn.prompt_ids, turn.output_ids))
        if use_teacher:
            try:
                rendering = _turn_rendering(turn, self.teacher_tokenizer)
                messages, tools, tool_choice = rendering
                prompt_ids = build_teacher_prompt_ids(self.teacher_tokenizer, messages, tools, verdict.hint,
                                                      tool_choice=tool_choice)
                teacher_logprobs, topk = await self._teacher_scores(turn, prompt_ids)
            except (TeacherAlignmentError, EngineError, BadRequestError) as e:
                ref_task.cancel()
                verdict.error = f"teacher: {type(e).__name__}: {e}"
                return outcome(Fate.JUDGE_ERROR, verdict.error, verdict)
        reward = 0.0 if self.method == Method.OPD else float(score)
        sample = self._sample(turn, turn.turn_id, turn.output_ids, turn.rollout_logprobs, reward, teacher_logprobs)
        for name, value in topk.items():
            setattr(sample, name, value)
        sample.ref_logprobs = await ref_task
        detail = f"reward {reward:+g}, teacher {'yes' if use_teacher else 'no'}"
        out = outcome(Fate.SAMPLE, detail, verdict, sample)
        if self.hint_demonstrations and use_teacher and score < 0:
            out.demonstration, note = await self._demonstration(turn, verdict.hint, rendering)
            out.fate.detail += note
        return out

    async def _teacher_scores(self, turn: TurnRecord, prompt_ids: list[int]) -> tuple[list[float], dict[str, Any]]:
        """(the teacher's log-probs of the turn's output under ``prompt_ids``, the sample's top-k
        fields: empty unless ``top_k`` > 0)."""
        if self.top_k <= 0:
            return await compute_teacher_logprobs(self.teacher, prompt_ids, turn.output_ids), {}
        ids, student = await compute_student_topk(self.policy, turn.prompt_ids, turn.output_ids, self.top_k)
        sampled, teacher = await compute_teacher_topk_logprobs(self.teacher, prompt_ids, turn.output_ids, ids)
        return sampled, {"topk_ids": ids, "student_topk_logprobs": student, "teacher_topk_logprobs": teacher}

    def _sample(self, turn: TurnRecord, key: str, output_ids: list[int], rollout_logprobs: list[float],
                reward: float, teacher_logprobs: list[float] | None) -> SampleRecord:
        return SampleRecord(
            sample_id=make_sample_id(key, self.config_hash), turn_id=turn.turn_id, session_id=turn.session_id,
            judge_config_hash=self.config_hash, method=self.method.value, prompt_ids=list(turn.prompt_ids),
            output_ids=list(output_ids), rollout_logprobs=list(rollout_logprobs), reward=reward,
            has_teacher=teacher_logprobs is not None, teacher_logprobs=teacher_logprobs,
            weight_version=turn.weight_version, namespace=turn.namespace)

    async def _demonstration(self, turn: TurnRecord, hint: str,
                             rendering: tuple) -> tuple[SampleRecord | None, str]:
        """(the demonstration a hint holding tool calls spells out, a note for the fate's detail).
        Reward +1 and no teacher term: the demonstration is the target itself, and the teacher - the
        model that did not write it - would pull the policy back from it (a frozen small model gives
        a tool call low probability even under a hint naming it). Its behaviour log-probs are the
        policy's on the turn's own prompt (the teacher's when the policy engine is not reachable from
        here). ``rendering``: the turn's (messages, tools, tool_choice). Under opd, which trains on teacher terms only, there is no demonstration."""
        if self.method == Method.OPD:
            return None, ""
        tok = self.teacher_tokenizer
        try:
            messages, tools, tool_choice = rendering
            ids = demonstration_ids(tok, messages, tools, hint, tool_choice=tool_choice)
            if ids is None or ids == list(turn.output_ids):
                return None, ""
            behaviour = await compute_teacher_logprobs(self.policy or self.teacher, turn.prompt_ids, ids)
        except (ValueError, TeacherAlignmentError, EngineError, BadRequestError) as e:
            return None, f"; no demonstration ({type(e).__name__}: {e})"
        demo = self._sample(turn, f"{turn.turn_id}#demonstration", ids, behaviour, 1.0, None)
        demo.ref_logprobs = await self._reference_logprobs(turn.prompt_ids, ids)
        return demo, f"; demonstration of {len(ids)} tokens, reward +1"

    async def _reference_logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> list[float] | None:
        """The frozen reference's log-probs of ``output_ids`` after ``prompt_ids`` (prefill only),
        so the PPO step needs no reference forward of its own; None without a reference engine or
        when it fails (the trainer then computes them: a sample is never lost for this)."""
        if self.reference is None:
            return None
        try:
            return await compute_teacher_logprobs(self.reference, prompt_ids, output_ids)
        except (TeacherAlignmentError, EngineError, BadRequestError):
            return None

    async def _verdict(self, turn: TurnRecord, next_state: NextStateRecord) -> JudgeVerdict:
        """The PRM votes (and hint votes, for opd and combine: both prompts in flight together) and
        what they say: majority score, the chosen hint, every raw output, and an ``error`` naming each
        stage whose votes all failed."""
        backend = self.backend if self.reward_hook is None else RewardHookBackend(self.reward_hook, turn, next_state,
                                                                                      self.hook_timeout_s)
        ctx = build_judge_context(turn, next_state)
        stages = {"prm": (build_prm_messages, self.judge_samples)}
        if self.method in (Method.OPD, Method.COMBINE):
            stages["hint"] = (build_hint_messages, HINT_SAMPLES)
        raws = dict(zip(stages, await asyncio.gather(*(
            _complete(backend, build(ctx, BUDGET_CHARS), n, TEMPERATURE, self.max_tokens)
            for build, n in stages.values()))))
        votes = [parse_score(r) if isinstance(r, str) else None for r in raws["prm"]]
        score, reason = majority_vote(votes)
        hint_raw = raws.get("hint")
        hints = [parse_hint(r) if isinstance(r, str) else (None, None) for r in hint_raw or []]
        errors = [e for e in (_stage_error(name, raw) for name, raw in raws.items()) if e]
        return JudgeVerdict(
            turn_id=turn.turn_id, judge_config_hash=self.config_hash, judge_backend=self.backend_name, score=score,
            score_reason=reason, votes=votes, raw_outputs=json.dumps([_raw(r) for r in raws["prm"]]),
            hint=select_hint([h for accepted, h in hints if accepted], problem=self._hint_problem(ctx))
            if hint_raw else None,
            hint_raw_outputs=None if hint_raw is None else json.dumps([_raw(r) for r in hint_raw]),
            error="; ".join(errors) or None)

    def _hint_problem(self, ctx) -> Callable[[str], str | None]:
        """What :func:`hint_problem` checks a candidate of this turn's hint votes against: the user's
        replies in the next state (the rule judge's hint is the user's correction itself)."""
        users = [text for label, text in ctx.next_state if label == "[user]"]
        return functools.partial(hint_problem, user_texts=users, copy_check=self.backend_name != "rule")

    async def close(self) -> None:
        """Close the HTTP clients this judge made (SGLang judge or teacher servers). In-process
        engines belong to whoever passed them in and stay open."""
        from clawrl.engine.sglang_client import SGLangClient

        for client in {id(e): e for e in (getattr(self.backend, "engine", None), self.teacher)}.values():
            if isinstance(client, SGLangClient):
                await client.close()
