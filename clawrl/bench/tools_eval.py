"""Two weight versions side by side on the tools scenario's held-out split, with many answers per task.

``clawrl demo --scenario tools`` evaluates after every step with one answer per task (a rate moves
in steps of 1/12); this compares two versions - by default the base model and a checkpoint of the
run - on the same held-out tool tasks and plain questions with ``samples`` answers each, the same
seeds for both, through the gateway with the openai SDK as the demo's users. Per task the answers'
rate is one paired observation: the comparison is a paired t statistic over the tasks, and each rate's
verdict is the promotion gate's rule (:func:`clawrl.gate.decide_promotion`): the second version is "not
worse" unless its mean over the tasks is lower by more than the tolerance or significantly lower. Plain-question
quality is also measured on ``unseen`` plain questions the scenario never asks
(:func:`clawrl.sim.tools.unseen_plain_tasks`), since a dozen held-out ones resolve little.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from clawrl.config_sections import GateSettings
from clawrl.gate import decide_promotion
from clawrl.sim.tool_users import tool_round
from clawrl.sim.tools import split_tasks, unseen_plain_tasks

# rate -> (row key, tool tasks (True) or plain questions (False), unseen plain questions)
# (false_call_rate is the one rate where lower is better)
RATES = {"tool_use": ("correct_call", True, False), "solved": ("solved", True, False),
         "plain_quality": ("solved", False, False), "plain_quality_unseen": ("solved", False, True),
         "false_call_rate": ("calls", False, False)}
_GATE = GateSettings()  # the rule's defaults: tolerance and alpha


def answer_rows(settings, model_dir: Path, *, samples: int, heldout: int, seed: int, max_tokens: int,
                unseen: int = 0) -> list[dict]:
    """Each held-out task, and the first ``unseen`` unseen plain questions, asked ``samples`` times of
    ``model_dir`` behind a gateway: one row per answer."""
    from clawrl.bench.common import gateway_on
    from clawrl.flows.loop import talk

    _, held, _, plain = split_tasks(seed, n_heldout=heldout // 2, plain_heldout=heldout // 2)
    new = unseen_plain_tasks()[:unseen]
    with gateway_on(settings, model_dir) as url:
        xs = talk(url, tool_round, (held + plain + new) * samples, round_id="compare", train=False,
                  max_tokens=max_tokens, temperature=settings.ppo.temperature, seed=seed * 7919 + 1)
    unseen_q = {t.question for t in new}
    return [{"question": x.task.question, "needs_tool": x.task.needs_tool, "unseen": x.task.question in unseen_q,
             "correct_call": bool(x.correct_call), "calls": bool(x.calls), "solved": bool(x.solved)} for x in xs]


def _of(rows: list[dict], needs_tool: bool, unseen: bool) -> list[dict]:
    return [r for r in rows if r["needs_tool"] == needs_tool and r.get("unseen", False) == unseen]


def per_task(rows: list[dict], key: str, needs_tool: bool, unseen: bool = False) -> dict[str, float]:
    """Each task's rate of ``key`` over its answers."""
    hits: dict[str, list[bool]] = {}
    for r in _of(rows, needs_tool, unseen):
        hits.setdefault(r["question"], []).append(r[key])
    return {q: sum(v) / len(v) for q, v in hits.items()}


def paired(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """b - a over the tasks both have: mean difference, paired t (None when every difference is
    equal), and how many tasks went up and down."""
    diffs = [b[q] - a[q] for q in a if q in b]
    n = len(diffs)
    mean = sum(diffs) / n if n else float("nan")
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    return {"tasks": n, "diff": mean, "t": mean / (sd / math.sqrt(n)) if sd > 0 else None,
            "up": sum(d > 0 for d in diffs), "down": sum(d < 0 for d in diffs)}


def verdict(a: dict[str, float], b: dict[str, float], *, tolerance: float, alpha: float,
            lower_is_better: bool = False) -> dict[str, Any]:
    """The gate's rule on the per-task rates: is ``b`` not worse than ``a`` (not lower by more than
    ``tolerance`` on average, and not significantly lower at ``alpha``)? ``p``: one-sided, of a drop."""
    tasks = [q for q in a if q in b]
    sign = -1.0 if lower_is_better else 1.0
    d = decide_promotion([sign * b[q] for q in tasks], [sign * a[q] for q in tasks], tolerance=tolerance, alpha=alpha)
    return {"p": d.p_value, "not_worse": d.promoted}


def compare(first: list[dict], second: list[dict], *, tolerance: float = _GATE.tolerance,
            alpha: float = _GATE.alpha) -> list[dict[str, Any]]:
    """One row per rate both versions were asked: their rate over all answers, the paired
    statistics per task, and whether the second is not worse by the gate's rule (``verdict``)."""
    out = []
    for name, (key, tool, unseen) in RATES.items():
        answers = [[r[key] for r in _of(rows, tool, unseen)] for rows in (first, second)]
        if not all(answers):
            continue
        a, b = per_task(first, key, tool, unseen), per_task(second, key, tool, unseen)
        first_rate, second_rate = (sum(x) / len(x) for x in answers)
        out.append({"rate": name, "first": first_rate, "second": second_rate, **paired(a, b),
                    **verdict(a, b, tolerance=tolerance, alpha=alpha, lower_is_better=name == "false_call_rate"),
                    "tolerance": tolerance, "alpha": alpha})
    return out


def format_section(rows: list[dict[str, Any]], labels: tuple[str, str], *, samples: int, machine: str) -> str:
    """``rows``: ``compare``'s (they carry the rule's tolerance and alpha)."""
    tolerance, alpha = rows[0]["tolerance"], rows[0]["alpha"]
    head = ["## Tools scenario: two versions on the held-out split", "", machine,
            f"`{labels[0]}` vs `{labels[1]}`: the held-out tool tasks and plain questions, {samples} answers to each "
            "with the same seeds for both; paired over the tasks. `plain_quality_unseen`: the same on plain "
            "questions the scenario never asks (`clawrl.sim.tools.unseen_plain_tasks`). `p`: one-sided, of a drop "
            f"(for false calls, of a rise); `not worse`: the promotion gate's rule, tolerance {tolerance:g}, "
            f"alpha {alpha:g}.", "",
            "| rate | " + f"{labels[0]} | {labels[1]} | tasks | diff | paired t | p | up | down | not worse |",
            "|---" * 10 + "|"]
    for r in rows:
        t = "n/a" if r["t"] is None else f"{r['t']:+.2f}"
        head.append(f"| {r['rate']} | {r['first']:.3f} | {r['second']:.3f} | {r['tasks']} | {r['diff']:+.3f} | {t} "
                    f"| {r['p']:.3g} | {r['up']} | {r['down']} | {'yes' if r['not_worse'] else '**no**'} |")
    return "\n".join(head)
