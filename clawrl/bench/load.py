"""Load: N concurrent simulated users in multi-turn sessions against a real gateway for D seconds,
while the judge and train flows run and sync new weights into the gateway's engine.

``clawrl serve`` (uvicorn, the embedded tiny engine, open on loopback) runs in its own process. Here,
the users (openai SDK, one client, no retries: every failed request counts) run on a background
thread and the judge (rule) and train flows in a loop on the main thread, the train flow syncing
through the gateway's /engine as ``clawrl up`` does. The flows, MLflow and the trainer are warmed
up before the clock starts (the gate's evaluation engine loaded too), so the window measures serving
under training, not cold starts.

A user picks a persona and a question (clawrl/sim), asks (a main turn) and reacts as the persona
would (the next state the judge reads), for ``turns_per_session`` turns, the last sent with
``session_done``; then starts a new session. No turn starts after the window; turns in flight count.

Figures: requests, errors (must be 0), main turns acknowledged vs logged afterwards (equal, turn by
turn), client-side latency p50/p99, throughput, the weight versions served, and the train steps and
weight syncs completed inside the window. Per train step, the loop latency: from the next state that
completed its batch (the newest next state of the batch's turns, as logged) to the first response a
client got from the new version, split into the judge's delay (that next state -> the batch's last
fate), the PPO step, the promotion gate's evaluation, the sync, and what is left: the loop's
orchestration overhead (Prefect, claiming, lineage, recording, waiting for the next request). The
gate's evaluation is also reported as a share of the window. The gate evaluates every candidate as
configured and promotes each (``BENCH_GATE``): on the random-init models the bench serves, its decisions
are noise (a run on the 2-core VM saw eight candidates in a row refused on 16 prompts, 0.000 vs 0.062), and a
refused candidate leaves nothing new to serve, which is what the bench measures.

With ``up`` the whole system runs as a user runs it, `clawrl up`, and this process only drives the
users; the train steps are read back from the data root and up's Prefect API (clawrl/bench/load_up.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai

from clawrl.bench.common import STOP_TIMEOUT_S, bench_dtype, bench_env, clawrl_service, load_average
from clawrl.bench.load_up import drive_up, task_seconds
from clawrl.ports import free_api_port
from clawrl.supervisor import engine_group, start, stop, wait_healthy
from clawrl.sim.personas import PERSONAS, react
from clawrl.sim.prompts import QUESTIONS

SESSION_PREFIX = "load-"


@dataclass
class Run:
    """What the clients saw and the train steps done, over the measured window: ``duration_s`` long,
    held open past that (up to 4x + 240 s) until ``min_syncs`` weight syncs are done and a client was
    served a new version, so a slow machine still shows serving across a sync instead of ending before
    the first one. ``progress`` gets the live counters after every request."""

    duration_s: float
    min_syncs: int
    progress: Callable[[dict[str, Any]], None] | None = None
    t0: float = field(default_factory=time.monotonic)
    t0_wall: float = field(default_factory=time.time)  # the same instant on the clock the tables use
    ended_s: float | None = None  # when the last user stopped (turns in flight included)
    latencies: list[float] = field(default_factory=list)
    acked: list[tuple[str, int]] = field(default_factory=list)  # (session id, turn index) of each 200
    errors: list[str] = field(default_factory=list)
    versions: Counter = field(default_factory=Counter)
    first_seen: dict[str, float] = field(default_factory=dict)  # version -> when a client first got it
    steps: list[dict[str, Any]] = field(default_factory=list)  # train steps, each with its sync
    synced_versions: frozenset[str] = frozenset()  # versions synced by flows not run here (up mode)
    stopped: bool = False  # closed now, whatever the clock (what serves the users is gone)
    completion_tokens: int = 0
    sessions_started: int = 0
    sessions_done: int = 0
    engine_stats: list[dict[str, Any]] = field(default_factory=list)  # per `clawrl engine`, after the window
    prefix_hits: int = 0  # answers whose prompt started with a prefix the engine had cached

    @property
    def requests(self) -> int:
        return len(self.acked) + len(self.errors)

    def syncs(self) -> int:
        return len({st["weight_version"] for st in self.steps if st["synced"]} | self.synced_versions)

    def closed(self) -> bool:
        elapsed = time.monotonic() - self.t0
        if self.stopped:
            return True
        if elapsed < self.duration_s:
            return False
        served_a_sync = self.syncs() >= self.min_syncs and len(self.versions) > 1
        return elapsed >= 4 * self.duration_s + 240 or self.min_syncs == 0 or served_a_sync

    def record(self, session_id: str, r, seconds: float) -> None:
        self.latencies.append(seconds)
        self.acked.append((session_id, int(r.model_extra["turn_index"])))
        version = str(r.model_extra["weight_version"])
        self.versions[version] += 1
        self.first_seen.setdefault(version, time.monotonic() - self.t0)
        self.completion_tokens += r.usage.completion_tokens if r.usage else 0
        details = r.usage.prompt_tokens_details if r.usage else None
        self.prefix_hits += bool(details and details.cached_tokens)  # the engine found the turn's prefix cached
        self.report()

    def report(self) -> None:
        if self.progress is not None:
            self.progress({"elapsed_s": time.monotonic() - self.t0, "duration_s": self.duration_s,
                           "requests": self.requests, "errors": len(self.errors), "syncs": self.syncs(),
                           "versions": sorted(self.versions, key=lambda v: (len(v), v))})


# With several engines, each session opens with a system prompt of its own, as an agent's does (its id first,
# so no two sessions share a block of the engines' prefix caches): ~200 tokens that a session's later turns
# find in the prefix cache of the engine that served its earlier ones, and nowhere else.
AGENT_PROMPT = " ".join(["You are a careful assistant. Answer briefly, in plain words, and stay on the user's "
                         "topic; say so when you do not know."] * 8)


async def _user(client: openai.AsyncOpenAI, i: int, run: Run, *, turns_per_session: int, max_tokens: int,
                system_prompt: bool = False) -> None:
    """User ``i``: one session after another until the window closes (module docstring)."""
    rng = random.Random(i)  # user i makes the same choices in every run
    personas = sorted(PERSONAS)
    for k in itertools.count():
        if run.closed():
            return
        sid, persona = f"{SESSION_PREFIX}{i:03d}-{k:04d}", PERSONAS[rng.choice(personas)]
        question, keywords = QUESTIONS[rng.randrange(len(QUESTIONS))]
        messages = [*([{"role": "system", "content": f"Session {sid}. {AGENT_PROMPT}"}] if system_prompt else []),
                    {"role": "user", "content": question}]
        run.sessions_started += 1
        for turn in range(turns_per_session):
            if run.closed():
                break  # no new turn after the window (the session then ends by idle timeout)
            done = turn == turns_per_session - 1
            sent_at = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model="clawrl-policy", messages=messages, max_tokens=max_tokens, temperature=1.0,
                    seed=rng.randrange(2**31), extra_body={"session_id": sid, "turn_type": "main",
                                                           "session_done": done})
            except Exception as e:  # noqa: BLE001 - every failure is a figure
                run.errors.append(f"{sid} turn {turn}: {type(e).__name__}: {e}"[:400])
                run.report()
                await asyncio.sleep(0.5)  # a failing gateway is not hammered
                break
            run.record(sid, r, time.perf_counter() - sent_at)
            if done:
                run.sessions_done += 1
                break
            answer = r.choices[0].message.content or ""
            reply, _, _ = react(persona, answer, keywords, question)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": reply}]


async def _users(base_url: str, n_users: int, run: Run, **user_options) -> None:
    """``n_users`` concurrent users (:func:`_user`)."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=300.0) as client:
        try:
            await asyncio.gather(*(_user(client, i, run, **user_options) for i in range(n_users)))
        finally:
            run.ended_s = time.monotonic() - run.t0


