"""Settings sections kept out of clawrl/config.py for its length: the base every section derives from,
``[engine]``, ``[prm]`` and ``[gate]``. Loaded, merged and validated by clawrl/config.py like every other section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

Url = Annotated[str, AfterValidator(lambda v: v.rstrip("/"))]  # no '//chat/completions' or '//generate'


class Section(BaseModel):  # allow_inf_nan=False: TOML's inf and nan mean nothing to any setting
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class EngineSettings(Section):
    kind: Literal["embedded", "http"] = Field("embedded", description="'embedded': the torch engine in-process. "
                                              "'http': an SGLang server or `clawrl engine` at `url` (SGLang's native "
                                              "HTTP contract), or SGLang's router in front of several: each weight "
                                              "sync reaches every worker the router lists.")
    url: Url = Field("", description="Base URL of the HTTP engine or router (kind='http').")
    port: int = Field(30010, ge=0, le=65535, description="Port `clawrl engine` listens on.")
    max_batch_size: int = Field(16, ge=1, description="Sequences decoded together: more throughput, more KV memory.")
    max_context_len: int = Field(0, ge=0, description="Prompt + output tokens per sequence. 0: the model's own "
                                 "limit (max_position_embeddings in its config.json; SmolLM2: 8192), which `clawrl "
                                 "serve` prints at start; above that limit is a config error.")
    chunked_prefill_size: int = Field(0, ge=0, description="Prompt tokens prefilled per step, longer prompts in chunks "
                                      "between the others' decode steps. 0: 2048 on CPU, 8192 on CUDA.")
    max_total_tokens: int = Field(0, ge=0, description="KV token slots (rows x positions); requests wait until "
                                  "they fit. 0: 1/4 of RAM (CPU) or 1/2 of free GPU memory, at most a full batch.")
    prefix_cache_tokens: int = Field(-1, ge=-1, description="Prompt-prefix K/V kept for reuse (cached_tokens). -1: "
                                     "max_total_tokens / 4, at least max_context_len; 0: off.")
    max_queued_requests: int = Field(1024, ge=0, description="Queued requests beyond which the engine answers 503 "
                                     "(the gateway too, with Retry-After). 0: no limit.")
    stall_timeout_s: float = Field(120.0, gt=0, description="An engine call fails (504 engine_timeout at the "
                                   "gateway) when the engine sends nothing for this long: to the first token, and "
                                   "between tokens of a stream, however long a stream that keeps sending runs. A "
                                   "non-streamed answer comes whole; while it is awaited the engine must answer "
                                   "its health probe every this often.")
    cuda_graphs: bool = Field(True, description="On CUDA, replay decode steps from CUDA graphs (one per batch and "
                              "context bucket); false launches the same padded steps one kernel at a time.")

    @model_validator(mode="after")
    def _url_for_http(self) -> EngineSettings:
        if self.kind == "http" and not self.url:
            raise ValueError("engine.kind = 'http' needs engine.url")
        return self


class PRMSettings(Section):
    judge_samples: int = Field(3, ge=1, description="Independent judge votes per turn (majority wins).")
    backend: Literal["rule", "engine", "sglang", "provider"] = Field(
        "rule", description="'rule': deterministic rule-based judge (tests, CPU demo). 'engine': embedded engine "
        "holding the frozen initial weights. 'sglang': an SGLang server at prm.url. 'provider': the external API in "
        "[provider].")
    url: Url = Field("", description="SGLang server of the judge model (backend = 'sglang').")
    engine_url: Url = Field("", description="A `clawrl engine` holding the policy's initial weights, used over HTTP "
                            "by the 'engine' judge and the 'frozen' OPD teacher instead of loading the model in the "
                            "judging process ('': load it there), or SGLang's router in front of several. "
                            "`clawrl up` points its flows at its judge engine(s).")
    engine_port: int = Field(30021, ge=0, le=65535, description="Port of the judge engine `clawrl up` starts when the "
                             "judge uses the initial weights (backend = 'engine', or the 'frozen' teacher).")
    temperature: float = Field(0.6, ge=0, description="Judge sampling temperature (votes must differ).")
    max_new_tokens: int = Field(512, ge=1, description="Judge completion budget (reasoning + boxed score).")
    budget_chars: int = Field(6000, ge=200, description="Characters of turn + context shown to the judge.")
    max_in_flight: int = Field(16, ge=1, description="Turns judged concurrently (no global lock).")
    retries: int = Field(2, ge=0, description="Retries of a failed turn before its fate is judge_error.")
    retry_delay_s: float = Field(1.0, ge=0, description="First retry delay; doubles each retry.")
    batch_limit: int = Field(512, ge=1, description="Most turns one judge flow run takes.")


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
                           "score): chat message lists (or dicts of 'messages' with the request's 'tools' and the "
                           "prompt's 'group'), and score(index, answer) in [0, 1]. Default: the demo's validation "
                           "questions (none trained on, none held out), scored as its 'concise' user "
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
    min_gain: float | None = Field(None, ge=0, le=1, description="Unset: a candidate not worse beyond the tolerance "
                                   "is promoted. Set: it must also beat the champion's mean score by more than "
                                   "this (0: any gain; a tie keeps the champion), so serving changes only for a "
                                   "measured gain.")
    guard: list[str] = Field([], description="Groups of the evaluation prompts that must not get worse (an "
                             "evaluator tags each prompt with a group; e.g. 'plain' in clawrl.sim.validation:tools): "
                             "on each, a candidate scoring below the initial model's mean by more than guard_tolerance "
                             "is refused, whatever it gained elsewhere.")
    guard_tolerance: float = Field(0.0, ge=0, le=1, description="The largest drop of a guarded group's mean "
                                   "score a candidate may show (0: none).")
    engine_url: str = Field("", description="A `clawrl engine` of the policy's model that the gate loads each "
                            "candidate (and champion) into over HTTP: its own engine, never one that serves users. "
                            "'': the train flow loads an evaluation engine in its own process (a fresh process per "
                            "run under `clawrl up`'s deployments pays the model load each time). `clawrl up` points "
                            "its flows at the one it starts on engine_port.")
    engine_port: int = Field(30022, ge=0, le=65535, description="Port of the evaluation engine `clawrl up` starts "
                             "when the gate is on and engine_url is ''.")
    canary_share: float = Field(0.0, ge=0, lt=1, description="Share of sessions (picked by a hash of the session, "
                                "so each stays on its side) served by the newest trained version while the gate "
                                "keeps a champion for the others: the learner then also trains on its own answers "
                                "(their mistakes get a reward to unlearn them) while most users get the champion. "
                                "0: everyone gets the champion.")
    canary_url: str = Field("", description="canary_share > 0: the `clawrl engine` (or SGLang) the train flow loads "
                            "each new version into and the gateway sends canary sessions to. '': one in the "
                            "process (`clawrl demo`), or the one `clawrl up` starts on canary_port.")
    canary_port: int = Field(30023, ge=0, le=65535, description="Port of the canary engine `clawrl up` starts when "
                             "canary_share > 0 and canary_url is ''.")
    live_rollback: bool = Field(True, description="After each judge run, compare the judged score of live turns "
                                "the champion served with the previous champion's: a drop by more than "
                                "live_tolerance that is significant at alpha serves the previous champion again.")
    live_min_turns: int = Field(32, ge=2, description="Judged live main turns each of the two versions needs before "
                                "the live check compares them.")
    live_tolerance: float = Field(0.1, ge=0, le=2, description="The largest drop of the mean live judged score "
                                  "(-1..1) the champion may show against the previous champion.")

    @property
    def canary(self) -> bool:
        """Whether a canary serves a share of sessions (``canary_share`` > 0 with the gate on)."""
        return self.enabled and self.canary_share > 0

    @model_validator(mode="after")
    def _consistent(self) -> "GateSettings":
        if self.guard and self.eval_set == "replay":
            raise ValueError("guard: the prompts of eval_set 'replay' have no groups; guard needs eval_set = "
                             "'validation' with an evaluator that tags its prompts")
        if self.canary_share and not self.enabled:
            raise ValueError(f"canary_share = {self.canary_share}: a canary needs the gate (enabled = true); "
                             "without it every user already gets the newest version")
        return self


def replay_scorer_problem(gate: GateSettings, judge_backend: str) -> str | None:
    """Why ``eval_set = 'replay'`` cannot score answers under these settings, or None."""
    if gate.eval_set != "replay" or gate.replay_scorer or judge_backend != "rule":
        return None
    return ("replay rates each evaluation answer from the conversation alone, with no user reaction to read, and "
            "the rule judge only reads reactions: set [prm] backend to a model judge (engine, sglang or provider), "
            "or [gate] replay_scorer to an import path of fn(messages, answer) -> score in [0, 1]")
