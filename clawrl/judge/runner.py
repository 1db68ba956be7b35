"""What the judge flow calls: build a judge from settings, judge one stored turn, list its records.

:func:`build_judge` is the entry-point factory (it reads Settings); the engines it does not make
itself (the frozen model, the serving engine) are arguments, so the caller decides how long they
live (the flows keep one per process: ``clawrl.flows.common``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from clawrl.config import Settings, read_secret
from clawrl.engine.types import Engine
from clawrl.hooks import load_hook
from clawrl.judge.backends import EngineJudge, JudgeBackend, ProviderJudge, RuleJudge
from clawrl.judge.pipeline import Judge, JudgeOutcome, judge_config_hash
from clawrl.models import resolve_device, resolve_dtype
from clawrl.records import Fate, FateRecord, JudgeVerdict, Method, NextStateRecord, TurnRecord


def load_frozen_engine(settings: Settings, name: str | None = None) -> Engine:
    """A new embedded engine holding the initial weights of model ``name`` (default: the policy's
    model), never synced: the frozen judge, and the frozen or local OPD teacher. With ``[prm]
    engine_url`` the policy's model is not loaded here: the `clawrl engine` at that URL holds its
    initial weights (`clawrl up`'s judge engine, or SGLang's router in front of several) and answers
    over HTTP."""
    if settings.prm.engine_url and (name or settings.model.name) == settings.model.name:
        return _http_engine(settings, settings.prm.engine_url)
    from clawrl.engine.embedded import ENGINE_KEYS, EmbeddedEngine
    from clawrl.models import resolve_model_dir

    model_dir = resolve_model_dir(name or settings.model.name, settings.storage.models_dir, settings.model.seed)
    device, _ = resolve_device(settings.model.device)
    return EmbeddedEngine(model_dir, dtype=resolve_dtype(settings.model.dtype, device), device=device,
                          weight_version="frozen", served_model_name="clawrl-frozen",
                          **settings.engine.model_dump(include=ENGINE_KEYS))


def uses_frozen_model(settings: Settings) -> bool:
    """Whether the judge of these settings scores with the policy's initial weights: the 'engine'
    backend, or the 'frozen' teacher of opd and combine (what `clawrl up` serves as its judge engine)."""
    distills = Method(settings.ppo.advantage_estimator) in (Method.OPD, Method.COMBINE)
    return settings.prm.backend == "engine" or (distills and settings.opd.teacher == "frozen")


def _judge_model_id(settings: Settings) -> str:
    if settings.hooks.reward:
        return f"hook:{settings.hooks.reward}"
    return {"rule": "rules", "engine": f"frozen:{settings.model.name}",
            "provider": f"{settings.provider.base_url}#{settings.provider.model}"}[settings.prm.backend]


def _teacher_id(settings: Settings) -> str:
    name = settings.opd.teacher
    if name == "frozen":
        return f"frozen:{settings.model.name}"
    if name == "policy" or name.startswith(("http://", "https://")):
        return name
    return f"local:{name}"


def build_judge_config_hash(settings: Settings) -> str:
    """The judge-config hash of these settings, without loading any model (``clawrl status``)."""
    prm, opd = settings.prm, settings.opd
    method = Method(settings.ppo.advantage_estimator)
    return judge_config_hash(
        backend=prm.backend, model=_judge_model_id(settings), method=method, judge_samples=prm.judge_samples,
        max_tokens=prm.max_new_tokens, teacher=_teacher_id(settings) if method in (Method.OPD, Method.COMBINE) else "",
        demonstrations=opd.hint_demonstrations and method == Method.COMBINE,
        top_k=opd.top_k if method in (Method.OPD, Method.COMBINE) else 0)


def _http_engine(settings: Settings, url: str) -> Engine:
    """An engine over HTTP, or SGLang's router in front of several (which picks one per request)."""
    from clawrl.engine.router import RoutedEngines

    return RoutedEngines(url, timeout_s=settings.engine.stall_timeout_s)


def _policy_tokenizer(settings: Settings):
    from clawrl.models import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed))


def _teacher(settings: Settings, frozen: Callable[[str], Engine], policy: Engine | None) -> tuple[Engine, Any]:
    """(engine, tokenizer) of the OPD teacher named by ``opd.teacher``."""
    name = settings.opd.teacher
    if name == "policy":
        if policy is None and settings.engine.kind != "http":
            raise RuntimeError("opd.teacher = 'policy' needs the serving engine in this process or "
                               "engine.kind = 'http'")
        # several engines serve the same version (a sync aside): whichever the router picks scores with it
        return policy or _http_engine(settings, settings.engine.url), _policy_tokenizer(settings)
    if name.startswith(("http://", "https://")):
        return _http_engine(settings, name), _policy_tokenizer(settings)
    engine = frozen(settings.model.name if name == "frozen" else name)
    return engine, _tokenizer_of(settings, engine)


