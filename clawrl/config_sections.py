"""Settings sections kept out of clawrl/config.py for its length: the base every section derives from,
``[engine]``, ``[prm]`` and ``[gate]``. Loaded, merged and validated by clawrl/config.py like every other section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

Url = Annotated[str, AfterValidator(lambda v: v.rstrip("/"))]  # no '//chat/completions' or '//generate'


class Section(BaseModel):  # allow_inf_nan=False: TOML's inf and nan mean nothing to any setting
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class EngineSettings(Section):
    url: Url = Field("", description="The serving engine ('': the embedded one). A URL names an SGLang server, a "
                                     "`clawrl engine`, or SGLang's router in front of several (each weight sync "
                                     "reaches every worker the router lists), over SGLang's native HTTP API; '' runs "
                                     "clawrl's embedded torch engine in the gateway's process.")
    max_batch_size: int = Field(16, ge=1, description="Sequences decoded together: more throughput, more KV memory.")
    max_context_len: int = Field(0, ge=0, description="Prompt + output tokens per sequence (0: the model's own limit). "
                                                      "That limit is max_position_embeddings in the model's "
                                                      "config.json (SmolLM2: 8192); `clawrl serve` prints it at start, "
                                                      "and a value above it is a config error.")
    max_total_tokens: int = Field(0, ge=0, description="KV token slots the embedded engine may hold (0: 1/4 of RAM or "
                                                       "1/2 of free GPU memory). Slots are rows x positions, 0 gives "
                                                       "at most a full batch, and requests wait until they fit; "
                                                       "`clawrl serve` prints the bound at start.")
    max_loaded_loras: int = Field(32, ge=0, description="LoRA adapters the embedded engine holds in memory at once "
                                                        "(SGLang's --max-loaded-loras; 0: LoRA off). More keeps more "
                                                        "users' adapters warm, at an adapter's size each; a request "
                                                        "for one not held waits for its file to be read (the least "
                                                        "recently used idle one makes room). One in use is never "
                                                        "dropped.")
    deterministic: bool = Field(False, description="A request's tokens and log-probs do not depend on its batch "
                                                   "mates. Batch-invariant decode, as SGLang's "
                                                   "--enable-deterministic-inference: with a seed, a user's answer "
                                                   "is the same bits however many other requests share its decode "
                                                   "steps, how long they are and on which adapters. It costs decode "
                                                   "speed: about 40% at one request in flight, 6-10% at 16 (2 CPU "
                                                   "cores). The embedded engine's CPU decode only (not CUDA); "
                                                   "prompts that arrive together are still prefilled as one batch, "
                                                   "whose rounding may differ from a prompt's alone.")
    stall_timeout_s: float = Field(120.0, gt=0, description="Seconds an engine call may go without a token before it "
                                                            "fails (504 engine_timeout). It counts to the first token "
                                                            "and between tokens of a stream, however long a stream "
                                                            "that keeps sending runs; a non-streamed answer comes "
                                                            "whole, and while it is awaited the engine must answer its "
                                                            "health probe every this often.")

    @property
    def kind(self) -> Literal["embedded", "http"]:
        """'http' when ``url`` names an engine over HTTP, else 'embedded'."""
        return "http" if self.url else "embedded"


class PRMSettings(Section):
    judge_samples: int = Field(3, ge=1, description="Independent judge votes per turn (majority wins).")
    backend: Literal["rule", "engine", "provider"] = Field(
        "rule", description="The judge: 'rule', 'engine' or 'provider'. 'rule': a deterministic rule-based judge "
                            "(tests, CPU demo); 'engine': the policy's frozen initial weights (in the judging process, "
                            "or the `clawrl engine` at engine_url); 'provider': any OpenAI-compatible API in "
                            "[provider] (an external model, or an SGLang server of another judge model at its /v1).")
    engine_url: Url = Field("", description="The judge's `clawrl engine` (or SGLang's router in front of several) with "
                                            "the initial weights ('': load them in the judging process). The 'engine' "
                                            "judge and the 'frozen' OPD teacher use it over HTTP; `clawrl up` points "
                                            "its flows at its judge engine(s).")
    max_new_tokens: int = Field(512, ge=1, description="Judge completion budget (reasoning + boxed score).")


# The validation evaluator when [gate] evaluator names none: the demo's validation questions (none trained on,
# none held out), scored as its 'concise' user would (satisfied AND on topic).
DEFAULT_EVALUATOR = "clawrl.sim.validation:concise"
# A guarded group may not drop at all; the live check compares two versions once each has this many judged
# live turns, and rolls back a significant drop of more than this (scores -1..1).
GUARD_TOLERANCE, LIVE_MIN_TURNS, LIVE_TOLERANCE = 0.0, 32, 0.1
# Answers per evaluation prompt (distinct fixed seeds, their mean the prompt's score), and the most tokens an
# answer gets: [ppo] max_new_tokens, at most this many - the gate compares candidates on short answers, and
# each token costs engine time in every train step.
GATE_SAMPLES, GATE_MAX_TOKENS = 2, 64


class GateSettings(Section):
    """The promotion gate: every new checkpoint is a candidate, scored paired with the serving champion (same
    prompts, same seeds) and served only when not worse beyond the tolerance (the rule: clawrl/gate.py).
    Refused candidates stay unserved; training goes on from the trained policy either way."""

    enabled: bool = Field(True, description="Gate every new checkpoint; false serves each one as soon as it exists.")
    eval_set: Literal["validation", "replay"] = Field(
        "validation", description="What the gate evaluates on: 'validation' or 'replay'. 'validation': the fixed "
                                  "prompts and scorer `evaluator` returns, the same for every candidate. 'replay': the "
                                  "request messages (and tools) of the `size` newest judged main turns, newest session "
                                  "first, judged before the candidate's batch was claimed; each answer is rated from "
                                  "the conversation alone (there is no user reaction to it yet) by the [prm] model "
                                  "judge, or by `evaluator`. The promotion row names the set and its turn ids.")
    evaluator: str = Field("", description="Import path of the evaluation's prompts and scorer ('': the defaults "
                                           "below). With eval_set 'validation': fn(size, seed) -> (prompts, score): "
                                           "chat message lists (or dicts of 'messages' with the request's 'tools' and the "
                                           "prompt's 'group'), and score(index, answer) in [0, 1]; '': the demo's "
                                           "validation questions, scored as its 'concise' user would (satisfied AND on "
                                           "topic). eval_set 'replay': fn(messages, answer) -> score in [0, 1]; '': "
                                           "the [prm] judge rates the answers (the rule judge cannot: it only reads a "
                                           "user's reaction).")
    size: int = Field(16, ge=1, description="Evaluation prompts: more resolve smaller differences, at more engine time.")
    seed: int = Field(0, description="Seed of the evaluation set and of its answers: decisions replay identically. Two "
                                     "answers a prompt, at the serving temperature; their mean scores the prompt.")
    tolerance: float = Field(0.05, ge=0, le=1, description="The largest drop in mean score a promoted candidate may "
                                                           "show. It holds against the champion and against the best "
                                                           "promoted score.")
    alpha: float = Field(0.05, gt=0, lt=1, description="Level of the one-sided paired t-test. A candidate "
                                                       "significantly worse than the champion is refused even within "
                                                       "the tolerance (the live check uses it too).")
    min_gain: float | None = Field(None, ge=0, le=1, description="The gain over the champion a candidate needs (unset: "
                                                                 "not worse is enough). Set, it must beat the "
                                                                 "champion's mean score by more than this (0: any "
                                                                 "gain; a tie keeps the champion), so serving changes "
                                                                 "only for a measured gain.")
    guard: list[str] = Field([], description="Groups of evaluation prompts that must not fall below the initial model. "
                                             "An evaluator tags each prompt with a group (e.g. 'plain' in "
                                             "clawrl.sim.validation:tools); on each, a candidate scoring below the "
                                             "initial model's mean is refused, whatever it gained elsewhere.")
    engine_url: str = Field("", description="The `clawrl engine` the gate evaluates candidates in ('': one in the "
                                            "train flow's process). It is an engine of its own, never one that serves "
                                            "users, loaded with each candidate (and champion) over HTTP; `clawrl up` "
                                            "starts one on [server] api_port + 22 and points its flows at it.")
    canary_share: float = Field(0.0, ge=0, lt=1, description="Share of sessions the newest trained version serves "
                                                             "while the gate keeps a champion for the rest. A hash of "
                                                             "the session picks them, so each stays on its side; the "
                                                             "learner then also trains on its own answers (their "
                                                             "mistakes get a reward to unlearn them) while most users "
                                                             "get the champion. 0: everyone gets the champion.")
    canary_url: str = Field("", description="The canary's engine ('': one in the process, or the one `clawrl up` "
                                            "starts on [server] api_port + 23). With canary_share > 0 the train flow "
                                            "loads each new version into it and the gateway sends canary sessions to "
                                            "it.")
    live_rollback: bool = Field(True, description="Serve the previous champion again after a live drop. After each "
                                                  "judge run the judged score of live turns the champion served is "
                                                  "compared with the previous champion's: a significant drop of more "
                                                  "than 0.1 (scores -1..1, each version with 32 judged turns or more) "
                                                  "rolls back.")

    @property
    def canary(self) -> bool:
        """Whether a canary serves a share of sessions (``canary_share`` > 0 with the gate on)."""
        return self.enabled and self.canary_share > 0

    def answer_budget(self, max_new_tokens: int) -> int:
        """Tokens per evaluation answer: the serving budget ``max_new_tokens``, at most ``GATE_MAX_TOKENS``."""
        return min(max_new_tokens, GATE_MAX_TOKENS)

    @property
    def validation_evaluator(self) -> str:
        """The evaluator of the validation set: ``evaluator``, or the demo's concise one."""
        return self.evaluator or DEFAULT_EVALUATOR

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
    if gate.eval_set != "replay" or gate.evaluator or judge_backend != "rule":
        return None
    return ("replay rates each evaluation answer from the conversation alone, with no user reaction to read, and "
            "the rule judge only reads reactions: set [prm] backend to a model judge (engine or provider), "
            "or [gate] evaluator to an import path of fn(messages, answer) -> score in [0, 1]")
