"""The load benchmark's sections of docs/benchmarks.md (clawrl/bench/load.py runs it)."""

from __future__ import annotations

from statistics import median
from typing import Any

from clawrl.bench.common import machine_line, markdown_table

def format_load_section(r: dict[str, Any]) -> str:
    row = {k: r[k] for k in ("sessions", "duration_s", "window_s", "requests", "errors", "main_turns_sent", "main_turns_logged",
                             "p50_ms", "p99_ms", "requests_per_s", "completion_tokens_per_s", "train_steps",
                             "syncs_during_run")}
    row["weight_versions_seen"] = ", ".join(f"v{v}: {n}" for v, n in r["weight_versions_seen"].items())
    row["load_1m"] = f"{r['load_1m_before']} -> {r['load_1m_after']}"
    served = {st["weight_version"]: "-" if st["first_served_s"] is None else f"{st['first_served_s']:.1f} s"
              for st in r["steps"]}
    done = "sync ended" if r.get("mode") == "up" else "flow run done"
    syncs = "; ".join(f"v{st['weight_version']}: sync took {st['sync_s']:.2f} s, first served at "
                      f"{served[st['weight_version']]}, {done} at {st['at_s']:.1f} s"
                      for st in r["steps"] if st["synced"] and st["sync_s"] is not None)
    loop_keys = ["loop_s", "judged_s", "queued_s", "read_s", "train_s", "state_s", "checkpoint_s", "eval_s",
                 "sync_s", "orchestration_s", "served_s"]
    loops = [{"version": st["weight_version"], **{k: st[k] for k in loop_keys}, "claim_task_s": st["tasks_s"].get(
        "claim_batch"), "gate_task_s": st["tasks_s"].get("gate_checkpoint")}
             for st in r["steps"] if st.get("loop_s") is not None]
    loop_keys += [k for k in ("claim_task_s", "gate_task_s") if any(row[k] is not None for row in loops)]
    tasks = [{"version": st["weight_version"], **st["tasks_s"]} for st in r["steps"]
             if st.get("tasks_s") and st["synced"] and st["sync_s"] is not None]  # the steps a sync served
    task_names = list(dict.fromkeys(k for t in tasks for k in t if k != "version"))
    evals = [st["eval_s"] for st in r["steps"] if st["eval_s"]]
    eval_line = (f"The promotion gate's evaluation (an evaluation engine on the same device) took {median(evals):.2f} s "
                 f"a step (median of {len(evals)}), {100 * sum(evals) / r['window_s']:.1f}% of the window "
                 "(each candidate evaluated, then promoted whatever its score: the bench measures serving it)."
                 if evals else "The promotion gate evaluated nothing (off, or no step).")
    return "\n".join([
        f"## Load{' under `clawrl up`' if r.get('mode') == 'up' else ''}: concurrent sessions while judging, training "
        "and syncing",
        "",
        machine_line(r["device"], r["dtype"]),
        *_setup_lines(r),
        f"{r['max_tokens']} new tokens per turn, temperature 1; latency client-side, per request. `main_turns_logged` "
        "(acknowledged turns found in the `turns` table afterwards) must equal `main_turns_sent`, and `errors` be 0.",
        "",
        markdown_table([row], list(row)),
        "",
        f"Weight syncs (times from the window's start): {syncs or 'none'}. Turns judged: {r['turns_judged']} (at most "
        f"{r['judge_limit']} a judge run; the rest wait, logged); sessions started {r['sessions_started']}, completed "
        f"{r['sessions_completed']}; sent but not logged: {r['sent_not_logged']}. `load_1m`: before -> after the "
        "window.",
        "Loop latency per step: `loop_s`, from the logged next state that completed the step's batch to the first "
        "response on the new version, = `judged_s` (to the",
        "batch's last fate) + `queued_s` (to its claim) + the train flow to its sync's end: `read_s`, `train_s` (PPO "
        "step), `state_s` (optimizer state), `checkpoint_s`,",
        "`eval_s` (the gate), `sync_s`, `orchestration_s` (the rest: Prefect, claim, lineage, records; target <= 1 s) "
        "+ `served_s`. `*_task_s`: Prefect's task times.",
        "",
        markdown_table(loops, ["version", *loop_keys]) if loops
        else "No step's version reached a client inside the window.",
        "", f"{eval_line} Seconds each task of the train flow took, per synced step (Prefect's task run times; the "
        "path to the sync ends with `sync_weights`):", "",
        markdown_table(tasks, ["version", *task_names]) if tasks else "No train step.",
    ])


def _setup_lines(r: dict[str, Any]) -> list[str]:
    """Which mode ran, and who served, judged and trained in it."""
    users = (f"{r['sessions']} simulated users (clawrl/sim personas, openai SDK AsyncOpenAI, no retries) in "
             f"multi-turn sessions ({r['turns_per_session']} main turns each, the last with `session_done`)")
    train = f"the train flow (GRPO, rollout_batch_size {r['rollout_batch_size']})"
    if r.get("mode") == "up":
        return [f"Mode `up` (`clawrl bench load --up`): {users} against `clawrl up` (Prefect server, MLflow, trainer "
                f"service, gateway with the embedded engine running model `{r['model']}`, evaluation engine and flow "
                f"server, each a process of its own) for the window below. Up's flow server runs the judge flow (rule "
                f"judge) every {r['judge_every_s']:g} s and {train} when a judge run leaves a full batch (every "
                f"{r['train_every_s']:g} s at the latest); each train step syncs its checkpoint into the serving "
                "engine through the gateway's /engine. The bench process only drives the users."]
    return [f"Mode `flows` (`clawrl bench load`): {users} against `clawrl serve` (a separate process: uvicorn, the "
            f"embedded engine, model `{r.get('model', 'tiny')}`) for the window below, while the bench process runs "
            f"the judge flow (rule judge) and {train} in a loop; each train step syncs its checkpoint into the "
            "serving engine through the gateway's /engine, as `clawrl up` does."]


def format_engines_section(results: list[dict[str, Any]]) -> str:
    """The same load with 1, 2, ... `clawrl engine` processes behind the gateway, one row each."""
    r0 = results[0]
    cols = ["engines", "routing", "requests", "errors", "main_turns_logged", "p50_ms", "p99_ms", "requests_per_s",
            "completion_tokens_per_s", "requests_per_engine", "prefix_hits_per_session", "syncs_during_run", "sync_s"]
    rows = [{**{k: r.get(k) for k in cols}, "sync_s": ", ".join(f"{st['sync_s']:.2f}" for st in r["steps"]
                                                                 if st["synced"] and st["sync_s"] is not None),
             "requests_per_engine": " / ".join(map(str, r.get("requests_per_engine") or []))}
            for r in results]
    return "\n".join([
        "## Load with several engines behind the gateway",
        "",
        machine_line(r0["device"], r0["dtype"]),
        f"`clawrl bench load --engines {','.join(str(r['engines']) for r in results)}`: the load above "
        f"({r0['sessions']} users, {r0['turns_per_session']} main turns per session, {r0['max_tokens']} new tokens, "
        f"model `{r0['model']}`; each session opens with a ~200-token system prompt of its own) against `clawrl "
        "serve` in front of N `clawrl engine` processes on this machine (several behind SGLang's router, as `clawrl "
        "up --engines N` runs them: a session stays on its engine, a new one goes to the least loaded); each train "
        "step's sync reaches the engines one at a time (`sync_s`, per step). `prefix_hits_per_session`: answers "
        "whose prompt the engine found cached, per session.",
        "",
        markdown_table(rows, cols),
    ])
