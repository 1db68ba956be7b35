"""The demos' ``[gate] evaluator``s.

``clawrl.sim.validation:<persona>`` (any of :data:`clawrl.sim.personas.PERSONAS`) returns the
questions of :func:`clawrl.sim.prompts.validation_questions` as chat prompts and a scorer that gives
an answer 1 when it satisfies the persona AND is on topic (the held-out score's rule), else 0.

``clawrl.sim.validation:users_<persona>_...`` scores a user's adapter by that user's persona, the shared
policy by each user of the panel in turn (:func:`panel_evaluator`).

``clawrl.sim.validation:tools`` is the tools scenario's: tool tasks and plain questions of
:func:`clawrl.sim.tools.gate_tasks`, asked as its users ask them (system prompt, the tools offered),
in two groups for ``[gate] guard``: ``tools`` (1 when the reply calls a tool whose result is the
task's answer and no call fails: the held-out ``tool_use`` rule) and ``plain`` (1 when the reply is
on topic and calls no tool: ``plain_quality``).

``clawrl.sim.validation:tools_bfcl`` is that set and, beside it, ``size // 2`` prompts of BFCL (the
Berkeley Function Calling Leaderboard, ``clawrl.sim.bfcl``), tools the scenario never offers: half of
them irrelevance prompts (group ``bfcl_irrelevance``: 1 when the reply calls none of the offered tools),
half simple_python and multiple (group ``bfcl_ast``: 1 when BFCL's checker takes the call), drawn with
the seed and scored by BFCL's own checker in its own environment (`make bfcl`). ``[gate] guard =
["plain", "bfcl_irrelevance"]`` keeps general tool calling from getting worse than the initial model's.
"""

from __future__ import annotations

from collections.abc import Callable

from clawrl.chat import TOOL_CALL_OPEN, tool_calls_in
from clawrl.sim import bfcl
from clawrl.sim.personas import PERSONAS, get_persona, on_topic
from clawrl.sim.prompts import validation_questions
from clawrl.sim.tools import SYSTEM_PROMPT, TOOLS, ToolTask, gate_tasks, run_tool

Evaluator = Callable[..., tuple[list[list[dict[str, str]]], Callable[[int, str], float]]]


def question_set(persona_name: str, questions: list[tuple[str, tuple[str, ...]]]):
    """(prompts, score) of ``questions`` as the persona's user asks and scores them."""
    persona = get_persona(persona_name)

    def score(i: int, answer: str) -> float:
        question, keywords = questions[i]
        return float(persona.satisfied(answer) and on_topic(answer, keywords, question))

    return [[{"role": "user", "content": q}] for q, _ in questions], score


def persona_evaluator(name: str) -> Evaluator:
    get_persona(name)  # an unknown name fails here, at import

    def evaluator(*, size: int, seed: int):
        return question_set(name, validation_questions(size, seed))

    return evaluator


def panel_evaluator(panel: list[str]) -> Evaluator:
    """The gate's evaluator of `clawrl demo --scenario users`: a user's adapter (``namespace``) answers the
    validation questions scored by that user's persona; the shared policy (no namespace) answers them scored
    by each user of the panel in turn (question i by user i mod n), as it serves them all."""
    from clawrl.sim.panel import persona_of_namespace

    def evaluator(*, size: int, seed: int, namespace: str | None = None):
        questions = validation_questions(size, seed)
        if namespace is not None:
            return question_set(persona_of_namespace(namespace, panel), questions)
        sets = [question_set(name, questions)[1] for name in panel]
        return question_set(panel[0], questions)[0], lambda i, answer: sets[i % len(panel)](i, answer)

    return evaluator


def __getattr__(name: str) -> Evaluator:
    """``<persona>``: :func:`persona_evaluator` of it; ``users_<persona>_<persona>...``: :func:`panel_evaluator` of
    those personas, so a config names the panel in its ``[gate] evaluator`` path
    (``clawrl.sim.validation:users_concise_french``)."""
    if name.startswith("users_"):
        from clawrl.sim.panel import parse_panel

        return panel_evaluator(parse_panel(name.removeprefix("users_").replace("_", ",")))
    if name in PERSONAS:
        return persona_evaluator(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def panel_evaluator_path(panel: list[str]) -> str:
    return f"{__name__}:users_{'_'.join(panel)}"


_TOOL_NAMES = {t["function"]["name"] for t in TOOLS}


def tool_task_score(task: ToolTask, answer: str) -> float:
    """1 when the raw reply does what the tools scenario's held-out rates count right (module docstring)."""
    if not task.needs_tool:  # a call of any shape is not a plain answer
        return float(TOOL_CALL_OPEN not in answer and on_topic(answer, task.keywords, task.question))
    calls = tool_calls_in(answer, _TOOL_NAMES)
    results = [run_tool(name, args) for name, args in calls]
    return float(task.answer in results and not any(r.startswith("error:") for r in results))


def tools(*, size: int, seed: int):
    """The tools scenario's gate set: ``size`` prompts, the tool tasks first, then as many plain questions
    (``size // 2``), tagged ``tools`` and ``plain``."""
    tasks, plain = gate_tasks(size - size // 2, size // 2, seed)
    every = tasks + plain
    prompts = [{"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t.question}],
                "tools": TOOLS, "group": "tools" if t.needs_tool else "plain"} for t in every]
    return prompts, lambda i, answer: tool_task_score(every[i], answer)


# BFCL categories of the gate's sample, by group: none is ever asked of the demos' users
BFCL_GROUPS = {"bfcl_irrelevance": ("irrelevance",), "bfcl_ast": ("simple_python", "multiple")}


def bfcl_counts(n: int) -> dict[str, int]:
    """How many of ``n`` BFCL prompts each category gives: half irrelevance, the rest split over the others."""
    irrelevant = n // 2
    ast = BFCL_GROUPS["bfcl_ast"]
    return {"irrelevance": irrelevant, **{c: (n - irrelevant) // len(ast) + (i < (n - irrelevant) % len(ast))
                                           for i, c in enumerate(ast)}}


def tools_bfcl(*, size: int, seed: int):
    """The tools scenario's gate set (:func:`tools`) and ``size // 2`` BFCL prompts after it (module
    docstring); BfclMissing when BFCL's environment is not there."""
    prompts, score_tools = tools(size=size, seed=seed)
    group_of = {c: g for g, cats in BFCL_GROUPS.items() for c in cats}
    drawn = bfcl.worker().sample(bfcl_counts(size // 2), seed)
    offset = len(prompts)

    def score(i: int, answer: str) -> float:
        if i < offset:
            return score_tools(i, answer)
        entry = drawn[i - offset]
        return float(bfcl.worker().check(entry["id"], bfcl.as_result(answer, entry["tools"])))

    return prompts + [{"messages": e["messages"], "tools": e["tools"], "group": group_of[e["category"]]}
                      for e in drawn], score
