"""The caller's own LoRA adapter (``[ppo] adapters = "namespace"``).

Every request of a namespace is sent to the engine with ``lora_path`` = the adapter its ``serving.json``
names (:mod:`clawrl.adapters`; none: the base alone). The file is checked on each request with one
``stat`` and read only when it changed, so a sync from another process takes effect at the namespace's
next request, and a restarted gateway serves the same adapter. The namespace comes from the caller's API
key: a request's ``model`` (SGLang's ``"<base>:<adapter>"``) never selects an adapter, so no key can be
served another namespace's.

An engine that restarted answers 400 naming the adapter it no longer holds: it is loaded again from its
directory and the request goes again. A request prepared just before a sync may name the version the
sync has unloaded since: it goes again with the version its namespace is served now. Either way the turn
records the adapter that decoded it (``GenerateResult.lora_path``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clawrl.adapters import ServedAdapter, read_served, serving_file
from clawrl.config import ConfigError
from clawrl.engine.types import BadRequestError, Engine, GenerateRequest, GenerateResult
from clawrl.records import parse_adapter_name

log = logging.getLogger("clawrl.gateway")

MENDS = 2  # a request goes again at most this often: once superseded by a sync, once after a reload


class ServedAdapters:
    """Which adapter each namespace is served, as ``<checkpoints>/adapters/<namespace>/serving.json`` says."""

    def __init__(self, checkpoints: Path):
        self.checkpoints = Path(checkpoints)
        self._cache: dict[str, tuple[tuple[int, int, int], ServedAdapter | None]] = {}

    def get(self, namespace: str) -> ServedAdapter | None:
        path = serving_file(self.checkpoints, namespace)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._cache.pop(namespace, None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)  # replaced by a rename: a new inode
        cached = self._cache.get(namespace)
        if cached is not None and cached[0] == key:
            return cached[1]
        served = read_served(self.checkpoints, namespace)
        self._cache[namespace] = (key, served)
        return served

    def name_for(self, namespace: str) -> str | None:
        """The name of the adapter ``namespace`` is served, None for the base alone."""
        served = self.get(namespace)
        return None if served is None else served.name


class AdapterEngine:
    """The gateway's engine under per-namespace adapters: every call passes to ``engine``; a generation
    that names an adapter the engine lacks goes again (module docstring), and its results carry the
    adapter that decoded them."""

    def __init__(self, engine: Engine, served: ServedAdapters):
        self.engine, self.served = engine, served
        self._loading: dict[str, asyncio.Lock] = {}

    def __getattr__(self, name: str) -> Any:  # model_info, health, max_context_len, close, ...
        return getattr(self.engine, name)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        for mends in range(MENDS + 1):
            try:
                result = await self.engine.generate(req)
            except BadRequestError as e:
                if mends == MENDS or not await self._mend(req, e):
                    raise
                continue
            result.lora_path = req.lora_path
            return result
        raise AssertionError("unreachable")

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        for mends in range(MENDS + 1):
            parts = self.engine.generate_stream(req)
            try:
                try:
                    first = await anext(parts)
                except BadRequestError as e:  # refused before a token: it may go again
                    if mends == MENDS or not await self._mend(req, e):
                        raise
                    continue
                first.lora_path = req.lora_path
                yield first
                async for part in parts:
                    part.lora_path = req.lora_path
                    yield part
                return
            finally:  # a caller that stops reading closes the stream now: the engine stops generating
                await parts.aclose()

    async def _mend(self, req: GenerateRequest, error: BadRequestError) -> bool:
        """Whether ``req`` may go again after ``error``: it named an adapter the engine does not hold (the
        engine's message names it, as SGLang's does). Superseded or forgotten since: ``req`` now names what
        its namespace is served. Still the one served: the engine lost it, and is told to load it again."""
        name = req.lora_path
        if name is None or name not in str(error):
            return False
        served = self.served.get(parse_adapter_name(name)[0])
        if served is None or served.name != name:
            req.lora_path = None if served is None else served.name
            return True
        load = getattr(self.engine, "load_lora_adapter", None)
        if load is None:  # an engine without multi-LoRA serving: its refusal stands
            return False
        async with self._loading.setdefault(name, asyncio.Lock()):  # one reload, however many requests met it
            res = await load(served.name, served.path)
        if getattr(res, "success", False):
            log.warning("the engine did not hold adapter %s: loaded it again from %s", name, served.path)
        return True  # loaded now, or by a request before this one ("already loaded"): the next try tells


def check_serves_adapters(engine: Engine) -> None:
    """ConfigError unless ``engine`` serves LoRA adapters by name (``load_lora_adapter``): an engine that
    ignored ``lora_path`` would serve the base while the turn recorded an adapter."""
    if not hasattr(engine, "load_lora_adapter"):
        raise ConfigError(f"[ppo] adapters = 'namespace' needs a serving engine that serves LoRA adapters; "
                          f"{type(engine).__name__} does not (SGLang: start it with --enable-lora)")


def serve_adapters(service: Any, checkpoints: Path) -> ServedAdapters:
    """Make the gateway's ChatService send each namespace's requests with its served adapter."""
    served = ServedAdapters(checkpoints)
    service.engine = AdapterEngine(service.engine, served)
    service.adapter_of = served.name_for
    return served
