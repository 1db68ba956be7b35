"""The BFCL gate evaluator (``clawrl.sim.validation:tools_bfcl``) and the gate's guard on its groups.

CI has no BFCL environment (`make bfcl`), so most tests here talk to a stand-in for BFCL's side: a
script speaking the plugin's protocol (``clawrl/sim/bfcl_plugin.py``, one JSON request a line) over
the same pipes, with four hand-built BFCL rows and a stand-in checker (irrelevance: right when the
reply has no call; AST: right when the calls equal the row's answer). The last test runs BFCL's own
checker and is skipped where its environment is missing."""

from __future__ import annotations

import json
import sys

import pytest

import clawrl.sim.bfcl as bfcl
from clawrl.evaluation import load_eval_set
from clawrl.records import EvaluationRecord
from clawrl.storage.writer import DataStore


def _tool(name: str, **props: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}}


ROWS = [  # id, category, question, tools, the right calls (AST rows)
    ("irrelevance_0", "irrelevance", "Who wrote Hamlet?", [_tool("get_weather", city="string")], None),
    ("irrelevance_1", "irrelevance", "Tell me a joke.", [_tool("convert_currency", amount="number")], None),
    ("simple_python_0", "simple_python", "Area of a triangle with base 10 and height 5?",
     [_tool("calculate_triangle_area", base="integer", height="integer")],
     [{"calculate_triangle_area": {"base": 10, "height": 5}}]),
    ("multiple_0", "multiple", "Square root of 16?", [_tool("sqrt", x="number"), _tool("log", x="number")],
     [{"sqrt": {"x": 16}}]),
]
STAND_IN = f"""
import json, sys
rows = json.loads({json.dumps(json.dumps(ROWS))})
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "sample":
        out = {{"prompts": [{{"id": i, "category": c, "messages": [{{"role": "user", "content": q}}], "tools": t}}
                            for c, n in req["counts"].items() for i, c2, q, t, _ in [r for r in rows if r[1] == c][:n]
                            if c2 == c]}}
    else:
        right = {{r[0]: r[4] for r in rows}}[req["id"]]
        result = req["result"]
        calls = None if isinstance(result, str) else [{{k: json.loads(v)}} for d in result for k, v in d.items()]
        out = {{"valid": calls is None if right is None else calls == right}}
    print(json.dumps(out), flush=True)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "stand_in_plugin.py"
    script.write_text(STAND_IN)
    worker = bfcl.BfclWorker([sys.executable, str(script)])
    monkeypatch.setattr(bfcl, "worker", lambda: worker)
    yield worker
    worker.close()


def _call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_the_evaluator_adds_bfcl_prompts_in_two_groups_beside_the_tools_set(stand_in):
    from clawrl.sim.validation import bfcl_counts, tools

    # size 8: the tools set's 4 tool tasks and 4 plain questions, then 8 // 2 = 4 BFCL prompts
    assert bfcl_counts(4) == {"irrelevance": 2, "simple_python": 1, "multiple": 1}
    assert bfcl_counts(5) == {"irrelevance": 2, "simple_python": 2, "multiple": 1}
    s = load_eval_set("clawrl.sim.validation:tools_bfcl", size=8, samples=1, seed=0, max_tokens=64, temperature=0.3)
    assert s.groups == ("tools",) * 4 + ("plain",) * 4 + ("bfcl_irrelevance",) * 2 + ("bfcl_ast",) * 2
    assert s.prompts[:8] == [p["messages"] for p in tools(size=8, seed=0)[0]]
    assert [p[-1]["content"] for p in s.prompts[8:]] == [r[2] for r in ROWS]
    assert s.tools[8:] == [r[3] for r in ROWS]  # each BFCL prompt offers its own tools, never the scenario's
    assert s.group_indices("bfcl_irrelevance") == [8, 9] and s.group_indices("bfcl_ast") == [10, 11]
    # the key names the prompts: the same evaluator and seed give the same set
    again = load_eval_set("clawrl.sim.validation:tools_bfcl", size=8, samples=1, seed=0, max_tokens=64, temperature=0.3)
    assert again.key == s.key != load_eval_set("clawrl.sim.validation:tools", size=8, samples=1, seed=0,
                                               max_tokens=64, temperature=0.3).key


def test_bfcl_answers_are_scored_as_the_gateway_would_return_them(stand_in):
    s = load_eval_set("clawrl.sim.validation:tools_bfcl", size=8, samples=1, seed=0, max_tokens=64, temperature=0.3)
    # irrelevance: a plain answer is right, a call of an offered tool is wrong; a call of a tool that is not
    # offered stays text (the gateway returns it as content), so it is no call
    assert s.score(8, "Shakespeare wrote Hamlet.") == 1.0
    assert s.score(8, _call("get_weather", city="Elsinore")) == 0.0
    assert s.score(8, _call("search_books", title="Hamlet")) == 1.0
    # AST: the right call (the arguments as JSON, whatever their spacing) is right; other arguments, a plain
    # answer or a broken call are wrong
    assert s.score(10, _call("calculate_triangle_area", base=10, height=5)) == 1.0
    assert s.score(10, _call("calculate_triangle_area", base=5, height=10)) == 0.0
    assert s.score(10, "The area is 25.") == 0.0
    assert s.score(10, '<tool_call>\n{"name": "calculate_triangle_area", "arguments": {"base": 10,\n</tool_call>') == 0.0
    assert s.score(11, _call("log", x=16)) == 0.0 and s.score(11, _call("sqrt", x=16)) == 1.0
    # the tools set's own prompts keep their scorer
    assert s.score(0, _call("calculator", expression="50+12")) == 1.0


def test_the_gate_refuses_a_candidate_that_calls_tools_on_irrelevant_prompts(stand_in, tmp_path):
    """Hand-built answers scored by the evaluator: the base model never calls a tool; the candidate calls
    the right tool on every tool task and BFCL AST prompt, but also on the irrelevance prompts. Overall it
    gains; the guard on ``bfcl_irrelevance`` refuses it."""
    from clawrl.promotion import gate_candidate
    from clawrl.sim.tools import gate_tasks

    s = load_eval_set("clawrl.sim.validation:tools_bfcl", size=8, samples=1, seed=0, max_tokens=64, temperature=0.3)
    tasks, plain = gate_tasks(4, 4, 0)
    right_tool = [t.call_text() for t in tasks]
    base = ["I do not know."] * 4 + [f"{t.question} {' '.join(t.keywords)}" for t in plain] + ["No."] * 4
    cand = right_tool + base[4:8] + [_call("get_weather", city="x"), _call("convert_currency", amount=1),
                                     _call("calculate_triangle_area", base=10, height=5), _call("sqrt", x=16)]
    scores = {v: [s.score(i, a) for i, a in enumerate(answers)] for v, answers in (("0", base), ("1", cand))}
    assert scores["0"][8:] == [1.0, 1.0, 0.0, 0.0] and scores["1"][8:] == [0.0, 0.0, 1.0, 1.0]
    assert scores["1"][:4] == [1.0] * 4 and scores["0"][4:8] == scores["1"][4:8]
    kw = dict(engine=None, adapter=None, eval_set=s, base_dir=tmp_path, tolerance=0.05, alpha=0.05, min_gain=0.0)
    with DataStore(tmp_path) as store:
        for v, sc in scores.items():
            store.append(EvaluationRecord(evaluation_id=f"e{v}", weight_version=v, eval_key=s.key, scores=sc,
                                          mean=sum(sc) / len(sc), n=len(sc), samples=1, seconds=0.0))
        unguarded = gate_candidate(store, tmp_path, candidate="1", **kw, guard=["plain", "bfcl_ast"])
        guarded = gate_candidate(store, tmp_path, candidate="1", **kw, guard=["plain", "bfcl_irrelevance"])
    # mean (4 + 4·p + 2) / 12 vs (4·p + 2) / 12 with p the plain rate: +4/12 overall
    assert unguarded["decision"] == "promote" and unguarded["mean_diff"] == pytest.approx(4 / 12)
    assert guarded["decision"] == "refuse"
    assert guarded["reason"].startswith("below the initial model on guarded group 'bfcl_irrelevance': 0.000 vs 1.000")


def test_the_worker_names_a_failed_request_and_a_dead_process(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text("import json, sys\nfor line in sys.stdin:\n    print(json.dumps({'error': 'KeyError: x'}), "
                      "flush=True)\n    break\n")
    w = bfcl.BfclWorker([sys.executable, str(script)])
    with pytest.raises(RuntimeError, match="BFCL's worker failed on check irrelevance_9: KeyError: x"):
        w.check("irrelevance_9", "text")
    with pytest.raises(RuntimeError, match="BFCL's worker exited with code 0"):
        w.check("irrelevance_9", "text")


@pytest.mark.skipif(not (bfcl.BFCL_ENV / "bin" / "python").exists(), reason="BFCL's environment: `make bfcl`")
def test_bfcls_own_checker_through_the_plugin():
    w = bfcl.BfclWorker([str(bfcl.bfcl_python()), str(bfcl.PLUGIN), "serve"])
    try:
        drawn = w.sample({"irrelevance": 2, "simple_python": 1}, 0)
        assert [d["category"] for d in drawn] == ["irrelevance", "irrelevance", "simple_python"]
        assert [d["id"] for d in w.sample({"irrelevance": 2, "simple_python": 1}, 0)] == [d["id"] for d in drawn]
        assert all(t["type"] == "function" and "." not in t["function"]["name"] for d in drawn for t in d["tools"])
        tools = [_tool("calculate_triangle_area", base="integer", height="integer")]
        right = bfcl.as_result(_call("calculate_triangle_area", base=10, height=5), tools)
        assert right == [{"calculate_triangle_area": '{"base": 10, "height": 5}'}]
        assert w.check("simple_python_0", right) is True
        assert w.check("simple_python_0", bfcl.as_result(_call("calculate_triangle_area", base=10, height=6), tools)) \
            is False
        assert w.check("simple_python_0", "The area is 25.") is False
        assert w.check("irrelevance_0", "I cannot help with that.") is True
        assert w.check("irrelevance_0", right) is False
        assert w.describe()["handler"] == "ClawrlHandler(OpenAICompletionsHandler)"
    finally:
        w.close()


def test_the_demo_says_how_to_get_bfcl_when_its_config_names_the_bfcl_evaluator(tmp_path, monkeypatch):
    from pathlib import Path

    from typer.testing import CliRunner

    from clawrl.cli import app

    monkeypatch.setattr(bfcl, "BFCL_ENV", tmp_path / "nowhere")
    conf = tmp_path / "gated.toml"
    conf.write_text((Path(__file__).resolve().parents[1] / "conf" / "demo-tools.toml").read_text()
                    + '\n[gate]\nevaluator = "clawrl.sim.validation:tools_bfcl"\nguard = ["plain", "bfcl_irrelevance"]\n')
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["demo", "--scenario", "tools", "-c", str(conf), "--run-dir", str(run)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "[gate] evaluator = 'clawrl.sim.validation:tools_bfcl': BFCL is not installed" in text, text
    assert "`make bfcl`" in text and not run.exists()