# the gate's evaluation runs and is timed; any drop is within the tolerance and none is significant at alpha
BENCH_GATE = {"gate.tolerance": 1.0, "gate.alpha": 1e-9}


def _write_config(data_root: Path, model_cache: Path, port: int, rollout_batch_size: int, max_tokens: int,
                  device: str, dtype: str, model: str = "tiny", engine_url: str | None = None,
                  extra: dict[str, Any] | None = None) -> str:
    """The bench's config file under ``data_root``; ``extra``: more 'section.key' overrides."""
    from clawrl.config import dump_toml, load_settings

    engines = {"engine.url": engine_url} if engine_url else {}
    s = load_settings(env={}, overrides={**engines, **BENCH_GATE, **(extra or {}),
        "model.name": model, "model.device": device, "model.dtype": dtype,
        "storage.data_root": str(data_root), "storage.model_cache": str(model_cache),
        "server.open_mode": True, "server.api_port": port, "ppo.rollout_batch_size": rollout_batch_size,
        "ppo.micro_batch_size": min(rollout_batch_size, 8), "ppo.max_new_tokens": max_tokens,
        "ppo.advantage_estimator": "grpo", "ppo.max_staleness": 1000, "ppo.lr": 1e-4, "ppo.temperature": 1.0,
        "prm.backend": "rule", "prm.judge_samples": 1})
    data_root.mkdir(parents=True, exist_ok=True)
    conf = data_root / "load-bench.toml"
    conf.write_text(dump_toml(s))
    return str(conf)


