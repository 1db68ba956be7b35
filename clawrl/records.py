"""The records that flow through clawrl: turns, next states, verdicts, samples, fates, batches.

Each record is one row of an append-only table in ``storage/`` (one pyarrow schema per record,
derived from these dataclasses). Token lists are the exact ids the engine saw and sampled; nothing
downstream re-tokenizes. Log-prob names say whose they are : ``rollout_logprobs`` are the
engine's at sampling time, ``teacher_logprobs`` the teacher's over the same output ids.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum


OPEN_NAMESPACE = "open"  # the API-key namespace of every session when no keys are configured
# what a namespace may be wherever one is stored or named: a directory name that can never climb out of
# adapters/, and no "@", which separates a name's namespace from its version
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# the namespaces the gateway assigns ("key-" and 16 hex digits of the key's SHA-256, clawrl.ids.namespace_for_key;
# or "open"). Stricter than NAMESPACE_RE, for what a user types (`clawrl ... --namespace`): a name of another
# form is a mistake to point out, not a namespace that merely has no data yet
GATEWAY_NAMESPACE_RE = re.compile(rf"^(key-[0-9a-f]{{16}}|{OPEN_NAMESPACE})$")
_ADAPTER_NAME_RE = re.compile(r"^(?P<namespace>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})@v(?P<version>[0-9]+)$")


def check_namespace(namespace: str) -> str:
    """``namespace`` when it is one (``NAMESPACE_RE``); ValueError naming it otherwise."""
    if not NAMESPACE_RE.match(namespace) or namespace in (".", ".."):
        raise ValueError(f"not a namespace: {namespace!r} (an API key's namespace is 'key-' and 16 hex digits; "
                         "'open' in open mode)")
    return namespace


def adapter_name(namespace: str, version: int) -> str:
    """The name version ``version`` of ``namespace``'s LoRA adapter is loaded and recorded as
    (``[ppo] adapters = "namespace"``); version 0 is no adapter: the base alone."""
    return f"{check_namespace(namespace)}@v{int(version)}"


def parse_adapter_name(name: str) -> tuple[str, int]:
    """``"<namespace>@v<N>"`` -> (namespace, N); ValueError for anything else."""
    m = _ADAPTER_NAME_RE.match(name)
    if m is None:
        raise ValueError(f"not an adapter name: {name!r} (expected '<namespace>@v<N>')")
    return m["namespace"], int(m["version"])


def adapter_number(namespace: str, version: str) -> int:
    """The version of ``namespace``'s adapter that ``version`` names, as a user writes it: ``N`` or
    ``<namespace>@v<N>``; ValueError for anything else (a version of another namespace's adapter included)."""
    if version.isdigit():
        return int(version)
    found, number = parse_adapter_name(version)
    if found != namespace:
        raise ValueError(f"{version!r} is a version of {found}'s adapter, not of {namespace}'s")
    return number


def adapter_version(name: str | None) -> int:
    """The version an adapter name names; 0 for None (the base alone)."""
    return 0 if name is None else parse_adapter_name(name)[1]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def make_turn_id(namespace: str, session_id: str, turn_index: int) -> str:
    """Deterministic id of a turn: the same (namespace, session, index) always maps to one id."""
    return hashlib.sha256(f"{namespace}\x00{session_id}\x00{turn_index}".encode()).hexdigest()[:24]


class Method(str, Enum):
    """How the advantage is formed: one clipped PPO objective, three ways to form A_t."""

    GRPO = "grpo"
    OPD = "on_policy_distillation"
    COMBINE = "combine"


class TurnType(str, Enum):
    MAIN = "main"  # trainable once its next state arrives
    SIDE = "side"  # heartbeats, memory flushes: served and logged, never trained on


class Fate(str, Enum):
    """What became of a turn. Every turn that leaves the judge gets exactly one fate per judge config."""

    SAMPLE = "sample"
    SIDE_TURN = "side_turn"
    NO_NEXT_STATE = "no_next_state"
    SCORE_ZERO = "score_zero"
    NO_HINT = "no_hint"
    JUDGE_ERROR = "judge_error"
    TOO_STALE = "too_stale"


@dataclass
class TurnRecord:
    """One served assistant turn, exactly as generated."""

    turn_id: str
    session_id: str
    turn_index: int  # 0-based position among this session's turns
    turn_type: str  # TurnType value
    namespace: str  # API-key namespace ("open" when no keys are configured)
    model: str  # served model name
    weight_version: str  # version that produced the turn (the engine's label at completion)
    request_messages: str  # JSON: the messages the client sent
    request_tools: str | None  # JSON: the tools the client sent
    request_params: str  # JSON: sampling parameters actually used
    prompt_ids: list[int]  # the chat template rendered once into ids
    output_ids: list[int]  # sampled ids, untrimmed (EOS included)
    rollout_logprobs: list[float]  # the engine's logprob of each output id
    text: str  # assistant content returned to the client
    tool_calls: str | None  # JSON: OpenAI tool_calls returned to the client
    finish_reason: str  # OpenAI finish reason: stop | length | tool_calls | abort
    created_at: datetime  # request received
    completed_at: datetime  # response complete
    latency_ms: float
    weight_versions: str = "[]"  # JSON spans when an update happened mid-turn
    # [ppo] adapters = "namespace": the namespace's LoRA adapter that served the turn over the base weights
    # of weight_version, by its name "<namespace>@v<N>" (clawrl.adapters); None: the base alone
    adapter: str | None = None


@dataclass
class NextStateRecord:
    """The evidence for a turn: what the session said next, or that nothing will come."""

    turn_id: str
    session_id: str
    turn_index: int
    has_next_state: bool
    messages: str | None  # JSON list of messages added after the turn (user reply / tool results)
    reason: str  # next_request | session_done | idle_timeout | evicted | shutdown | other_choice_continued
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class JudgeVerdict:
    """The judged outcome of one turn under one judge configuration."""

    turn_id: str
    judge_config_hash: str
    judge_backend: str
    score: int  # -1 / 0 / +1 after the majority vote
    score_reason: str  # majority | tie | all_failed | rule:<which rule>
    votes: list[int | None]  # per vote; None = unparseable
    raw_outputs: str  # JSON list of every raw judge output
    hint: str | None = None  # selected hindsight hint (OPD)
    hint_raw_outputs: str | None = None  # JSON list of raw hint votes
    error: str | None = None  # set when the judge backend failed after retries
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class SampleRecord:
    """One trainable sample: exact tokens, behaviour log-probs and the learning signal."""

    sample_id: str
    turn_id: str
    session_id: str
    judge_config_hash: str
    method: str  # Method value
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]  # len == len(output_ids)
    reward: float  # judge score (0.0 when the method uses none)
    has_teacher: bool
    teacher_logprobs: list[float] | None  # len == len(output_ids) when has_teacher
    weight_version: str  # policy version that sampled output_ids
    # API-key namespace of the session (the turn's); None: read from the turn, "open" without one
    namespace: str | None = None
    # the frozen KL reference's log-probs of output_ids under prompt_ids, scored at judge time by the
    # engine holding the initial weights (len == len(output_ids)); None: the trainer computes them
    ref_logprobs: list[float] | None = None
    # top-k OPD ([opd] top_k = k), one row of k per output token: the policy's k most likely ids at judge
    # time (best first), its log-probs of them, and the teacher's under the hinted prompt; None otherwise
    topk_ids: list[list[int]] | None = None
    student_topk_logprobs: list[list[float]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class FateRecord:
    turn_id: str
    session_id: str
    judge_config_hash: str
    fate: str  # Fate value
    detail: str = ""
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class BatchRecord:
    """A training batch: which samples one PPO step consumed (written before the step runs)."""

    batch_id: str
    step: int
    sample_ids: list[str]
    session_ids: list[str]  # one per (namespace, session) pair, sorted by pair
    method: str
    config_hash: str
    parent_version: str  # weight version the step starts from
    # the API-key namespace of each entry of session_ids (None: written before namespaces were recorded)
    session_namespaces: list[str] | None = None
    source_batch_id: str | None = None  # a replay's batch: the recorded batch it re-trains
    created_at: datetime = field(default_factory=utcnow)
    # the namespace whose LoRA adapter this batch trains ([ppo] adapters = "namespace"; step is then the
    # adapter version it makes); None: the shared policy
    namespace: str | None = None


@dataclass
class CheckpointRecord:
    """A saved policy version and what produced it."""

    weight_version: str
    step: int
    batch_id: str
    parent_version: str
    path: str
    sha256: str  # digest of the checkpoint's safetensors file (clawrl.checkpoint.weights_digest)
    mlflow_run_id: str | None
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class AdapterRecord:
    """A trained version of a namespace's LoRA adapter ([ppo] adapters = "namespace") and what produced it."""

    namespace: str
    version: int  # 1, 2, ...: the adapter's own steps, never reused (a forgotten namespace counts on)
    name: str  # "<namespace>@v<version>": what the engine loads it as and a turn records
    batch_id: str
    parent: str  # the adapter version it was trained from ("<namespace>@v0": a fresh adapter over the base)
    base_version: str  # the base weight version under it
    path: str
    sha256: str  # digest of its adapter_model.safetensors (clawrl.checkpoint.weights_digest)
    created_at: datetime = field(default_factory=utcnow)
    mlflow_run_id: str | None = None  # the step's run, in the namespace's own experiment


@dataclass
class AdapterServeRecord:
    """A change of what a namespace is served ([ppo] adapters = "namespace"): a new adapter version loaded
    into the serving engine, or the namespace forgotten; every attempt, whatever its outcome."""

    namespace: str
    action: str  # sync | forget
    adapter: str | None  # the adapter name asked for; None: the base alone (forget, or back to the base)
    previous: str | None  # what the namespace was served before
    ok: bool
    error: str | None
    target: str | None  # the engine's URL, "in-process", or None when no engine was reached
    seconds: float
    reason: str = ""  # forget: why, in words
    created_at: datetime = field(default_factory=utcnow)
    # forget: the newest version the namespace had (its rows are gone; its next version is numbered after it,
    # so no name is used twice)
    last_version: int | None = None


@dataclass
class SyncRecord:
    """One attempt to push a weight version into a serving engine, whatever its outcome."""

    sync_id: str
    weight_version: str  # the version pushed
    target: str  # engine URL, or "in-process"
    ok: bool  # the engine serves weight_version afterwards
    skipped: bool  # it already did: nothing was loaded
    error: str | None  # why not, when not ok
    serving_version: str | None  # what the engine reported afterwards (None: it did not answer)
    checkpoint_path: str | None  # None for the in-process state-dict path
    mlflow_run_id: str | None  # the run of the step that produced weight_version
    started_at: datetime
    seconds: float
    created_at: datetime = field(default_factory=utcnow)  # when the attempt ended
    # several workers behind SGLang's router: one entry each, "<url>: version V in S s" or "<url>: failed: why"
    workers: list[str] | None = None


@dataclass
class EvaluationRecord:
    """One weight version scored on the promotion gate's evaluation set (clawrl/gate.py)."""

    evaluation_id: str
    weight_version: str
    eval_key: str  # hash of what makes scores comparable: evaluator, prompts, samples, seeds, budget, temperature
    scores: list[float]  # per prompt, in the set's order: the mean over its samples
    mean: float
    n: int  # prompts
    samples: int  # answers per prompt
    seconds: float  # engine time the evaluation took
    created_at: datetime = field(default_factory=utcnow)
    # [ppo] adapters = "namespace": the namespace whose adapter (or, "<namespace>@v0", whose base) was scored
    # on its own evaluation set; None: the shared policy
    namespace: str | None = None


class PromotionAction(str, Enum):
    PROMOTE = "promote"  # the candidate serves from now on
    REFUSE = "refuse"  # the candidate stays unserved
    ROLLBACK = "rollback"  # serving went back to an earlier champion


@dataclass
class PromotionRecord:
    """A decision about what serves: the gate's (with its evidence), or one made by hand (`clawrl promote`,
    `clawrl rollback`); the newest promote/rollback row names the champion."""

    promotion_id: str
    action: str  # PromotionAction value
    weight_version: str  # the candidate judged, or the version promoted / rolled back to
    champion_version: str  # the champion before this decision
    source: str  # gate | manual | live
    reason: str  # the decision in words
    eval_key: str | None  # the evaluation set the evidence comes from (None: no evaluation)
    n: int | None
    candidate_mean: float | None
    champion_mean: float | None
    mean_diff: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    tolerance: float | None
    alpha: float | None
    mlflow_run_id: str | None  # the run of the step that made weight_version
    created_at: datetime = field(default_factory=utcnow)
    eval_set: str | None = None  # [gate] eval_set of the evidence: validation | replay (None: no evaluation)
    eval_turn_ids: list[str] | None = None  # replay: the turns whose request messages were the prompts, in order
    # [ppo] adapters = "namespace": the namespace whose adapter this decides (weight_version and
    # champion_version are then adapter names, "<namespace>@v0" the base alone); None: the shared policy
    namespace: str | None = None
