"""Per-process state of the flows (also used by `clawrl sync` and `clawrl demo`), the record of a
weight-sync attempt, and the tags that link an MLflow run to the flow run that made it.

One process runs many flow runs (`clawrl demo` runs the judge and train flows every step), so the
settings, the DataStore of a data root, the frozen model, the judge and the trainer are made on
first use and reused: a model must not be reloaded per run. The serving engine is attached by the
process that serves it. At exit, what was made here with an async ``close()`` (engines, the HTTP
clients of judges) is closed on the runtime loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from clawrl import runtime
from clawrl.config import Settings, config_hash, load_settings
from clawrl.config_sections import GATE_SAMPLES

if TYPE_CHECKING:
    from clawrl.chat import ChatAdapter
    from clawrl.engine.types import Engine
    from clawrl.evaluation import EvalSet
    from clawrl.judge.pipeline import Judge
    from clawrl.storage.writer import DataStore
    from clawrl.sync import SyncReport
    from clawrl.train.trainer import Trainer

T = TypeVar("T")

_lock = threading.Lock()
_made: dict[tuple, Any] = {}
_policy_engine: Engine | None = None
_canary_engine: Engine | None = None


def _once(key: tuple, make: Callable[[], T]) -> T:
    with _lock:
        if key in _made:
            return _made[key]
    obj = make()  # outside the lock: loading a model takes seconds
    with _lock:
        return _made.setdefault(key, obj)


def attach_policy_engine(engine: Engine | None) -> None:
    """Make ``engine`` (the serving engine of this process) the one the train flow syncs in process
    and the ``opd.teacher = "policy"`` judge scores with; ``None`` detaches it."""
    global _policy_engine
    _policy_engine = engine


def policy_engine() -> Engine | None:
    return _policy_engine


def attach_canary_engine(engine: Engine | None) -> None:
    """Make ``engine`` (the canary engine of this process's gateway) the one the train flow loads every new
    version into, instead of the one at ``[gate] canary_url``; ``None`` detaches it."""
    global _canary_engine
    _canary_engine = engine


def load_flow_settings(config_path: str | None) -> Settings:
    return _once(("settings", config_path), lambda: load_settings(config_path))


def data_store(settings: Settings) -> DataStore:
    from clawrl.storage.writer import DataStore

    root = settings.storage.data_root
    return _once(("store", str(root)), lambda: DataStore(root))


def frozen_engine(settings: Settings, name: str | None = None) -> Engine:
    """The engine holding the initial weights of model ``name`` (default: the policy's), never synced."""
    from clawrl.judge.runner import load_frozen_engine

    m = settings.model
    key = ("frozen", name or m.name, m.seed, m.dtype, settings.prm.engine_url)  # a URL: an engine of its own
    return _once(key, lambda: load_frozen_engine(settings, name))


def eval_engine(settings: Settings) -> Engine:
    """The promotion gate's evaluation engine: the initial weights at first, then whichever version the
    gate loaded last; never the serving engine, so users keep getting the champion while it measures.
    With ``[gate] engine_url`` the `clawrl engine` there (over HTTP), else one loaded in this process."""
    if url := settings.gate.engine_url:
        from clawrl.engine.sglang_client import SGLangClient

        return _once(("eval-http", url), lambda: SGLangClient(url, timeout_s=settings.engine.stall_timeout_s))
    from clawrl.engine.embedded import ENGINE_KEYS, EmbeddedEngine  # imports the model code: seconds
    from clawrl.models import resolve_device, resolve_dtype

    def make() -> Engine:
        device, _ = resolve_device(settings.model.device)
        return EmbeddedEngine(base_model_dir(settings), dtype=resolve_dtype(settings.model.dtype, device),
                              device=device, weight_version="0", served_model_name="clawrl-eval",
                              **settings.engine.model_dump(include=ENGINE_KEYS))

    m = settings.model
    return _once(("eval", str(settings.storage.data_root), m.name, m.seed, m.dtype), make)


def eval_adapter(settings: Settings, engine: Engine) -> ChatAdapter:
    """The chat template the gate renders its prompts with: the evaluation engine's tokenizer, or the
    initial weights' one for an engine over HTTP."""
    from clawrl.chat import ChatAdapter
    from clawrl.models import load_tokenizer

    def make() -> ChatAdapter:
        return ChatAdapter(getattr(engine, "tokenizer", None) or load_tokenizer(base_model_dir(settings)))

    return _once(("eval-adapter", id(engine)), make)


def base_model_dir(settings: Settings):
    """The initial weights (weight version "0") of the policy model."""
    from clawrl.models import resolve_model_dir

    return resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)


def gate_eval_set(settings: Settings, batch_id: str | None = None, namespace: str | None = None) -> EvalSet:
    """The ``[gate]`` evaluation set of the candidate trained on ``batch_id``: the validation set, loaded
    once per configuration; or the replay set of the turns judged before that batch was claimed (all
    judged turns without a batch; only ``namespace``'s for its adapter), scored by ``[gate] evaluator`` or
    the judge's rating."""
    from clawrl.evaluation import load_eval_set

    g, temperature = settings.gate, settings.ppo.temperature
    budget = g.answer_budget(settings.ppo.max_new_tokens)
    if g.eval_set == "replay":
        return _replay_eval_set(settings, batch_id, temperature, budget, namespace)
    return _once(("gate-set", config_hash(g), temperature, budget, namespace), lambda: load_eval_set(
        g.validation_evaluator, size=g.size, samples=GATE_SAMPLES, seed=g.seed, max_tokens=budget,
        temperature=temperature, namespace=namespace))


def _replay_eval_set(settings: Settings, batch_id: str | None, temperature: float, budget: int,
                     namespace: str | None) -> EvalSet:
    from clawrl.evaluation import replay_eval_set
    from clawrl.hooks import HookError, import_path
    from clawrl.judge.pipeline import BUDGET_CHARS, TEMPERATURE
    from clawrl.judge.prompts import RATING_VERSION
    from clawrl.judge.rating import rate_answer
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import batch_claimed_at, replay_turns

    g, chash = settings.gate, build_judge_config_hash(settings)
    data_store(settings).flush()
    with open_catalog(settings.storage.data_root) as con:
        cut = batch_claimed_at(con, batch_id) if batch_id else None
        turns = replay_turns(con, chash, g.size, cut, namespace)
    if g.evaluator:
        rate, scorer = import_path(g.evaluator), f"hook:{g.evaluator}"
        if not callable(rate):
            raise HookError(f"[gate] evaluator = {g.evaluator!r} is not callable")
    else:
        judge = judge_for(settings)
        scorer = f"judge:{chash}:{RATING_VERSION}"

        def rate(messages: list[dict[str, Any]], answer: str):
            return rate_answer(judge.backend, messages, answer, n=judge.judge_samples, temperature=TEMPERATURE,
                               max_tokens=judge.max_tokens, budget_chars=BUDGET_CHARS)
    return replay_eval_set(turns, rate, scorer=scorer, samples=GATE_SAMPLES, seed=g.seed, max_tokens=budget,
                           temperature=temperature)


def gate_version(s: Settings, step: dict[str, Any], run_id: str | None, namespace: str | None = None) -> dict[str, Any]:
    """The promotion gate (``clawrl.promotion.gate_candidate``) on the version ``step`` made, against the champion
    of the shared policy or, with ``namespace``, of that namespace's adapter: the decision and its evidence, also
    on the step's MLflow run ``run_id``. ``[gate] enabled = false`` promotes it unevaluated."""
    from prefect import get_run_logger

    from clawrl.config_sections import GUARD_TOLERANCE
    from clawrl.lineage import log_gate
    from clawrl.promotion import gate_candidate, record_manual
    from clawrl.records import PromotionAction

    root, version = s.storage.data_root, step["weight_version"]
    if not s.gate.enabled:
        row = record_manual(data_store(s), root, action=PromotionAction.PROMOTE, version=version, source="ungated",
                            reason="[gate] enabled = false: served unevaluated", mlflow_run_id=run_id,
                            namespace=namespace)
        out: dict[str, Any] = {"decision": "promote", "reason": row.reason, "champion_version": row.champion_version,
                               "serve_version": version}
    else:
        engine = eval_engine(s)
        tr = trainer_in_process(s)  # None for adapters: they load from disk
        out = gate_candidate(data_store(s), root, candidate=version, engine=engine,
                             adapter=eval_adapter(s, engine), eval_set=gate_eval_set(s, step["batch_id"], namespace),
                             base_dir=base_model_dir(s), tolerance=s.gate.tolerance, alpha=s.gate.alpha,
                             min_gain=s.gate.min_gain, guard=s.gate.guard, guard_tolerance=GUARD_TOLERANCE,
                             state_dict=tr.state_dict() if tr is not None and tr.weight_version == version
                             and not s.gate.engine_url else None,  # in memory only into an engine in this process
                             mlflow_run_id=run_id, namespace=namespace)
        if run_id:
            log_gate(root, run_id, step=int(step["step"]), evidence=out, decision=out["decision"],
                     reason=out["reason"], champion_version=out["champion_version"])
    get_run_logger().info("gate: %s %s (champion %s): %s", version if namespace else f"version {version}",
                          "promoted" if out["decision"] == "promote" else "refused", out["champion_version"],
                          out["reason"])
    return out


def judge_for(settings: Settings) -> Judge:
    """The judge of these settings, over this process's frozen engines and attached serving engine."""
    from clawrl.judge.runner import build_judge

    return _once(("judge", config_hash(settings)),
                 lambda: build_judge(settings, frozen=lambda name: frozen_engine(settings, name),
                                     policy=_policy_engine))


def local_trainer(settings: Settings) -> Trainer:
    """The trainer of this data root in this process (``clawrl train``, ``clawrl demo``), made on first use."""
    from clawrl.train.trainer import trainer_from_settings
    from clawrl.trainer_service import samples_reader

    root = settings.storage.data_root
    return _once(("trainer", str(root)), lambda: trainer_from_settings(settings, samples_reader(root)))


def train_step(settings: Settings, batch_id: str, trainer_url: str | None) -> dict[str, Any]:
    """The StepResult (as a dict) of training claimed batch ``batch_id``: by the trainer service at
    ``trainer_url``, else by this process's trainer."""
    from dataclasses import asdict

    from clawrl import trainer_service

    if trainer_url:
        return trainer_service.request_step(trainer_url, batch_id)
    data_store(settings).flush()
    return asdict(trainer_service.train_batch(local_trainer(settings), settings.storage.data_root, batch_id))


def trainer_in_process(settings: Settings) -> Trainer | None:
    """The shared policy's trainer :func:`local_trainer` made in this process, whose weights a sync or the gate
    may take from memory; None when it runs elsewhere, not yet, or trains per-namespace adapters."""
    with _lock:
        trainer = _made.get(("trainer", str(settings.storage.data_root)))
    return None if settings.ppo.adapters == "namespace" else trainer


def close_all(timeout_s: float = 5.0) -> None:
    """Await ``close()`` of every object made here that has an async one, on the runtime loop, then
    forget them all. Errors are swallowed: this runs at interpreter exit, when nothing can be done
    about them."""
    with _lock:
        objects = list(_made.values())
        _made.clear()
    closers = [obj.close for obj in objects if asyncio.iscoroutinefunction(getattr(obj, "close", None))]

    async def close() -> None:
        await asyncio.gather(*(c() for c in closers), return_exceptions=True)

    if closers and runtime.is_running():
        with contextlib.suppress(Exception):  # best effort at exit
            runtime.run(close(), timeout_s)


atexit.register(close_all)  # registered after runtime's loop shutdown, so it runs before it


def record_sync(s: Settings, rep: SyncReport, weight_version: str, run_id: str | None) -> None:
    """The attempt ``rep`` to serve ``weight_version``: one ``syncs`` row (what `clawrl status` shows),
    and a point on the MLflow run ``run_id`` of the step that made the version (``clawrl.lineage.log_sync``)."""
    import uuid

    from clawrl.lineage import log_sync
    from clawrl.records import SyncRecord

    store = data_store(s)
    workers = [f"{w['url']}: version {w['weight_version']} in {w['seconds']:.2f} s" if w["ok"]
               else f"{w['url']}: failed: {w['message']}" for w in rep.workers] or None
    store.append(SyncRecord(sync_id=uuid.uuid4().hex[:16], weight_version=str(weight_version), target=rep.target,
                            ok=rep.success, skipped=rep.skipped, error=None if rep.success else rep.message,
                            serving_version=rep.weight_version, checkpoint_path=rep.checkpoint_path,
                            mlflow_run_id=run_id, started_at=rep.started_at, seconds=float(rep.seconds),
                            workers=workers))
    store.flush()
    if run_id:
        log_sync(s.storage.data_root, run_id, ok=rep.success, error=rep.message, serving_version=rep.weight_version,
                 seconds=rep.seconds, target=rep.target, weight_version=str(weight_version))


def serve_target(s: Settings, version: str) -> dict[str, Any]:
    """What serving ``version`` loads: weight_version, path, sha256 ('' for the initial weights, whose
    directory has no recorded hash) and the MLflow run of the step that made it (None for "0")."""
    from clawrl.promotion import weights_of
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import find_checkpoint

    with open_catalog(s.storage.data_root) as con:
        v, path, sha = weights_of(con, version, base_model_dir(s))
        ck = find_checkpoint(con, v) if v != "0" else None
    return {"weight_version": v, "path": path, "sha256": sha or "", "mlflow_run_id": ck["mlflow_run_id"] if ck else None}


def prefect_tags() -> dict[str, str]:
    """The flow run this is part of, as MLflow run tags that link back to it (``clawrl.lineage.prefect_link_tags``)."""
    from prefect.runtime import flow_run

    from clawrl.lineage import prefect_link_tags

    if not flow_run.id:
        return {}
    return prefect_link_tags(str(flow_run.id), flow_run_ui_url(str(flow_run.id)))


def flow_run_ui_url(flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI this process talks to, by Prefect's own table of UI routes
    (``runs/flow-run/<id>``; ``prefect.runtime.flow_run.ui_url`` gives the older ``flow-runs/flow-run/<id>``,
    which the UI only redirects)."""
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id) or ""


def engine_url_for(s: Settings, engine_url: str | None = None) -> str | None:
    """The HTTP engine a sync from this process targets: ``engine_url`` when given, else ``[engine] url``
    when it is set, else the engine of the `clawrl serve` running on the data root
    (``<data_root>/serve.json``: its HTTP engine or router, or its embedded engine at ``{gateway}/engine``);
    None when there is none."""
    if engine_url:
        return engine_url
    if s.engine.kind == "http" and s.engine.url:
        return s.engine.url
    from clawrl.serving import serving_gateway

    found = serving_gateway(s.storage.data_root)
    return found.get("engine_url") if found else None


def push_weights(s: Settings, target: dict[str, Any], engine_url: str | None) -> dict[str, Any]:
    """Serve ``target`` (``serve_target``'s keys) in this process's engine, else at ``engine_url`` or
    the engine ``engine_url_for`` finds, through ``clawrl.sync``; the attempt is recorded (``record_sync``).
    ``version`` in the answer is the one pushed; ``weight_version`` the one served afterwards."""
    from clawrl.config import read_admin_key

    engine = None if engine_url else policy_engine()  # an explicit engine URL wins
    rep = _load(s, target, engine, engine_url_for(s, engine_url) if engine is None else None,
                read_admin_key(s.server.admin_keys_env))
    if rep.target is not None:
        record_sync(s, rep, target["weight_version"], target.get("mlflow_run_id"))
    return _answer(rep, target)


def push_canary(s: Settings, target: dict[str, Any]) -> dict[str, Any]:
    """Load ``target`` (``serve_target``'s keys) into the canary engine: this process's, else the one at
    ``[gate] canary_url``. Not a ``syncs`` row: those say what every user is served, and a restarted
    engine serves the newest one of them again. ``weight_version``: what the canary serves afterwards."""
    return _answer(_load(s, target, _canary_engine, s.gate.canary_url or None), target)


def _load(s: Settings, target: dict[str, Any], engine: Engine | None, url: str | None,
          admin_key: str | None = None):
    """``clawrl.sync.sync_checkpoint`` of ``target`` into ``engine``, else into the HTTP engine at ``url``."""
    from clawrl.sync import sync_checkpoint

    return runtime.run(sync_checkpoint(
        target["weight_version"], target["path"], target["sha256"], engine=engine, trainer=trainer_in_process(s),
        url=url if engine is None else None, admin_key=admin_key, timeout_s=s.engine.stall_timeout_s))


def _answer(rep, target: dict[str, Any]) -> dict[str, Any]:
    return {"success": rep.success, "skipped": rep.skipped, "message": rep.message,
            "version": str(target["weight_version"]), "weight_version": rep.weight_version, "seconds": rep.seconds,
            "target": rep.target}
