"""Prefect flow `users-loop`: a panel of simulated users, each behind its own API key, -> gateway -> judge ->
train -> gate -> sync, and each user's held-out score after every round (`clawrl demo --scenario users`).

One run of the flow is one arm of the comparison, on a data root of its own: ``[ppo] adapters = "shared"``
trains one policy on every user's turns, ``"namespace"`` one LoRA adapter per user on that user's turns
only. In round r every user asks ``turns`` questions of the shared training pool (the next ones of its
own seeded order, :func:`clawrl.sim.panel.user_questions`: the same in both arms) and reacts as its persona
would; the `judge` and `train` flows run (per user with adapters: each user's batch is its round's turns);
the gate scores each candidate on validation questions by the wishes of whoever it would serve
(``clawrl.sim.validation:users_...``); then every user asks the held-out questions through its own key,
so it is answered by what serves it (its adapter, or the shared policy), and they are scored as the
persona demo scores them: the persona satisfied AND on topic. :func:`report_panel` then reports the arms side
by side: a PNG, a JSON and an MLflow run per arm.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawrl import interrupts, runtime
from clawrl.flows.common import data_store, load_flow_settings
from clawrl.flows.judge import judge_flow
from clawrl.flows.train import train_flow
from clawrl.sim.panel import metrics_of, persona_of_namespace, summarize, user_key, user_questions
from clawrl.sim.personas import get_persona
from clawrl.sim.prompts import split_questions
from clawrl.sim.users import score, user_round
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import session_turns

ARMS = {"shared": "shared", "per-user": "namespace"}  # arm -> [ppo] adapters


def talk_as_panel(gateway_url: str, questions: dict[str, list], **kw) -> dict[str, list]:
    """Every user of the panel (persona -> its questions) at once, each through a client with its own key,
    so the engine batches all their requests (their adapters side by side)."""

    async def one(i: int, persona: str, qs: list) -> list:
        async with AsyncOpenAI(base_url=gateway_url + "/v1", api_key=user_key(persona), max_retries=2,
                               timeout=600) as client:
            return await user_round(client, get_persona(persona), qs, **{**kw, "round_id": f"{kw['round_id']}-{persona}",
                                                                         "seed": kw["seed"] + 1000 * i})

    async def go() -> dict[str, list]:
        out = await asyncio.gather(*(one(i, p, qs) for i, (p, qs) in enumerate(questions.items())))
        return dict(zip(questions, out))

    return runtime.run(go())


@task(cache_policy=NO_CACHE, task_run_name="panel-round-{round_no}")
def simulate_panel(config_path: str | None, gateway_url: str, round_no: int, panel: list[str], turns: int,
                   max_tokens: int, seed: int, heldout: int) -> dict[str, dict[str, Any]]:
    """One round: each user asks its next ``turns`` questions and reacts; per persona its round's rates."""
    s = load_flow_settings(config_path)
    pool, _ = split_questions(n_heldout=heldout, seed=seed)
    asked = {p: user_questions(pool, p, round_no, turns, seed) for p in panel}
    # user i of the panel asks its question j with seed seed*1000 + round*97 + 1000*i + j
    out = talk_as_panel(gateway_url, asked, round_id=f"train{round_no:03d}", train=True, max_tokens=max_tokens,
                        temperature=s.ppo.temperature, seed=seed * 1000 + round_no * 97)
    data_store(s).flush()
    return {p: score(xs) for p, xs in out.items()}


@task(cache_policy=NO_CACHE, task_run_name="evaluate-panel-{round_no}")
def evaluate_panel(config_path: str | None, gateway_url: str, round_no: int, panel: list[str], max_tokens: int,
                   seed: int, heldout: int, samples: int) -> dict[str, dict[str, Any]]:
    """Every user asks the held-out questions ``samples`` times through its own key as side turns (never
    trained on), every user with the same seeds: per persona its score, rates and what served it (the
    adapter, or the shared policy's weight version)."""
    s = load_flow_settings(config_path)
    _, held_q = split_questions(n_heldout=heldout, seed=seed)
    round_id = f"eval{round_no:03d}"
    out = talk_as_panel(gateway_url, {p: held_q * samples for p in panel}, round_id=round_id, train=False,
                        max_tokens=max_tokens, temperature=s.ppo.temperature, seed=seed * 7919)
    data_store(s).flush()
    result = {}
    with open_catalog(s.storage.data_root) as con:
        for p, xs in out.items():
            turns = session_turns(con, f"{round_id}-{p}-e%")
            served = turns[0].get("adapter") or f"v{turns[0]['weight_version']}" if turns else None
            result[p] = {**score(xs), "served": served,
                         "example": {"q": xs[0].question, "a": xs[0].answer[:200]} if xs else None}
    return result


