"""Shared by every benchmark: the machine and device it ran on, best-of-N timing, free ports and
`clawrl serve` / `clawrl engine` child processes, markdown tables, the verdicts on stated targets, and
replacing one section of ``docs/benchmarks.md`` while leaving the others alone (each benchmark owns the
text between its own ``<!-- NAME-bench:start -->`` / ``<!-- NAME-bench:end -->`` markers)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import tempfile
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawrl.bench import cpu_model
from clawrl.config import ServerSettings, Settings, child_env
from clawrl.config_sections import EngineSettings
from clawrl.models import resolve_dtype
from clawrl.supervisor import Service

# SIGTERM lets a server finish open requests and flush its store (`clawrl up` stops its parts in turn): SIGKILL
# only after a minute.
STOP_TIMEOUT_S = 60.0


def bench_dtype(device: str) -> str:
    """The dtype a bench runs its models in: what ``[model] dtype = "auto"`` means on ``device``."""
    return resolve_dtype("auto", str(torch.device(device)))


def machine_line(device: str, dtype: str) -> str:
    """The machine, the device the models ran on by name (so GPU and CPU figures are never confused), and when."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else cpu_model()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Machine: {os.cpu_count()} cores, {cpu_model()}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); device {device} ({name}), {dtype}; {date}.")


def gateway_settings(settings: Settings, model_dir: Path, data_root: Path, **engine: Any) -> Settings:
    """The settings of a bench's own gateway (:func:`gateway_on`): an embedded engine of ``model_dir``
    itself (never the config's HTTP engine, nor a checkpoint of a run), ``engine`` on top of the
    config's ``[engine]`` (validated: a key it lacks is an error), its turns under ``data_root``."""
    return settings.model_copy(update={
        "model": settings.model.model_copy(update={"name": str(model_dir)}),
        "engine": EngineSettings.model_validate({**settings.engine.model_dump(), **engine, "url": ""}),
        "storage": settings.storage.model_copy(update={"data_root": Path(data_root)})})


@contextlib.contextmanager
def gateway_on(settings: Settings, model_dir: Path, **engine: Any):
    """A gateway of :func:`gateway_settings` on loopback (a throwaway data root, where the answers are
    logged like any turns, then dropped), without API keys whatever the environment holds; yields its URL."""
    from clawrl.gateway.routes import build_engine
    from clawrl.serving import serve_own_gateway
    from clawrl.storage.writer import DataStore

    with tempfile.TemporaryDirectory() as tmp:
        s = gateway_settings(settings, model_dir, Path(tmp), **engine)
        served, tokenizer = build_engine(s)
        store = DataStore(tmp)
        gw = serve_own_gateway(s, engine=served, tokenizer=tokenizer, store=store)
        try:
            yield gw.url
        finally:
            gw.stop()
            store.close()


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, *, device: str = "cpu",
                      progress: Callable[[str], None] | None = None) -> dict[str, tuple[float, float]]:
    """(best, median) seconds of each function over ``repeats`` rounds, after ``warmup`` untimed calls
    of each. The functions alternate in each round, so a load spike on a shared machine, or the page
    cache's dirty-page throttling after hundreds of MB written, hits all of them alike. Best of N: the
    fastest run is the least disturbed one (another process can only ever make a run slower); the
    median beside it shows the noise. On a CUDA ``device`` each call is timed until the GPU is done
    (kernels return before their work is). ``progress(label)`` is called after each timed call."""
    done = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats):
        for k, fn in fns.items():
            done()
            t = time.perf_counter()
            fn()
            done()
            times[k].append(time.perf_counter() - t)
            if progress:
                progress(f"{k} (pass {i + 1}/{repeats})")
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


async def gather_bounded(concurrency: int, aws) -> list:
    """Await each of ``aws`` (coroutines, started here) with at most ``concurrency`` in flight: a closed
    loop of ``concurrency`` clients. Their results, in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(aw):
        async with gate:
            return await aw

    return await asyncio.gather(*(one(aw) for aw in aws))


def clawrl_service(name: str, args: list[str], health_url: str) -> Service:
    """``python -m clawrl.cli ARGS`` as a service of :mod:`clawrl.supervisor` (``start`` it with
    :func:`bench_env`, ``stop`` it with :data:`STOP_TIMEOUT_S`), up once ``health_url`` answers 200."""
    return Service(name, [sys.executable, "-m", "clawrl.cli", *args], health_url, health_url, ready_only_on_200=True)


def bench_env(**env: str) -> dict[str, str]:
    """The environment of the bench's servers: this process's with ``env`` on top, less the API keys: the
    servers run open on loopback, and a key would turn every bench request into a 401."""
    server = ServerSettings()
    return {k: v for k, v in child_env(**env).items() if k not in (server.api_keys_env, server.admin_keys_env)}


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A target a benchmark states: ``key`` of the row of ``system`` at ``concurrency`` is at least ``minimum``."""

    text: str
    system: str
    concurrency: int
    key: str
    minimum: float


def target_lines(rows: list[dict[str, Any]], targets: tuple[Target, ...], models: list[str]) -> list[str]:
    """One line per model of ``models``, each target on it MET or NOT MET with the measured value, or NOT
    MEASURED when the run has no such row (another concurrency, a model left out) or the row no such value."""
    lines = []
    for model in models:
        verdicts = []
        for t in targets:
            row = next((r for r in rows if (r["model"], r["system"], r["concurrency"]) == (model, t.system,
                                                                                           t.concurrency)), None)
            value = None if row is None else row.get(t.key)
            verdict = "NOT MEASURED" if value is None else \
                f"{'MET' if value >= t.minimum else 'NOT MET'} ({t.key} {value:.3g})"
            verdicts.append(f"{t.text} ({t.key} >= {t.minimum:g}): {verdict}")
        lines.append(f"- Targets ({model}): " + "; ".join(verdicts) + ".")
    return lines


def write_section(name: str, body: str, path: Path) -> Path:
    """Replace (or append) the section ``name`` of the report at ``path`` with ``body``."""
    start, end = f"<!-- {name}-bench:start -->", f"<!-- {name}-bench:end -->"
    section = f"{start}\n{body.rstrip()}\n{end}"
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nWritten by `clawrl bench ...`; each section is replaced by its own command.\n"
    text, found = re.subn(f"{re.escape(start)}.*?{re.escape(end)}", lambda _: section, text, count=1, flags=re.DOTALL)
    if not found:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
