"""Swappable pieces, named by import path in ``[hooks]`` (the reference's --custom-rm-path,
--custom-loss-function-path, --custom-generate-function-path and --rollout-function-path).

Each hook is loaded once at an entry point (gateway start, judge flow, trainer), checked against
its contract below, logged, and recorded as an MLflow param of every train step. A path is
``package.module:function`` (or ``package.module.function``). The contracts:

| hook            | called as                                                        | returns                     |
|-----------------|------------------------------------------------------------------|-----------------------------|
| ``reward``      | ``await fn(turn=TurnRecord, next_state=NextStateRecord)``        | ``(score -1/0/1, hint|None)`` |
| ``loss``        | ``fn(mb, *, logprobs, old_logprobs, ref_logprobs, entropy, reward, hp, num_tokens, num_seqs)`` | ``(loss, metrics)`` |
| ``generate``    | ``await fn(engine=Engine, request=GenerateRequest)``             | ``GenerateResult``          |
| ``sample_source`` | ``fn(data_root=Path, judge_config_hash=str, limit=int)``      | ``list[SampleRecord]``, oldest first |

``reward`` replaces the judge's votes (hints from it still feed OPD); ``loss`` replaces
:func:`clawrl.train.base.default_loss` (advantage + PPO loss of a micro-batch); ``generate``
replaces the gateway's engine call (a streamed request then arrives in one chunk); ``sample_source``
replaces the trainable samples read from storage (its samples are stored before they are batched,
so lineage still reaches them).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from collections.abc import Callable
from typing import Any

log = logging.getLogger("clawrl.hooks")


class HookError(ValueError):
    """A hook that cannot be imported or does not fit its contract."""


HOOK_SPECS: dict[str, tuple[tuple[str, ...], bool]] = {  # kind -> (keyword arguments it must accept, async)
    "reward": (("turn", "next_state"), True),
    "loss": (("logprobs", "old_logprobs", "ref_logprobs", "entropy", "reward", "hp", "num_tokens", "num_seqs"), False),
    "generate": (("engine", "request"), True),
    "sample_source": (("data_root", "judge_config_hash", "limit"), False),
}


def import_path(path: str) -> Any:
    if ":" not in path and "." not in path:
        raise HookError(f"hook path {path!r}: expected 'package.module:function'")
    try:
        return pkgutil.resolve_name(path)
    except ImportError as e:
        raise HookError(f"hook path {path!r}: cannot import module {path.partition(':')[0]!r}: {e}") from None
    except (AttributeError, ValueError) as e:
        raise HookError(f"hook path {path!r}: {e}") from None


def check_hook(kind: str, fn: Any, path: str) -> None:
    names, is_async = HOOK_SPECS[kind]
    if not callable(fn):
        raise HookError(f"[hooks] {kind} = {path!r} is not callable")
    if inspect.iscoroutinefunction(fn) != is_async:
        want = "an async function (async def)" if is_async else "a plain (non-async) function"
        raise HookError(f"[hooks] {kind} = {path!r} must be {want}")
    sig = inspect.signature(fn)
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in names if n not in params and not takes_kwargs]
    if missing:
        raise HookError(f"[hooks] {kind} = {path!r}{sig} does not accept {', '.join(missing)}; "
                        f"the contract is fn({', '.join(names)})")
    extra = [n for n, p in params.items()
             if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and n not in names and not (kind == "loss" and n == "mb")]
    if extra:
        raise HookError(f"[hooks] {kind} = {path!r}{sig} requires {', '.join(extra)}, which clawrl does not pass")


def load_hook(kind: str, path: str) -> Callable | None:
    """The validated hook for ``kind`` at ``path`` ('' = none)."""
    if kind not in HOOK_SPECS:
        raise HookError(f"unknown hook {kind!r}; valid: {', '.join(HOOK_SPECS)}")
    if not path:
        return None
    fn = import_path(path)
    check_hook(kind, fn, path)
    log.info("loaded [hooks] %s = %s", kind, path)
    return fn


def hook_params(hooks_settings: Any) -> dict[str, str]:
    """MLflow params naming the active hooks."""
    return {f"hook.{k}": v for k, v in hooks_settings.model_dump().items() if v}