def _gates(trained: dict[str, Any], panel: list[str]) -> dict[str, str]:
    """persona -> the gate's decision on the candidate it would have been served ('-': no step)."""
    out = dict.fromkeys(panel, "-")
    for step in trained["steps"]:
        decision = step["gate"]["decision"]
        if step.get("namespace"):
            out[persona_of_namespace(step["namespace"], panel)] = decision
        else:  # the shared policy's candidate serves everyone
            out = dict.fromkeys(panel, decision)
    return out


def panel_row(round_no: int, turns: int, evaluated: dict[str, dict[str, Any]], gates: dict[str, str] | None = None,
              trained: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A row of the arm's curve: each user's held-out score and rates, what served it, the gate's decisions
    and the user's own turns trained on so far."""
    row = {"round": round_no, "turns": turns,
           "scores": {p: e["score"] for p, e in evaluated.items()},
           "persona_rates": {p: e["persona_rate"] for p, e in evaluated.items()},
           "on_topic_rates": {p: e["on_topic_rate"] for p, e in evaluated.items()},
           "mean_words": {p: e["mean_words"] for p, e in evaluated.items()},
           "served": {p: e["served"] for p, e in evaluated.items()},
           "examples": {p: e["example"] for p, e in evaluated.items()}}
    if gates is not None:
        row["gate"] = gates
    if trained is not None:
        row["train_scores"] = {p: t["score"] for p, t in trained.items()}
    return row


@flow(name="users-loop", flow_run_name="users-loop-{arm}-{rounds}-rounds", log_prints=True)
def users_loop(config_path: str | None, gateway_url: str, arm: str, panel: list[str], rounds: int = 6,
               turns: int = 8, max_tokens: int = 48, seed: int = 0, heldout: int = 12,
               eval_samples: int = 1) -> list[dict[str, Any]]:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
    s = load_flow_settings(config_path)
    if s.ppo.adapters != ARMS[arm]:
        raise ValueError(f"arm {arm!r} trains with [ppo] adapters = {ARMS[arm]!r}, the config has {s.ppo.adapters!r}")
    log = get_run_logger()
    rows = [panel_row(0, 0, evaluate_panel(config_path, gateway_url, 0, panel, max_tokens, seed, heldout,
                                           eval_samples))]
    log.info("%s, base model: %s", arm, _line(rows[0]))
    for round_no in range(1, rounds + 1):
        interrupts.stop_if_ctrl_c()  # before each piece of work: a Ctrl-C swallowed where it landed stops here
        asked = simulate_panel(config_path, gateway_url, round_no, panel, turns, max_tokens, seed, heldout)
        judge_flow(config_path=config_path)
        interrupts.stop_if_ctrl_c()
        trained = train_flow(config_path=config_path, max_steps=1)
        interrupts.stop_if_ctrl_c()
        evaluated = evaluate_panel(config_path, gateway_url, round_no, panel, max_tokens, seed, heldout, eval_samples)
        rows.append(panel_row(round_no, round_no * turns, evaluated, _gates(trained, panel), asked))
        print(f"{arm} round {round_no:2d} ({round_no * turns} turns each): {_line(rows[-1])}")
    return rows


def _line(row: dict[str, Any]) -> str:
    gate = row.get("gate", {})
    return "  ".join(f"{p} {v:.3f}" + (f" ({gate[p]})" if gate.get(p, "-") != "-" else "")
                     for p, v in row["scores"].items())


def report_panel(root: Path, rows: dict[str, list[dict[str, Any]]], confs: dict[str, Path], panel: list[str],
                 params: dict[str, Any]) -> dict[str, Any]:
    """The curves PNG and rows JSON under ``<root>/reports``, and one MLflow run in the data root of each arm of
    ``confs`` (its per-user metrics, the PNG of both arms)."""
    from clawrl.lineage import log_learning_curve
    from clawrl.sim.plot import plot_panel_curves

    model = params["model"]
    png = plot_panel_curves(rows, panel, root / "reports" / "users_learning_curve.png",
                            f"{model}: held-out score per user, shared policy vs one LoRA adapter each")
    summary = summarize(rows, panel)
    write_json(root / "reports" / "users.json", {"rows": rows, "summary": summary, "params": params})
    runs = {}
    for arm, conf in confs.items():  # the arms run now: an earlier `--arm` run logged its own
        flat = metrics_of(rows[arm], panel)
        keys = [k for k in flat[0] if k != "step"]
        runs[arm] = log_learning_curve(conf.parent, rows=flat, png=png, params={**params, "arm": arm},
                                       keys=keys, tags={"scenario": "users", "arm": arm})
    return {"png": png, "summary": summary, "runs": runs}


def write_json(path: Path, value: Any) -> None:
    """``value`` as the JSON file ``path``, replaced whole: written beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)
