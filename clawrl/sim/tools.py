"""The tool-use scenario (``clawrl demo --scenario tools``): three real tools and the tasks that need them.

Tools, in OpenAI tool format (:data:`TOOLS`): ``calculator`` (arithmetic on numbers, evaluated on the
Python AST, nothing else), ``convert_units`` (length, mass, volume, temperature) and
``lookup_country`` (capital, currency, population or language from a small table). The user's
client (``clawrl.sim.tool_users``) executes the calls the model makes (:func:`run_tool`); a malformed
call, an unknown tool or bad arguments get an ``error: ...`` result, as a real tool runtime would answer.

Tasks (:func:`tool_tasks`): arithmetic, conversion and lookup questions generated from a seed, each
with the call that answers it and the expected result; plain questions (``clawrl.sim.prompts``) are
mixed in, asked with the same tools offered, so the policy also learns when not to call a tool. The
reward hook that scores every turn is ``clawrl.sim.tool_reward``.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from dataclasses import dataclass
from typing import Any

from clawrl.sim.prompts import GATE_PLAIN_QUESTIONS, QUESTIONS, VALIDATION_QUESTIONS

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value from one unit to another.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}}},
    {"type": "function", "function": {
        "name": "lookup_country", "description": "Look up a fact about a country.",
        "parameters": {"type": "object", "properties": {
            "country": {"type": "string"},
            "field": {"type": "string", "enum": ["capital", "currency", "population", "language"]}},
            "required": ["country", "field"]}}},
]

SYSTEM_PROMPT = ("You are a helpful assistant with tools. Use a tool for arithmetic, unit conversions and facts "
                 "about countries; answer other questions directly.")

# unit -> (dimension, factor to the dimension's base unit); temperatures are handled apart
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mile": ("length", 1609.344),
    "ft": ("length", 0.3048), "inch": ("length", 0.0254),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "l": ("volume", 1.0), "ml": ("volume", 0.001), "gallon": ("volume", 3.785411784),
}
TEMPERATURES = ("c", "f")
UNIT_ALIASES = {"meter": "m", "meters": "m", "kilometer": "km", "kilometers": "km", "miles": "mile",
                "feet": "ft", "foot": "ft", "inches": "inch", "kilogram": "kg", "kilograms": "kg", "gram": "g",
                "grams": "g", "pound": "lb", "pounds": "lb", "lbs": "lb", "ounce": "oz", "ounces": "oz",
                "liter": "l", "liters": "l", "litre": "l", "litres": "l", "milliliter": "ml", "gallons": "gallon",
                "celsius": "c", "fahrenheit": "f", "centimeter": "cm", "centimeters": "cm"}
UNIT_WORDS = {"km": "kilometers", "mile": "miles", "m": "meters", "ft": "feet", "kg": "kilograms", "lb": "pounds",
              "g": "grams", "oz": "ounces", "l": "liters", "gallon": "gallons", "c": "degrees Celsius",
              "f": "degrees Fahrenheit", "cm": "centimeters", "inch": "inches", "ml": "milliliters"}

COUNTRIES: dict[str, dict[str, str]] = {
    "japan": {"capital": "Tokyo", "currency": "yen", "population": "124 million", "language": "Japanese"},
    "brazil": {"capital": "Brasilia", "currency": "real", "population": "212 million", "language": "Portuguese"},
    "australia": {"capital": "Canberra", "currency": "Australian dollar", "population": "27 million",
                  "language": "English"},
    "canada": {"capital": "Ottawa", "currency": "Canadian dollar", "population": "41 million",
               "language": "English and French"},
    "kenya": {"capital": "Nairobi", "currency": "Kenyan shilling", "population": "56 million", "language": "Swahili"},
    "norway": {"capital": "Oslo", "currency": "Norwegian krone", "population": "5.6 million",
               "language": "Norwegian"},
    "peru": {"capital": "Lima", "currency": "sol", "population": "34 million", "language": "Spanish"},
    "vietnam": {"capital": "Hanoi", "currency": "dong", "population": "101 million", "language": "Vietnamese"},
    "egypt": {"capital": "Cairo", "currency": "Egyptian pound", "population": "114 million", "language": "Arabic"},
    "poland": {"capital": "Warsaw", "currency": "zloty", "population": "37 million", "language": "Polish"},
    "thailand": {"capital": "Bangkok", "currency": "baht", "population": "72 million", "language": "Thai"},
    "chile": {"capital": "Santiago", "currency": "Chilean peso", "population": "20 million", "language": "Spanish"},
    "turkey": {"capital": "Ankara", "currency": "Turkish lira", "population": "86 million", "language": "Turkish"},
    "sweden": {"capital": "Stockholm", "currency": "Swedish krona", "population": "10.6 million",
               "language": "Swedish"},
    "nigeria": {"capital": "Abuja", "currency": "naira", "population": "230 million", "language": "English"},
    "india": {"capital": "New Delhi", "currency": "Indian rupee", "population": "1.45 billion",
              "language": "Hindi and English"},
}

FACT_PHRASES = {"capital": "What is the capital of {}?", "currency": "What currency does {} use?",
                "population": "What is the population of {}?", "language": "What language is spoken in {}?"}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class ToolError(ValueError):
    """A call the tool cannot run; its message is the tool result the model sees."""


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ToolError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> float:
    text = str(expression).replace("×", "*").replace("÷", "/").replace("x", "*").replace(",", "")
    if len(text) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse expression {expression!r}") from None
    return _eval_node(tree.body)


def _unit(name: Any) -> str:
    u = str(name).strip().lower().replace("°", "").replace("degrees ", "")
    u = UNIT_ALIASES.get(u, u)
    if u not in UNITS and u not in TEMPERATURES:
        raise ToolError(f"unknown unit {name!r}")
    return u


def convert(value: Any, from_unit: Any, to_unit: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ToolError(f"value {value!r} is not a number") from None
    a, b = _unit(from_unit), _unit(to_unit)
    if a in TEMPERATURES or b in TEMPERATURES:
        if not (a in TEMPERATURES and b in TEMPERATURES):
            raise ToolError(f"cannot convert {from_unit!r} to {to_unit!r}")
        return v if a == b else (v * 9 / 5 + 32 if a == "c" else (v - 32) * 5 / 9)
    (dim_a, fa), (dim_b, fb) = UNITS[a], UNITS[b]
    if dim_a != dim_b:
        raise ToolError(f"cannot convert {dim_a} ({from_unit!r}) to {dim_b} ({to_unit!r})")
    return v * fa / fb


def lookup(country: Any, field: Any) -> str:
    row = COUNTRIES.get(str(country).strip().lower())
    if row is None:
        raise ToolError(f"unknown country {country!r}")
    if field not in row:
        raise ToolError(f"unknown field {field!r}; valid: {', '.join(row)}")
    return row[field]


def fmt_number(x: float) -> str:
    """A number as a person writes it: an integer without decimals, else 2 decimals at most."""
    return str(int(round(x))) if abs(x - round(x)) < 1e-9 else f"{x:.2f}".rstrip("0").rstrip(".")


def run_tool(name: str, arguments: str) -> str:
    """The result text of one call: the value, or ``error: ...``."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        if name == "calculator":
            return fmt_number(calculate(args["expression"]))
        if name == "convert_units":
            return fmt_number(convert(args["value"], args["from_unit"], args["to_unit"]))
        if name == "lookup_country":
            return lookup(args["country"], args["field"])
        raise ToolError(f"unknown tool {name!r}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not valid JSON ({e.msg})"
    except KeyError as e:
        return f"error: missing argument {e.args[0]!r}"
    except (ToolError, OverflowError, TypeError) as e:
        return f"error: {e}"


@dataclass(frozen=True)
class ToolTask:
    question: str
    tool: str  # "" for a plain question, answered without a tool
    arguments: str  # JSON of the call that answers it
    answer: str  # the expected tool result ("" for a plain question)
    keywords: tuple[str, ...] = ()  # plain questions: what an on-topic answer mentions

    @property
    def needs_tool(self) -> bool:
        return bool(self.tool)

    def call_text(self) -> str:
        return f'<tool_call>\n{json.dumps({"name": self.tool, "arguments": json.loads(self.arguments)})}\n</tool_call>'

    def answered_by(self, text: str) -> bool:
        """``text`` states the expected answer (numbers as numbers, words case-insensitively)."""
        try:
            want = float(self.answer)
        except ValueError:
            return self.answer.lower() in text.lower()
        for tok in text.replace(",", "").replace("$", " ").split():
            try:
                if math.isclose(float(tok.strip(".!?;:()'\"")), want, rel_tol=1e-3, abs_tol=1e-6):
                    return True
            except ValueError:
                continue
        return False


def _arith(rng: random.Random) -> ToolTask:
    a, b = rng.randint(12, 999), rng.randint(3, 99)
    op, word = rng.choice([("*", "times"), ("+", "plus"), ("-", "minus")])
    expr = f"{a}{op}{b}"
    return ToolTask(f"What is {a} {word} {b}?", "calculator", json.dumps({"expression": expr}),
                    fmt_number(calculate(expr)))


def _conversion(rng: random.Random) -> ToolTask:
    a, b = rng.choice([("mile", "km"), ("km", "mile"), ("lb", "kg"), ("kg", "lb"), ("ft", "m"), ("gallon", "l"),
                       ("c", "f"), ("f", "c"), ("oz", "g")])
    v = rng.randint(2, 300)
    args = {"value": v, "from_unit": a, "to_unit": b}
    return ToolTask(f"How many {UNIT_WORDS[b]} is {v} {UNIT_WORDS[a]}?", "convert_units", json.dumps(args),
                    fmt_number(convert(v, a, b)))


def _fact(rng: random.Random) -> ToolTask:
    country = rng.choice(sorted(COUNTRIES))
    field = rng.choice(["capital", "currency", "population", "language"])
    args = {"country": country.title(), "field": field}
    return ToolTask(FACT_PHRASES[field].format(country.title()), "lookup_country", json.dumps(args),
                    COUNTRIES[country][field])


def tool_tasks(n: int, seed: int) -> list[ToolTask]:
    """``n`` distinct tool tasks, a third of each kind, from ``seed``."""
    rng, out, seen = random.Random(seed), [], set()
    makers = [_arith, _conversion, _fact]
    while len(out) < n:
        t = makers[len(out) % 3](rng)
        if t.question not in seen and len(seen) < 10_000:
            seen.add(t.question)
            out.append(t)
    return out


_TOOLISH = ("capital", "how many", "boiling", "freezing", "speed of", "language")  # what a tool could answer


def _plain(questions) -> list[ToolTask]:
    """The (question, keywords) pairs no tool could answer, as plain tasks."""
    return [ToolTask(q, "", "{}", "", kw) for q, kw in questions if not any(w in q.lower() for w in _TOOLISH)]


def plain_tasks() -> list[ToolTask]:
    return _plain(QUESTIONS)


def unseen_plain_tasks() -> list[ToolTask]:
    """Plain questions the tools scenario never asks, neither in training nor held out (the persona
    demo's validation questions): more evidence on plain-question quality than the held-out dozen."""
    return _plain(VALIDATION_QUESTIONS)


def _balanced(n: int, seed: int, asked: set[str]) -> list[ToolTask]:
    """``n`` tool tasks from ``seed``, none of them in ``asked``, a third of each kind."""
    out: list[ToolTask] = []
    for t in tool_tasks(n * 6, seed):  # in turn: arithmetic, conversion, lookup
        if t.question not in asked and sum(x.tool == t.tool for x in out) < -(-n // 3):
            out.append(t)
    return out[:n]


def gate_tasks(n_tools: int, n_plain: int, seed: int = 0) -> tuple[list[ToolTask], list[ToolTask]]:
    """(tool tasks, plain questions) of the tools scenario's promotion gate: tool tasks from another
    seed than training's and the held-out split's, sharing no question with either, a third of each
    kind; plain questions from GATE_PLAIN_QUESTIONS."""
    if not 0 <= n_plain <= len(GATE_PLAIN_QUESTIONS):
        raise ValueError(f"gate plain questions must be in [0, {len(GATE_PLAIN_QUESTIONS)}], got {n_plain}")
    train, held, _, _ = split_tasks(seed)
    return _balanced(n_tools, seed + 20_011, {t.question for t in train + held}), \
        _plain(GATE_PLAIN_QUESTIONS[:n_plain])


def split_tasks(seed: int = 0, n_train: int = 96, n_heldout: int = 12,
                plain_heldout: int = 12) -> tuple[list[ToolTask], list[ToolTask], list[ToolTask], list[ToolTask]]:
    """(training tool tasks, held-out tool tasks, training plain questions, held-out plain questions).
    The held-out tool tasks come from another seed, a third of each kind, and share no question with
    the training ones."""
    train = tool_tasks(n_train, seed)
    held = _balanced(n_heldout, seed + 10_007, {t.question for t in train})
    plain = plain_tasks()
    random.Random(seed).shuffle(plain)
    return train, held, plain[plain_heldout:], plain[:plain_heldout]


PLAIN_SHARE = 1 / 3  # of the users of a training round who ask a plain question, by default
WRONG = "that's wrong."  # the user's reaction to a final answer without the task's answer