def _tokenizer_of(settings: Settings, engine: Engine):
    """An in-process engine's own tokenizer; the policy's for one over HTTP (it serves the policy's model)."""
    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer if tokenizer is not None else _policy_tokenizer(settings)


def _backend(settings: Settings, frozen: Callable[[str], Engine]) -> JudgeBackend:
    prm = settings.prm
    if prm.backend == "rule":
        return RuleJudge()
    if prm.backend == "engine":
        engine = frozen(settings.model.name)
        return EngineJudge(engine, _tokenizer_of(settings, engine), seed=settings.model.seed)
    if not settings.provider.base_url:
        raise ValueError("prm.backend = 'provider' needs provider.base_url")
    return ProviderJudge(settings.provider.base_url, read_secret(settings.provider.api_key_env),
                         settings.provider.model, timeout_s=settings.engine.stall_timeout_s)


def _reference(settings: Settings, frozen: Callable[[str], Engine], teacher: Engine | None) -> Engine | None:
    """The engine that scores each sample's KL-reference log-probs at judge time, one prefill a sample
    (so the PPO step runs no reference forward: 0.96x a plain HF step on an H200, 0.76x without): the frozen
    OPD teacher or the frozen judge when this judge holds one (both are the policy's initial weights), or
    None: the trainer computes them."""
    if settings.ppo.kl_coef == 0:
        return None
    if teacher is not None and settings.opd.teacher == "frozen":
        return teacher
    return frozen(settings.model.name) if settings.prm.backend == "engine" else None


def build_judge(settings: Settings, *, frozen: Callable[[str], Engine] | None = None,
                policy: Engine | None = None) -> Judge:
    """The judge these settings describe. ``frozen(name)`` gives the engine holding model ``name``'s
    initial weights (default: :func:`load_frozen_engine`, one per model for this judge); ``policy``
    is the serving engine when it runs in this process (the ``opd.teacher = "policy"`` teacher)."""
    prm, opd = settings.prm, settings.opd
    method = Method(settings.ppo.advantage_estimator)
    frozen = frozen or functools.cache(functools.partial(load_frozen_engine, settings))
    teacher = teacher_tok = None
    if method in (Method.OPD, Method.COMBINE):
        teacher, teacher_tok = _teacher(settings, frozen, policy)
    return Judge(backend=_backend(settings, frozen), backend_name="hook" if settings.hooks.reward else prm.backend,
                 teacher=teacher, teacher_tokenizer=teacher_tok, method=method, judge_samples=prm.judge_samples,
                 max_tokens=prm.max_new_tokens, config_hash=build_judge_config_hash(settings),
                 reward_hook=load_hook("reward", settings.hooks.reward),
                 hook_timeout_s=settings.engine.stall_timeout_s, hint_demonstrations=opd.hint_demonstrations,
                 reference=_reference(settings, frozen, teacher), top_k=opd.top_k,
                 policy=policy or (_http_engine(settings, settings.engine.url)
                                   if settings.engine.kind == "http" and (opd.hint_demonstrations or opd.top_k > 0)
                                   else None))


_TURN_FIELDS = [f.name for f in fields(TurnRecord)]


def turn_from_row(row: dict[str, Any]) -> TurnRecord:
    return TurnRecord(**{k: row[k] for k in _TURN_FIELDS})


def next_state_from_row(row: dict[str, Any]) -> NextStateRecord | None:
    if row.get("next_reason") is None:
        return None
    return NextStateRecord(row["turn_id"], row["session_id"], row["turn_index"],
                           has_next_state=bool(row.get("next_has_state", True)),
                           messages=row.get("next_messages"), reason=row["next_reason"],
                           created_at=row["next_state_at"])


def outcome_records(outcome: JudgeOutcome) -> list[Any]:
    """Records to append, the fate LAST: a turn counts as judged once its fate is stored, so a
    crash before that re-judges it and the deterministic sample id overwrites any earlier sample."""
    return [r for r in (outcome.verdict, outcome.sample, outcome.demonstration) if r is not None] + [outcome.fate]


def failure_records(turn: TurnRecord, judge: Judge, error: str) -> list[Any]:
    """Verdict + fate for a turn whose every judge attempt raised."""
    verdict = JudgeVerdict(turn_id=turn.turn_id, judge_config_hash=judge.config_hash,
                           judge_backend=judge.backend_name, score=0, score_reason="all_failed", votes=[],
                           raw_outputs="[]", error=error)
    fate = FateRecord(turn.turn_id, turn.session_id, judge.config_hash, Fate.JUDGE_ERROR.value, error)
    return [verdict, fate]
