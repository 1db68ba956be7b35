"""Settings sections kept out of clawrl/config.py for its length: the base every section derives from, and
``[gate]``. Loaded, merged and validated by clawrl/config.py like every other section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):  # allow_inf_nan=False: TOML's inf and nan mean nothing to any setting
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class GateSettings(Section):
    """The promotion gate: every new checkpoint is a candidate, scored paired with the serving champion (same
    prompts, same seeds) and served only when not worse beyond the tolerance (the rule: clawrl/gate.py).
    Refused candidates stay unserved; training goes on from the trained policy either way."""

    enabled: bool = Field(True, description="Gate every new checkpoint; false serves each one as soon as it exists.")
    eval_set: Literal["validation", "replay"] = Field(
        "validation", description="'validation': the fixed prompts and scorer `evaluator` returns, the same for every "
        "candidate. 'replay': the request messages (and tools) of the `size` newest judged main turns, newest "
        "session first, judged before the candidate's batch was claimed; each answer is rated from the "
        "conversation alone (there is no user reaction to it yet) by the [prm] model judge, or by `replay_scorer`. "
        "The promotion row names the set and its turn ids.")
    evaluator: str = Field("clawrl.sim.validation:concise", description="Import path of fn(size, seed) -> (prompts, "
                           "score): chat message lists, and score(index, answer) in [0, 1]. Default: the demo's "
                           "validation questions (disjoint from its held-out ones), scored as its 'concise' user "
                           "would (satisfied AND on topic); point it at your own prompts and scorer.")
    replay_scorer: str = Field("", description="eval_set = 'replay': import path of fn(messages, answer) -> score "
                               "in [0, 1], used instead of the judge; needed with the rule judge, which only reads "
                               "a user's reaction.")
    size: int = Field(16, ge=1, description="Evaluation prompts: more resolve smaller differences, at more engine time.")
    samples: int = Field(2, ge=1, description="Answers per prompt (fixed distinct seeds); a prompt scores their mean.")
    seed: int = Field(0, description="Seed of the evaluation set and of its answers: decisions replay identically.")
    max_tokens: int = Field(48, ge=1, description="Answer budget per evaluation prompt.")
    temperature: float | None = Field(None, ge=0, description="Evaluation sampling temperature; unset: "
                                      "ppo.temperature, what users get.")
    tolerance: float = Field(0.05, ge=0, le=1, description="The largest drop in mean score a candidate may show "
                             "and still be promoted, against the champion and against the best promoted score.")
    alpha: float = Field(0.05, gt=0, lt=1, description="Level of the one-sided paired t-test: a candidate "
                         "significantly worse than the champion is refused even within the tolerance.")
    live_rollback: bool = Field(True, description="After each judge run, compare the judged score of live turns "
                                "the champion served with the previous champion's: a drop by more than "
                                "live_tolerance that is significant at alpha serves the previous champion again.")
    live_min_turns: int = Field(32, ge=2, description="Judged live main turns each of the two versions needs before "
                                "the live check compares them.")
    live_tolerance: float = Field(0.1, ge=0, le=2, description="The largest drop of the mean live judged score "
                                  "(-1..1) the champion may show against the previous champion.")


def replay_scorer_problem(gate: GateSettings, judge_backend: str) -> str | None:
    """Why ``eval_set = 'replay'`` cannot score answers under these settings, or None."""
    if gate.eval_set != "replay" or gate.replay_scorer or judge_backend != "rule":
        return None
    return ("replay rates each evaluation answer from the conversation alone, with no user reaction to read, and "
            "the rule judge only reads reactions: set [prm] backend to a model judge (engine, sglang or provider), "
            "or [gate] replay_scorer to an import path of fn(messages, answer) -> score in [0, 1]")
