"""Prefect flow `learning-loop`: simulated users -> gateway -> judge -> train -> sync, measured.

The closed loop of `clawrl demo`, in one process: the gateway (real HTTP, in-process embedded
engine) serves simulated users who talk through the openai SDK; after each round the `judge` and
`train` flows run as subflows and the new weights are synced into the serving engine; then the
held-out questions measure the served weights (``served_score`` = persona satisfied AND on topic, the
on-topic rate, and the KL to the initial model). The curve is plotted and logged to MLflow.

Each new checkpoint is a candidate that the promotion gate of the train flow scores on the
validation questions (``[gate]``, disjoint from the held-out ones) before it may serve. A row shows
the gate's decision, both validation means, the version served, and ``candidate_score``, the candidate's
held-out score: the served score when it was promoted, else measured in the gate's evaluation engine
with the same questions and seeds (``evaluate_candidate``), so the curve shows what serving every
checkpoint would have given. Every other held-out number of a row is the served version's.

``scenario = "tools"`` runs the same loop on tool use: the users of ``clawrl.sim.tool_users`` ask
tool tasks and plain questions with the tools offered, run the calls, and react to the final answer;
the held-out rates are those of ``tool_scores`` (correct tool use first).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawrl import interrupts, runtime
from clawrl.flows.common import (base_model_dir, data_store, eval_adapter, eval_engine, frozen_engine,
                                 load_flow_settings, policy_engine, prefect_tags)
from clawrl.flows.judge import judge_flow
from clawrl.flows.train import train_flow
from clawrl.judge.teacher import compute_teacher_logprobs
from clawrl.sim.personas import get_persona
from clawrl.sim.prompts import split_questions
from clawrl.sim.tool_users import tool_round, tool_scores
from clawrl.sim.tools import PLAIN_SHARE, ToolTask, split_tasks
from clawrl.sim.users import kl_to_reference, score, summarize_round, user_round
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import session_turns


SCENARIOS = ("persona", "tools")


def talk(gateway_url: str, round_fn, *args, **kwargs):
    """One round of simulated users (``round_fn``: ``user_round`` or ``tool_round``) against the gateway."""

    async def go():
        async with AsyncOpenAI(base_url=gateway_url + "/v1", api_key="demo", max_retries=2, timeout=600) as client:
            return await round_fn(client, *args, **kwargs)

    return runtime.run(go())


def tool_round_tasks(step: int, n_users: int, seed: int, plain_share: float = PLAIN_SHARE) -> list[ToolTask]:
    """Round ``step``'s tasks: ``plain_share`` of the users (rounded down; by default two tool tasks
    for every plain question) ask a plain question, the others a tool task, each pool continuing
    where the last round ended."""
    if not 0.0 <= plain_share <= 1.0:
        raise ValueError(f"plain_share must be in [0, 1], got {plain_share}")
    tools, _, plain, _ = split_tasks(seed)
    n_plain = int(n_users * plain_share + 1e-9)  # 1e-9: 0.29 * 100 is 28.999...
    n_tools = n_users - n_plain
    return ([tools[((step - 1) * n_tools + i) % len(tools)] for i in range(n_tools)]
            + [plain[((step - 1) * n_plain + i) % len(plain)] for i in range(n_plain)])


def _round(scenario: str, gateway_url: str, step: int, persona_name: str, n_users: int, task_seed: int,
           heldout: int, group_size: int, plain_share: float, **kw) -> dict[str, Any]:
    if scenario == "tools":
        xs = talk(gateway_url, tool_round, tool_round_tasks(step, n_users, task_seed, plain_share), **kw)
        return {**tool_scores(xs), "reactions": dict(Counter(x.reaction for x in xs))}
    pool, _ = split_questions(n_heldout=heldout, seed=task_seed)
    questions = round_questions(pool, step, n_users, group_size)
    return summarize_round(talk(gateway_url, user_round, get_persona(persona_name), questions, **kw))


def _evaluation(scenario: str, gateway_url: str, persona_name: str, task_seed: int, heldout: int, samples: int,
                **kw) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics, examples) of one held-out evaluation; the tools scenario asks ``heldout // 2`` tool
    tasks and as many plain questions."""
    if scenario == "tools":
        _, held, _, plain = split_tasks(task_seed, n_heldout=heldout // 2, plain_heldout=heldout // 2)
        xs = talk(gateway_url, tool_round, (held + plain) * samples, **kw)
        return tool_scores(xs), [{"q": x.task.question, "a": x.first_reply[:300], "final": x.final_answer[:200],
                                  "ok": x.solved} for x in xs[:4] + xs[len(held):len(held) + 2]]
    _, held_q = split_questions(n_heldout=heldout, seed=task_seed)
    xs = talk(gateway_url, user_round, get_persona(persona_name), held_q * samples, **kw)
    return score(xs), [{"q": x.question, "a": x.answer[:300], "ok": x.satisfied and x.on_topic} for x in xs[:4]]


def round_questions(pool: list, step: int, n_users: int, group_size: int = 1) -> list:
    """The questions of round ``step`` (1-based): consecutive questions of the training pool (wrapping
    around), each repeated for ``group_size`` consecutive users; rounds continue where the last ended."""
    if group_size < 1 or n_users < 1:
        raise ValueError(f"n_users and group_size must be >= 1, got {n_users} and {group_size}")
    distinct = -(-n_users // group_size)
    start = ((step - 1) * distinct) % len(pool)
    return [pool[(start + i // group_size) % len(pool)] for i in range(n_users)]


@task(cache_policy=NO_CACHE, task_run_name="users-round-{step}")
def simulate_users(config_path: str | None, gateway_url: str, step: int, persona_name: str, n_users: int,
                   max_tokens: int, seed: int, heldout: int, group_size: int = 1,
                   scenario: str = "persona", plain_share: float = PLAIN_SHARE) -> dict[str, Any]:
    """One round: ``n_users`` users; in the persona scenario each ``group_size`` of them ask the same
    question (their answers differ by seed, so ``ppo.group_by = "prompt"`` compares answers to one
    question); in the tools scenario each asks a task of its own (``tool_round_tasks``)."""
    s = load_flow_settings(config_path)
    out = _round(scenario, gateway_url, step, persona_name, n_users, seed, heldout, group_size, plain_share,
                 round_id=f"train{step:03d}", train=True, max_tokens=max_tokens, temperature=s.ppo.temperature,
                 seed=seed * 1000 + step * 97)
    data_store(s).flush()
    return out


@task(cache_policy=NO_CACHE, task_run_name="evaluate-v{step}")
def evaluate_policy(config_path: str | None, gateway_url: str, step: int, persona_name: str, max_tokens: int,
                    seed: int, heldout: int, samples: int = 1, scenario: str = "persona") -> dict[str, Any]:
    """Held-out questions as side turns (never trained on), ``samples`` answers to each with fixed
    distinct seeds, at the serving temperature - the answers users get. The KL to the initial model
    is measured on those answers: both the served and the initial weights score the sampled tokens
    (prompt scoring, temperature 1; all turns in flight together, so the engines batch them)."""
    s = load_flow_settings(config_path)
    round_id = f"eval{step:03d}"
    metrics, examples = _evaluation(scenario, gateway_url, persona_name, seed, heldout, samples, round_id=round_id,
                                    train=False, max_tokens=max_tokens, temperature=s.ppo.temperature,
                                    seed=seed * 7919)
    data_store(s).flush()
    with open_catalog(s.storage.data_root) as con:
        turns = session_turns(con, f"{round_id}-e%")
    policy = policy_engine()

    async def score_with(engine):
        return list(await asyncio.gather(*(compute_teacher_logprobs(engine, t["prompt_ids"], t["output_ids"])
                                           for t in turns)))

    ref_lps = runtime.run(score_with(frozen_engine(s)))
    pol_lps = runtime.run(score_with(policy)) if policy is not None else [t["rollout_logprobs"] for t in turns]
    metrics.update(step=step, kl=kl_to_reference(pol_lps, ref_lps),
                   weight_version=turns[0]["weight_version"] if turns else None, examples=examples)
    metrics["served_score"] = metrics.pop("score")  # the served version's: a row's candidate_score is the candidate's
    return metrics


@task(cache_policy=NO_CACHE, task_run_name="evaluate-candidate-v{version}")
def evaluate_candidate(config_path: str | None, version: str, persona_name: str, max_tokens: int, seed: int,
                       heldout: int, samples: int) -> float:
    """The held-out score of a candidate that does not serve: the questions, seeds, temperature and
    budget of ``evaluate_policy``, answered by the gate's evaluation engine."""
    from clawrl.evaluation import EvalSet
    from clawrl.promotion import score_version
    from clawrl.sim.validation import question_set

    s = load_flow_settings(config_path)
    _, held_q = split_questions(n_heldout=heldout, seed=seed)
    prompts, score_fn = question_set(persona_name, held_q * samples)
    # user i of the evaluation asks with seed seed * 7919 + i (user_round); here prompt i, sample 0
    eval_set = EvalSet(prompts, score_fn, 1, seed * 7919, max_tokens, s.ppo.temperature, key="heldout")
    engine = eval_engine(s)
    scores = score_version(s.storage.data_root, engine, eval_adapter(s, engine), eval_set, version,
                           base_model_dir(s))
    return sum(scores) / len(scores)


def _gate_row(gate: dict[str, Any] | None, served: dict[str, Any], candidate_score: float | None) -> dict[str, Any]:
    """The gate's part of a curve row. ``candidate_score``: the served score when the candidate serves (or
    no step made one); a refused candidate's as measured (None: not measured)."""
    if gate is None:  # no step this round: nothing new to decide
        return {"candidate_score": served["served_score"]}
    return {"gate": gate["decision"], "candidate_version": gate.get("candidate_version"),
            "val_candidate": gate.get("candidate_mean"), "val_champion": gate.get("champion_mean"),
            "gate_p": gate.get("p_value"), "gate_reason": gate["reason"],
            "candidate_score": served["served_score"] if gate["decision"] == "promote" else candidate_score}


# per scenario: the held-out rates on the curve and in MLflow, (key, label), the first one the score
CURVES = {
    "persona": [("served_score", "served score (persona AND on topic)"), ("on_topic_rate", "on-topic rate (served)"),
                ("persona_rate", "persona rate (served)"),
                ("candidate_score", "candidate score (served only if promoted)")],
    "tools": [("tool_use", "correct tool use (tool tasks)"), ("solved", "final answer right (tool tasks)"),
              ("plain_quality", "plain questions: on topic, no call"), ("false_call_rate", "plain questions: tool called")],
}


@task(cache_policy=NO_CACHE)
def report_curve(config_path: str | None, rows: list[dict[str, Any]], title: str, params: dict[str, Any],
                 scenario: str = "persona") -> dict[str, str]:
    from clawrl.lineage import log_learning_curve, log_policy_point
    from clawrl.sim.plot import plot_learning_curve

    s = load_flow_settings(config_path)
    out_dir = Path(s.storage.data_root) / "reports"
    png = plot_learning_curve(rows, out_dir / "learning_curve.png", CURVES[scenario],
                              f"{s.model.name}, {title}, {s.ppo.advantage_estimator.value}",
                              goal=0.5 if scenario == "tools" else 0.8)
    (out_dir / "learning_curve.json").write_text(json.dumps(rows, indent=1))
    keys = [k for k, _ in CURVES[scenario]] + ["served_score", "kl", "mean_words"]
    run_id = log_learning_curve(s.storage.data_root, rows=rows, png=png, params=params, keys=keys, tags=prefect_tags())
    for row in rows:  # the held-out scores beside the training metrics, over the versions
        for version, metrics in policy_points(row, keys):
            log_policy_point(s.storage.data_root, version, metrics)
    return {"png": str(png), "mlflow_run_id": run_id}


def policy_points(row: dict[str, Any], keys: list[str]) -> list[tuple[int, dict]]:
    """A curve row as points of the policy run, whose step is the weight version this row decided on (the
    candidate; the version served in a row with no step): ``served_<key>`` for every held-out key, what users
    got after the decision (the candidate when promoted, else the champion), and ``candidate_score``, the
    candidate's own score (where measured). Every row reaches the policy run, refused candidate or not, so
    each curve ends where the demo's table does."""
    version = str(row.get("candidate_version") or row.get("weight_version"))
    if not version.isdigit():
        return []
    served = {f"served_{k.removeprefix('served_')}": row.get(k)
              for k in dict.fromkeys(keys) if k != "candidate_score"}
    return [(int(version), {**served, "candidate_score": row.get("candidate_score")})]


def _row_line(row: dict[str, Any], scenario: str) -> str:
    rates = "  ".join(f"{k} {row[k]:.3f}" for k, _ in CURVES[scenario] if row.get(k) is not None)
    return f"{rates}  KL {row['kl']:.4f}" + (f"  words {row['mean_words']:.1f}" if "mean_words" in row else "")


@flow(name="learning-loop", flow_run_name="learning-loop-{scenario}-{steps}-steps", log_prints=True)
def learning_loop(config_path: str | None, gateway_url: str, steps: int = 16, users: int = 16,
                  persona: str = "concise", max_tokens: int = 48, seed: int = 0, heldout: int = 24,
                  eval_samples: int = 1, group_size: int = 1, scenario: str = "persona",
                  plain_share: float = PLAIN_SHARE) -> dict[str, Any]:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    log = get_run_logger()
    s = load_flow_settings(config_path)
    rows = [evaluate_policy(config_path, gateway_url, 0, persona, max_tokens, seed, heldout, eval_samples, scenario)]
    rows[0]["candidate_score"] = rows[0]["served_score"]
    log.info("base model: %s", _row_line(rows[0], scenario))
    for step in range(1, steps + 1):
        interrupts.stop_if_ctrl_c()  # before each piece of work: a Ctrl-C swallowed where it landed stops here
        rounds = simulate_users(config_path, gateway_url, step, persona, users, max_tokens, seed, heldout, group_size,
                                scenario, plain_share)
        judged = judge_flow(config_path=config_path)
        interrupts.stop_if_ctrl_c()
        trained = train_flow(config_path=config_path, max_steps=1)
        interrupts.stop_if_ctrl_c()
        row = evaluate_policy(config_path, gateway_url, step, persona, max_tokens, seed, heldout, eval_samples,
                              scenario)
        gate = {**trained["steps"][0]["gate"], "candidate_version": trained["steps"][0]["weight_version"]} \
            if trained["steps"] else None
        refused = gate is not None and gate["decision"] != "promote"
        cand = evaluate_candidate(config_path, gate["candidate_version"], persona, max_tokens, seed, heldout,
                                  eval_samples) if refused and scenario == "persona" else None
        row.update(_gate_row(gate, row, cand))  # tools: a refused candidate's held-out rates are not measured
        row["train_reactions"] = rounds["reactions"]
        row["samples"] = judged["fates"].get("sample", 0)
        if trained["steps"]:
            m = trained["steps"][0]["metrics"]
            row.update(loss=m.get("loss"), reward_mean=m.get("reward_mean"), train_kl=m.get("kl"))
        rows.append(row)
        verdict = "" if gate is None else (f", candidate v{gate['candidate_version']} {gate['decision']}d: "
                                           f"{gate['reason']}")
        print(f"step {step:2d}: {_row_line(row, scenario)}  (served v{row['weight_version']}{verdict})")
    params = {"scenario": scenario, "persona": persona, "steps": steps, "users": users, "max_tokens": max_tokens,
              "seed": seed, "heldout": heldout, "eval_samples": eval_samples, "group_size": group_size,
              **({"plain_share": plain_share} if scenario == "tools" else {}),
              "model": s.model.name, "method": s.ppo.advantage_estimator.value, "lr": s.ppo.lr,
              "kl_coef": s.ppo.kl_coef, "rollout_batch_size": s.ppo.rollout_batch_size,
              "temperature": s.ppo.temperature}
    title = "tool use" if scenario == "tools" else f"persona '{persona}'"
    out = report_curve(config_path, rows, title, params, scenario)
    return {"rows": rows, **out}