def _warm_up(s, conf: str) -> None:
    """Outside the window, while the gateway starts: the Prefect API, MLflow's store and experiment
    (and its lazy imports), the trainer's model and the promotion gate's evaluation engine."""
    import mlflow.data  # noqa: F401 - first use costs seconds; log_train_step needs it

    from clawrl import runtime
    from clawrl.flows.common import eval_engine, local_trainer
    from clawrl.flows.judge import judge_flow
    from clawrl.lineage import client, experiment_id

    judge_flow(config_path=conf)
    experiment_id(client(s.storage.data_root), s.storage.data_root)
    local_trainer(s)
    if s.gate.enabled:
        runtime.run(eval_engine(s).start())


def _judge_and_train(users: threading.Thread, conf: str, engine_url: str, run: Run, judge_limit: int) -> int:
    """Run the judge and train flows in turn while ``users`` runs; append each train step (with its
    sync) to ``run.steps``; return the turns judged."""
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    judged = 0
    users.join(1.0)  # let the first turns arrive: a judge run at t=0 would find nothing
    while users.is_alive():
        judged += judge_flow(config_path=conf, limit=judge_limit)["judged"]
        state = train_flow(config_path=conf, max_steps=1, engine_url=engine_url, return_state=True)
        out, tasks = state.result(), task_seconds(state.state_details.flow_run_id)
        run.steps += [{"weight_version": st["weight_version"], "batch_id": st["batch_id"], "tasks_s": tasks,
                       "at_s": time.monotonic() - run.t0, "train_s": st["metrics"].get("step_time_s"),
                       "checkpoint_s": st["metrics"].get("checkpoint_write_s"),
                       "read_s": _seconds(st, "batch_read_s"), "state_s": _seconds(st, "state_wait_s", "state_copy_s"),
                       "eval_s": st["gate"].get("eval_seconds", 0.0),
                       "synced": bool(st["sync"]["success"]), "sync_s": st["sync"].get("seconds"),
                       "sync_message": st["sync"]["message"]} for st in out["steps"]]
        if not out["steps"]:
            users.join(0.5)
    return judged


def _seconds(step: dict[str, Any], *keys: str) -> float:
    """The sum of a train step's timing metrics ``keys`` (a trainer that predates one counts 0)."""
    return sum(step["metrics"].get(k) or 0.0 for k in keys)


