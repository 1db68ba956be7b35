"""Load: N concurrent simulated users in multi-turn sessions against a real gateway for D seconds,
while the judge and train flows run and sync new weights into the gateway's engine.

Topology: ``clawrl serve`` (uvicorn, embedded tiny engine, open mode on loopback) in its own
process; this process runs the users (openai SDK ``AsyncOpenAI``, one client, one connection per
user, no retries: every failed request counts) on a background thread, and the judge (rule) and
train flows in a loop on the main thread. The train flow syncs through the gateway's /engine, as
``clawrl up`` does. Before the clock starts, the flows, MLflow's store and the trainer are warmed
up once, so the window measures serving under training, not cold starts.

A user: picks a persona and a question (clawrl/sim), asks (main turn), reacts to the answer as
the persona would (thanks / a correction / "that's not what I asked": the next state the judge
reads), for ``turns_per_session`` turns, the last one sent with ``session_done``; then a new
session. Users start no turn after the window; turns in flight then finish and count.

Figures: requests, errors (must be 0), main turns acknowledged vs main turns in the log afterwards
(must be equal, turn by turn), client-side latency p50/p99, throughput, the weight versions the
clients were served, and the train steps / weight syncs that completed inside the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clawrl.bench.gateway import _free_port, _pct, _wait
from clawrl.sim.personas import PERSONAS, react
from clawrl.sim.prompts import QUESTIONS

SESSION_PREFIX = "load-"


@dataclass
class ClientStats:
    latencies: list[float] = field(default_factory=list)
    acked: list[tuple[str, int]] = field(default_factory=list)  # (session id, turn index) of each 200
    errors: list[str] = field(default_factory=list)
    versions: Counter = field(default_factory=Counter)
    first_seen: dict[str, float] = field(default_factory=dict)  # version -> when a client first got it
    completion_tokens: int = 0
    sessions_started: int = 0
    sessions_done: int = 0

    @property
    def requests(self) -> int:
        return len(self.acked) + len(self.errors)


async def _users(base_url: str, n_users: int, t0: float, t_end: float, *, turns_per_session: int, max_tokens: int,
                 seed: int, stats: ClientStats) -> None:
    import openai

    limits = httpx.Limits(max_connections=n_users + 8, max_keepalive_connections=n_users + 8)
    http = openai.DefaultAsyncHttpxClient(limits=limits)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=300.0,
                                http_client=http)
    personas = sorted(PERSONAS)

    async def user(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        k = 0
        while time.monotonic() < t_end:
            sid, k = f"{SESSION_PREFIX}{i:03d}-{k:04d}", k + 1
            persona = PERSONAS[personas[rng.randrange(len(personas))]]
            question, keywords = QUESTIONS[rng.randrange(len(QUESTIONS))]
            messages = [{"role": "user", "content": question}]
            stats.sessions_started += 1
            for turn in range(turns_per_session):
                if time.monotonic() >= t_end:
                    break  # no new turn after the window (the session then ends by idle timeout)
                done = turn == turns_per_session - 1
                sent_at = time.perf_counter()
                try:
                    r = await client.chat.completions.create(
                        model="clawrl-policy", messages=messages, max_tokens=max_tokens, temperature=1.0,
                        seed=rng.randrange(2**31), extra_body={"session_id": sid, "turn_type": "main",
                                                               "session_done": done})
                except Exception as e:  # noqa: BLE001 - every failure is a figure
                    stats.errors.append(f"{sid} turn {turn}: {type(e).__name__}: {e}"[:400])
                    await asyncio.sleep(0.5)  # a failing gateway is not hammered
                    break
                stats.latencies.append(time.perf_counter() - sent_at)
                stats.acked.append((sid, int(r.model_extra["turn_index"])))
                version = str(r.model_extra["weight_version"])
                stats.versions[version] += 1
                stats.first_seen.setdefault(version, time.monotonic() - t0)
                stats.completion_tokens += r.usage.completion_tokens if r.usage else 0
                if done:
                    stats.sessions_done += 1
                    break
                answer = r.choices[0].message.content or ""
                reply, _, _ = react(persona, answer, keywords, question)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": reply}]

    try:
        await asyncio.gather(*(user(i) for i in range(n_users)))
    finally:
        await client.close()


@contextlib.contextmanager
def _quiet(names: tuple[str, ...], level: int = logging.WARNING):
    """Flow-run INFO lines would scroll through the progress bar; the figures say what happened."""
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, before):
            lg.setLevel(lv)


def _write_config(data_root: Path, model_cache: Path, port: int, rollout_batch_size: int, max_tokens: int) -> Path:
    from clawrl.config import dump_toml, load_settings

    s = load_settings(env={}, overrides={
        "model.name": "tiny", "storage.data_root": str(data_root), "storage.model_cache": str(model_cache),
        "server.open_mode": True, "server.api_port": port, "ppo.rollout_batch_size": rollout_batch_size,
        "ppo.micro_batch_size": min(rollout_batch_size, 8), "ppo.max_new_tokens": max_tokens,
        "ppo.advantage_estimator": "grpo", "ppo.max_staleness": 1000, "ppo.lr": 1e-4, "ppo.temperature": 1.0,
        "prm.backend": "rule", "prm.judge_samples": 1})
    data_root.mkdir(parents=True, exist_ok=True)
    conf = data_root / "load-bench.toml"
    conf.write_text(dump_toml(s))
    return conf


def run_load_bench(*, model_cache: Path, sessions: int = 64, duration_s: float = 60.0, rollout_batch_size: int = 8,
                   max_tokens: int = 16, turns_per_session: int = 3, seed: int = 0, data_root: Path | None = None,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the load benchmark; returns the figures (module docstring). ``progress`` gets a dict of
    live counters about twice a second. Needs a Prefect API (a test harness, ``clawrl up``'s
    server, or the ephemeral one Prefect starts)."""
    from clawrl.bench.report import describe_machine, load_average
    from clawrl.config import OFFLINE_ENV
    from clawrl.storage.catalog import run_query

    # flows/ is the Prefect layer: imported here, where the benchmark drives it, not at module import
    from clawrl.flows.common import load_flow_settings
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import local_trainer, train_flow

    root = Path(data_root or tempfile.mkdtemp(prefix="clawrl-loadbench-"))
    port = _free_port()
    conf = _write_config(root, model_cache, port, rollout_batch_size, max_tokens)
    s = load_flow_settings(str(conf))
    gw = f"http://127.0.0.1:{port}"
    # The gateway runs open (loopback, no keys): keys the caller has in its env are not passed on,
    # so a key set there cannot make every simulated user a 401.
    env = {k: v for k, v in os.environ.items() if k not in (s.server.api_keys_env, s.server.admin_keys_env)}
    env.update(OFFLINE_ENV)
    log_path = root / "gateway.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "clawrl.cli", "serve", "-c", str(conf)], env=env,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    stats = ClientStats()
    steps: list[dict[str, Any]] = []
    judged_total = 0
    judge_limit = max(16, 2 * rollout_batch_size)
    flow_runs: list[dict[str, Any]] = []
    try:
        t_start = time.monotonic()
        with _quiet(("prefect", "prefect.flow_runs", "prefect.task_runs")):
            # warm-up while the gateway starts, outside the window: the Prefect API, MLflow's store
            # and experiment (and its lazy imports), the trainer's model
            judge_flow(config_path=str(conf))
            import mlflow.data  # noqa: F401 - first use costs seconds; log_train_step needs it

            from clawrl.lineage import client as mlflow_client
            from clawrl.lineage import experiment_id

            experiment_id(mlflow_client(root), root)
            local_trainer(s)
            _wait(f"{gw}/healthz", proc, timeout_s=300)
            warmup_s = time.monotonic() - t_start
            load_before = load_average()
            t0 = time.monotonic()
            t_end = t0 + duration_s
            users = threading.Thread(target=lambda: asyncio.run(_users(
                gw, sessions, t0, t_end, turns_per_session=turns_per_session, max_tokens=max_tokens, seed=seed,
                stats=stats)), name="load-users", daemon=True)
            users.start()

            def report() -> None:
                if progress is not None:
                    progress({"elapsed_s": min(time.monotonic() - t0, duration_s), "duration_s": duration_s,
                              "requests": stats.requests, "errors": len(stats.errors),
                              "syncs": sum(1 for st in steps if st["synced"]),
                              "versions": sorted(stats.versions, key=lambda v: (len(v), v))})

            ticker_stop = threading.Event()

            def tick() -> None:
                while not ticker_stop.wait(0.5):
                    report()

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            try:
                users.join(1.0)  # let the first turns arrive: a judge run at t=0 would find nothing
                while users.is_alive():
                    t_judge = time.monotonic()
                    # a bounded bite per run (each turn is a task): the next train step starts soon
                    judged = judge_flow(config_path=str(conf), limit=judge_limit)["judged"]
                    judged_total += judged
                    t_train = time.monotonic()
                    out = train_flow(config_path=str(conf), max_steps=1, engine_url=f"{gw}/engine")
                    flow_runs.append({"judge_at_s": round(t_judge - t0, 2), "judged": judged,
                                      "judge_s": round(t_train - t_judge, 2),
                                      "train_s": round(time.monotonic() - t_train, 2),
                                      "steps": len(out["steps"])})
                    for st in out["steps"]:
                        steps.append({"weight_version": st["weight_version"], "at_s": time.monotonic() - t0,
                                      "synced": bool(st["sync"]["success"]), "sync_s": st["sync"].get("seconds"),
                                      "sync_message": st["sync"]["message"]})
                    if not out["steps"]:
                        users.join(0.5)
            finally:
                users.join()
                ticker_stop.set()
                ticker.join()
                report()
            wall = time.monotonic() - t0
            load_after = load_average()
    finally:
        _stop_gateway(proc)
    # the gateway is stopped (its store flushed); every acknowledged main turn must be in the log
    rows = run_query(root, f"select distinct session_id, turn_index from turns where turn_type = 'main' "
                           f"and session_id like '{SESSION_PREFIX}%'").to_pylist()
    logged = {(r["session_id"], r["turn_index"]) for r in rows}
    acked = set(stats.acked)
    lat = stats.latencies
    # A sync counts as inside the window when its flow run returned in it, or when a client was
    # already served the new version in it (the flow run returns a little after its sync).
    for st in steps:
        st["first_served_s"] = stats.first_seen.get(st["weight_version"])
    in_window = [st for st in steps if st["at_s"] <= duration_s
                 or (st["first_served_s"] is not None and st["first_served_s"] <= duration_s)]
    return {
        "sessions": sessions, "duration_s": duration_s, "wall_s": round(wall, 1),
        "turns_per_session": turns_per_session,
        "max_tokens": max_tokens, "rollout_batch_size": rollout_batch_size,
        "requests": stats.requests, "errors": len(stats.errors), "error_samples": stats.errors[:5],
        "sessions_started": stats.sessions_started, "sessions_completed": stats.sessions_done,
        "main_turns_sent": len(stats.acked), "main_turns_logged": len(logged),
        "sent_not_logged": len(acked - logged), "logged_not_sent": len(logged - acked),
        "p50_ms": 1000 * _pct(lat, 0.50) if lat else None, "p99_ms": 1000 * _pct(lat, 0.99) if lat else None,
        "mean_ms": 1000 * sum(lat) / len(lat) if lat else None,
        "requests_per_s": stats.requests / wall, "completion_tokens_per_s": stats.completion_tokens / wall,
        "weight_versions_seen": dict(sorted(stats.versions.items(), key=lambda kv: (len(kv[0]), kv[0]))),
        "train_steps": len(steps), "syncs_during_run": sum(1 for st in in_window if st["synced"]),
        "failed_syncs": [st["sync_message"] for st in steps if not st["synced"]], "steps": steps,
        "turns_judged": judged_total, "flow_runs": flow_runs, "warmup_s": round(warmup_s, 1),
        "load_1m_before": load_before, "load_1m_after": load_after,
        "machine": describe_machine(), "data_root": str(root),
    }


def _stop_gateway(proc: subprocess.Popen) -> None:
    """SIGTERM: uvicorn finishes open requests and the lifespan closes (flushes) the store."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def format_load_section(r: dict[str, Any], machine_line: str) -> str:
    from clawrl.bench.report import markdown_table

    row = {k: r[k] for k in ("sessions", "duration_s", "requests", "errors", "main_turns_sent", "main_turns_logged",
                             "p50_ms", "p99_ms", "requests_per_s", "completion_tokens_per_s", "train_steps",
                             "syncs_during_run")}
    row["weight_versions_seen"] = ", ".join(f"v{v}: {n}" for v, n in r["weight_versions_seen"].items())
    row["load_1m"] = f"{r['load_1m_before']} -> {r['load_1m_after']}"
    def when(st: dict[str, Any]) -> str:
        served = st["first_served_s"]
        return (f"v{st['weight_version']}: sync took {st['sync_s']:.2f} s, first served at "
                f"{'-' if served is None else f'{served:.1f} s'}, flow run done at {st['at_s']:.1f} s")

    syncs = "; ".join(when(st) for st in r["steps"] if st["synced"] and st["sync_s"] is not None)
    lines = [
        "## Load: concurrent sessions while judging, training and syncing",
        "",
        machine_line,
        f"`clawrl bench load`: {r['sessions']} simulated users (clawrl/sim personas, openai SDK AsyncOpenAI, "
        "no retries)",
        f"in multi-turn sessions ({r['turns_per_session']} main turns each, the last with `session_done`) against",
        "`clawrl serve` (a separate process: uvicorn, the embedded tiny engine) for the window below, while this",
        "process runs the judge flow (rule judge) and the train flow (GRPO, rollout_batch_size "
        f"{r['rollout_batch_size']}) in a loop; each",
        "train step syncs its checkpoint into the serving engine through the gateway's /engine, as `clawrl up` does.",
        f"{r['max_tokens']} new tokens per turn, temperature 1. Latency is client-side, per request, across the syncs.",
        "`main_turns_logged`: acknowledged (session, turn index) pairs found in the `turns` table after the gateway",
        "stopped; the two must be equal and `errors` 0.",
        "",
        markdown_table([row], list(row)),
        "",
        f"Weight syncs (times from the window's start): {syncs or 'none'}. Turns judged: {r['turns_judged']} (the",
        f"judge takes at most {max(16, 2 * r['rollout_batch_size'])} turns per run, so training starts early and keeps "
        "going; the rest wait, logged); sessions",
        f"started {r['sessions_started']}, completed {r['sessions_completed']}; sent but not logged: "
        f"{r['sent_not_logged']}. `load_1m`: the 1-minute load average",
        "before -> after the window; above the core count, other work shared the machine.",
    ]
    return "\n".join(lines)