def run_load_bench(*, model_cache: Path, sessions: int = 64, duration_s: float = 60.0, rollout_batch_size: int = 8,
                   max_tokens: int = 16, turns_per_session: int = 3, data_root: Path | None = None,
                   min_syncs: int = 0, device: str = "cpu", model: str = "tiny", engines: int = 0, up: bool = False,
                   judge_every_s: float = 5.0, train_every_s: float = 30.0,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the load benchmark, the gateway's engine and the trainer on ``device``; returns the figures
    (module docstring). ``engines`` > 0: that many `clawrl engine` processes behind the gateway (several
    behind SGLang's router, each session opening with a system prompt of its own) instead of its
    embedded engine. ``min_syncs``: hold the window open past
    ``duration_s`` until that many syncs were served (:class:`Run`). ``progress`` gets a dict of live
    counters after every request. ``up``: the system runs as `clawrl up` (its flow server judging every
    ``judge_every_s`` and training at least every ``train_every_s``) and this process only drives the
    users; else this process runs the flows, and needs a Prefect API (a test harness, ``clawrl up``'s
    server, or the ephemeral one Prefect starts)."""
    if up and engines:
        raise ValueError("the up mode serves from the gateway's embedded engine: engines must be 0")
    root = Path(data_root or tempfile.mkdtemp(prefix="clawrl-loadbench-"))
    port, dtype = free_api_port(), bench_dtype(device)
    # turns per judge run: a bounded bite (each turn is a task), so the next train step starts soon
    judge_limit = max(16, 2 * rollout_batch_size)
    write = functools.partial(_write_config, root, model_cache, port, rollout_batch_size, max_tokens, device, dtype,
                              model)
    new_run, gw = functools.partial(Run, duration_s, min_syncs, progress), f"http://127.0.0.1:{port}"
    users = {"n_users": sessions, "turns_per_session": turns_per_session, "max_tokens": max_tokens,
             **({"system_prompt": True} if engines else {})}
    logging.disable(logging.INFO)  # flow-run INFO lines would scroll through the progress line
    try:
        if up:
            judged, run, loads = drive_up(write, root, gw, new_run, lambda r: _start_users(gw, r, users),
                                          max_tokens=max_tokens, judge_limit=judge_limit, judge_every_s=judge_every_s,
                                          train_every_s=train_every_s, session_prefix=SESSION_PREFIX)
        else:
            judged, run, loads = _drive_flows(write, root, gw, new_run, users, engines=engines,
                                              judge_limit=judge_limit)
    finally:
        logging.disable(logging.NOTSET)
    wall, load_before, load_after = loads
    return {"mode": "up" if up else "flows", "sessions": sessions, "engines": engines, "duration_s": duration_s,
            "routing": "SGLang router" if engines > 1 else ("direct" if engines else "embedded"),
            "turns_per_session": turns_per_session, "max_tokens": max_tokens, "rollout_batch_size": rollout_batch_size,
            "judge_limit": judge_limit, "turns_judged": judged, "load_1m_before": load_before,
            "load_1m_after": load_after, "device": device, "model": model, "dtype": dtype, "window_s": run.ended_s,
            **({"judge_every_s": judge_every_s, "train_every_s": train_every_s} if up else {}),
            "data_root": str(root), **_figures(root, run, wall)}


def _start_users(gw: str, run: Run, users: dict[str, int]) -> threading.Thread:
    """The users (:func:`_users`) on a background thread, started."""
    n_users, options = users["n_users"], {k: v for k, v in users.items() if k != "n_users"}
    thread = threading.Thread(name="load-users", daemon=True, target=lambda: asyncio.run(_users(
        gw, n_users, run, **options)))
    thread.start()
    return thread


def _drive_flows(write, root: Path, gw: str, new_run, users: dict[str, int], *, engines: int,
                 judge_limit: int) -> tuple[int, Run, tuple[float, float, float]]:
    """`clawrl serve` (its embedded engine; one `clawrl engine` process; or several behind SGLang's router,
    as `clawrl up --engines N` runs them) in its own process, the users on a thread and the judge and train
    flows in a loop here: the turns judged, the run, and (wall seconds, load average before, after)."""
    from clawrl.config import PORT_OFFSETS
    from clawrl.flows.common import load_flow_settings  # the Prefect layer: imported where the bench drives it

    port = int(gw.rsplit(":", 1)[1]) + PORT_OFFSETS["engine"]  # free: the gateway's is a free_api_port()
    conf = write(engine_url=f"http://127.0.0.1:{port}" if engines else None)
    s, env = load_flow_settings(conf), bench_env()
    group = engine_group("engine", Path(conf), "127.0.0.1", port, engines)  # the engines, then their router
    gateway = clawrl_service("gateway", ["serve", "-c", conf], f"{gw}/healthz")
    try:
        for svc in group:
            start(svc, root, env)
        for svc in group:  # up before the gateway asks them what they serve
            wait_healthy(svc)
        start(gateway, root, env)
        _warm_up(s, conf)  # while the gateway starts
        wait_healthy(gateway)
        load_before, run = load_average(), new_run()
        thread = _start_users(gw, run, users)
        try:
            judged = _judge_and_train(thread, conf, f"{gw}/engine", run, judge_limit)
        finally:
            thread.join()
            run.report()
        wall, load_after = time.monotonic() - run.t0, load_average()
        run.engine_stats = [_engine_stats(svc.url) for svc in group[:engines]]
    finally:
        for svc in [gateway, *reversed(group)]:
            stop(svc, STOP_TIMEOUT_S)
    return judged, run, (wall, load_before, load_after)


def _engine_stats(url: str) -> dict[str, Any]:
    """What one `clawrl engine` counted: the requests it finished."""
    import httpx

    return {"url": url, "requests_done": httpx.get(f"{url}/server_info", timeout=10).json()["internal_states"][0]
            ["requests_done"]}


def _figures(root: Path, run: Run, wall: float) -> dict[str, Any]:
    """What the clients saw, checked against the log of the stopped gateway (its store is flushed):
    every acknowledged main turn must be in it."""
    from clawrl.storage.catalog import run_query

    rows = run_query(root, f"select distinct session_id, turn_index from turns where turn_type = 'main' "
                           f"and session_id like '{SESSION_PREFIX}%'").to_pylist()
    logged, acked = {(r["session_id"], r["turn_index"]) for r in rows}, set(run.acked)
    p50, p99 = (1000 * np.percentile(run.latencies, [50, 99])).tolist() if run.latencies else (None, None)
    # A sync counts as inside the window when its flow run returned in it, or when a client was
    # already served the new version in it (the flow run returns a little after its sync).
    for st in run.steps:
        st["first_served_s"] = run.first_seen.get(st["weight_version"])
        st.update(_loop_latency(root, run, st))
    in_window = [st for st in run.steps if st["at_s"] <= run.ended_s
                 or (st["first_served_s"] is not None and st["first_served_s"] <= run.ended_s)]
    return {
        "requests": run.requests, "errors": len(run.errors), "error_samples": run.errors[:5],
        "sessions_started": run.sessions_started, "sessions_completed": run.sessions_done,
        "requests_per_engine": [e["requests_done"] for e in run.engine_stats],
        "prefix_hits_per_session": run.prefix_hits / max(run.sessions_started, 1),
        "main_turns_sent": len(run.acked), "main_turns_logged": len(logged),
        "sent_not_logged": len(acked - logged), "logged_not_sent": len(logged - acked),
        "p50_ms": p50, "p99_ms": p99,
        "requests_per_s": run.requests / wall, "completion_tokens_per_s": run.completion_tokens / wall,
        "weight_versions_seen": dict(sorted(run.versions.items(), key=lambda kv: (len(kv[0]), kv[0]))),
        "train_steps": len(run.steps), "syncs_during_run": sum(1 for st in in_window if st["synced"]),
        "failed_syncs": [st["sync_message"] for st in run.steps if not st["synced"]], "steps": run.steps,
    }


def _loop_latency(root: Path, run: Run, step: dict[str, Any]) -> dict[str, float | None]:
    """``loop_s``: the batch's last next state -> the first response on the step's version, split
    into ``judged_s`` (-> the batch's last fate), ``queued_s`` (-> the batch claimed: the trainer was
    busy, or the loop judging), the flow from the claim to the end of the sync (the PPO step, the
    checkpoint write, the gate's evaluation, the sync, and ``orchestration_s``: the rest of the flow) and ``served_s``
    (the sync's end -> the first response on the new version: requests must start and finish).
    None when no client got the version."""
    from clawrl.storage.catalog import run_query

    [row] = run_query(root, f"""
        with b as (select batch_id, created_at as claimed, u.sid from batches, unnest(sample_ids) as u(sid)
                   where batch_id = '{step['batch_id']}')
        select epoch(max(n.created_at)) as completed, epoch(max(f.created_at)) as judged,
               epoch(min(b.claimed)) as claimed,
               (select epoch(min(y.created_at)) from syncs y
                where y.weight_version = '{step['weight_version']}' and y.ok and not y.skipped) as synced
        from b join samples s on s.sample_id = b.sid join next_states n on n.turn_id = s.turn_id
        join turn_fate f on f.turn_id = s.turn_id and f.judge_config_hash = s.judge_config_hash
        where n.has_next_state""").to_pylist()
    keys = ("loop_s", "judged_s", "queued_s", "served_s", "orchestration_s")
    if step["first_served_s"] is None or None in (row["completed"], row["claimed"], row["synced"]):
        return dict.fromkeys(keys)
    first = run.t0_wall + step["first_served_s"]
    # the engine serves the version before the sync call that swapped it returns and is recorded: a client
    # may get it milliseconds before the sync's row, which then bounds nothing
    synced = min(row["synced"], first)
    judged = max(row["judged"], row["completed"])
    spent = sum(step.get(k) or 0.0 for k in ("read_s", "train_s", "state_s", "checkpoint_s", "eval_s", "sync_s"))
    flow = synced - row["claimed"] - spent
    return dict(zip(keys, (first - row["completed"], judged - row["completed"], max(0.0, row["claimed"] - judged),
                           first - synced, flow)))
