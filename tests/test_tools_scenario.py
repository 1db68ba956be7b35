"""The tool-use scenario: the tools (hand-computed results), the task bank, the reward hook's
step-by-step scores, and one step of `clawrl demo --scenario tools` end to end on the tiny model."""

import json
import re
import os
import sys
from pathlib import Path

import pytest

from clawrl.flows.loop import tool_round_tasks
from clawrl.sim.tool_reward import find_task, score_turn
from clawrl.sim.tools import TOOLS, ToolTask, run_tool, split_tasks, tool_tasks
from tests.utils.waiting import run_to_end, spawn

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,args,want", [
    ("calculator", {"expression": "347*29"}, "10063"),
    ("calculator", {"expression": "(12 + 8) / 8"}, "2.5"),
    ("calculator", {"expression": "1,234 + 5678"}, "6912"),
    ("calculator", {"expression": "7 / 0"}, "error: division by zero"),
    ("calculator", {"expression": "2**10"}, "error: unsupported expression element BinOp"),
    ("calculator", {"expression": "__import__('os')"}, "error: unsupported expression element Call"),
    ("convert_units", {"value": 26, "from_unit": "miles", "to_unit": "km"}, "41.84"),  # 26 * 1.609344 = 41.842944
    ("convert_units", {"value": 100, "from_unit": "c", "to_unit": "f"}, "212"),
    ("convert_units", {"value": 212, "from_unit": "fahrenheit", "to_unit": "celsius"}, "100"),
    ("convert_units", {"value": 10, "from_unit": "lb", "to_unit": "kg"}, "4.54"),  # 4.5359237
    ("convert_units", {"value": 3, "from_unit": "kg", "to_unit": "mile"},
     "error: cannot convert mass ('kg') to length ('mile')"),
    ("convert_units", {"value": "ten", "from_unit": "kg", "to_unit": "g"}, "error: value 'ten' is not a number"),
    ("lookup_country", {"country": "Japan", "field": "currency"}, "yen"),
    ("lookup_country", {"country": "mars", "field": "capital"}, "error: unknown country 'mars'"),
    ("lookup_country", {"country": "Peru"}, "error: missing argument 'field'"),
    ("weather", {}, "error: unknown tool 'weather'"),
])
def test_tools_compute_what_a_person_would(name, args, want):
    assert run_tool(name, json.dumps(args)) == want


def test_malformed_arguments_are_an_error_result():
    assert run_tool("calculator", "{expression: 1}").startswith("error: arguments are not valid JSON")
    assert run_tool("calculator", "[1, 2]") == "error: arguments must be a JSON object"
    assert {t["function"]["name"] for t in TOOLS} == {"calculator", "convert_units", "lookup_country"}


def test_task_bank_is_fixed_disjoint_and_rebuilt_from_the_question():
    train, held, plain_train, plain_held = split_tasks(0)
    assert (len(train), len(held), len(plain_train), len(plain_held)) == (96, 12, 44, 12)
    assert split_tasks(0) == (train, held, plain_train, plain_held)
    assert not {t.question for t in train} & {t.question for t in held}
    assert not {t.question for t in plain_train} & {t.question for t in plain_held}
    assert [t.tool for t in train[:3]] == ["calculator", "convert_units", "lookup_country"]
    for t in train + held + tool_tasks(30, seed=5):  # any seed: the hook finds the task from its text alone
        assert find_task(t.question) == t
        assert run_tool(t.tool, t.arguments) == t.answer
    assert find_task(plain_held[0].question) == plain_held[0] and not plain_held[0].needs_tool
    assert find_task("What is 12 times 7?").answer == "84" and find_task("hello") is None
    conv = find_task("How many kilometers is 134 miles?")
    assert (conv.answer, json.loads(conv.arguments)) == ("215.65", {"value": 134, "from_unit": "mile",
                                                                    "to_unit": "km"})  # 134 * 1.609344 = 215.652


def test_answered_by_reads_numbers_and_words():
    t = find_task("What is 347 times 29?")
    assert t.answered_by("The result is 10,063.") and t.answered_by("10063") and not t.answered_by("1006.3 or 100630")
    assert find_task("What currency does Japan use?").answered_by("Japan uses the Yen.")
    assert find_task("How many kilometers is 134 miles?").answered_by("about 215.65 km")


def test_rounds_ask_two_tool_tasks_per_plain_question_and_move_on():
    r1, r2 = tool_round_tasks(1, 6, 0), tool_round_tasks(2, 6, 0)
    assert [t.needs_tool for t in r1] == [True, True, True, True, False, False]
    train, _, plain, _ = split_tasks(0)
    assert r1[:4] == train[:4] and r2[:4] == train[4:8] and r1[4:] == plain[:2] and r2[4:] == plain[2:4]


def test_plain_share_sets_how_many_users_ask_plain_questions():
    train, _, plain, _ = split_tasks(0)
    assert sum(not t.needs_tool for t in tool_round_tasks(1, 16, 0)) == 5  # 16 // 3, the default
    half = tool_round_tasks(2, 16, 0, plain_share=0.5)
    assert half[:8] == train[8:16] and half[8:] == plain[8:16]  # round 2 continues both pools by 8
    assert [t.needs_tool for t in tool_round_tasks(1, 20, 0, 0.5)] == [True] * 10 + [False] * 10
    assert all(t.needs_tool for t in tool_round_tasks(1, 4, 0, 0.0))
    assert tool_round_tasks(1, 4, 0, 1.0) == plain[:4]
    assert sum(not t.needs_tool for t in tool_round_tasks(1, 9, 0, 0.7)) == 6  # 6.3 rounded down
    with pytest.raises(ValueError, match=r"plain_share must be in \[0, 1\], got 1.5"):
        tool_round_tasks(1, 4, 0, 1.5)
    from typer.testing import CliRunner

    from clawrl.cli import app
    out = CliRunner().invoke(app, ["demo", "--scenario", "tools", "--plain-share", "1.5"])
    assert out.exit_code == 2 and "--plain-share" in out.output and "less than or equal to 1" in out.output


CALC = find_task("What is 347 times 29?")
FIRST = [{"role": "system", "content": "s"}, {"role": "user", "content": CALC.question}]


def _call(name, args):
    return [{"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]


@pytest.mark.parametrize("calls,text,next_messages,want", [
    # a call, scored from its tool result: the answer, an error, a result that is not the answer
    (_call("calculator", {"expression": "347 * 29"}), "", [{"role": "tool", "content": "10063"}], (1, None)),
    (_call("calculator", {"expression": "347 x"}), "", [{"role": "tool", "content": "error: cannot parse"}],
     (-1, CALC.call_text())),
    (_call("calculator", {"expression": "347+29"}), "", [{"role": "tool", "content": "376"}], (-1, CALC.call_text())),
    (_call("lookup_country", {"country": "Japan", "field": "capital"}), "",
     [{"role": "tool", "content": "Tokyo"}], (-1, CALC.call_text())),
    # no call: right anyway, or wrong (the hint is the call)
    ([], "It is 10063.", [{"role": "user", "content": "thanks, that's great!"}], (1, None)),
    ([], "It is 9000.", [{"role": "user", "content": "that's wrong."}], (-1, CALC.call_text())),
])
def test_first_replies_to_tool_tasks_score_from_the_tool_result(calls, text, next_messages, want):
    assert score_turn(CALC, FIRST, calls, text, next_messages) == want


def test_final_answers_and_plain_questions_score_from_the_user():
    after = FIRST + [{"role": "assistant", "content": None}, {"role": "tool", "content": "10063"}]
    assert score_turn(CALC, after, [], "10063", [{"role": "user", "content": "thanks, that's great!"}]) == (1, None)
    assert score_turn(CALC, after, [], "9", [{"role": "user", "content": "that's wrong."}])[0] == -1
    plain = ToolTask("What do bees make?", "", "{}", "", ("honey",))
    ask = [{"role": "user", "content": plain.question}]
    assert score_turn(plain, ask, [], "Honey.", [{"role": "user", "content": "thanks, that's great!"}]) == (1, None)
    assert score_turn(plain, ask, _call("calculator", {"expression": "1"}), "", [{"role": "tool", "content": "1"}]) \
        == (-1, "This question needs no tool: answer it directly in one or two sentences.")
    assert score_turn(None, ask, [], "x", [{"role": "user", "content": "that's not what I asked."}])[0] == -1


def test_one_step_of_the_tools_demo_end_to_end(tmp_path, model_cache):
    """`clawrl demo --scenario tools` on the tiny model for one step, a generate hook playing a policy
    that calls the calculator right, the unit converter wrong and nothing else: the held-out rates
    are exactly what that policy earns, the judge scored each step from its next state, a failed
    tool task left a demonstration of its call, and the curve is a PNG and an MLflow run."""
    conf = tmp_path / "tools.toml"
    conf.write_text((ROOT / "conf" / "demo-tools.toml").read_text().replace('name = "smollm2-135m"', 'name = "tiny"')
                    + f'generate = "tests.utils.tool_task_hook:generate"\n\n[storage]\ndata_root = "{tmp_path}"\n'
                    f'model_cache = "{model_cache}"\n')
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "demo", "--scenario", "tools", "-c", str(conf),
                      "--steps", "1", "--users", "6", "--heldout", "6", "--eval-samples", "1",
                      "--run-dir", str(run)], cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((run / "reports" / "learning_curve.json").read_text())
    assert [r["step"] for r in rows] == [0, 1]
    assert [t.tool for t in split_tasks(0, n_heldout=3, plain_heldout=3)[1]] == ["calculator", "convert_units",
                                                                                   "lookup_country"]
    for r in rows:  # held out: the calculator task (right), the conversion (wrong unit), the lookup (no call)
        assert (r["tool_use"], r["call_rate"], r["solved"]) == pytest.approx((1 / 3, 2 / 3, 1 / 3))
        assert r["false_call_rate"] == 0.0  # plain questions: the engine answers, never a call
    assert (run / "reports" / "learning_curve.png").stat().st_size > 10_000
    from clawrl.lineage import client as mlflow_client, log_policy_point

    # the served held-out rates also sit on the policy run, at step = the weight version each row decided on
    policy = log_policy_point(run, 0, {})
    history = mlflow_client(run).get_metric_history(policy, "served_tool_use")
    assert [m.step for m in history] == sorted({int(r.get("candidate_version") or r["weight_version"]) for r in rows})
    assert [m.value for m in history] == pytest.approx([1 / 3] * len(history))

    from clawrl.storage.catalog import open_catalog

    with open_catalog(run) as con:
        verdicts = con.execute("""
            select t.request_messages, t.tool_calls, v.score, v.hint from turns t join verdicts v using (turn_id)
            where t.turn_type = 'main'""").fetchall()
        demos = con.execute("""
            select s.output_ids, s.reward, s.has_teacher from samples s join turns t using (turn_id)
            where s.output_ids <> t.output_ids""").fetchall()
    by_kind = {}
    for messages, calls, score, hint in verdicts:
        msgs = json.loads(messages)
        task = find_task(msgs[1]["content"])
        stage = "final" if msgs[-1]["role"] == "tool" else "first"
        by_kind.setdefault((task.tool or "plain", stage), []).append((score, hint))
    # the round: calculator, conversion, lookup, calculator, then two plain questions
    assert [t.tool for t in tool_round_tasks(1, 6, 0)] == ["calculator", "convert_units", "lookup_country",
                                                          "calculator", "", ""]
    assert by_kind[("calculator", "first")] == [(1, None)] * 2  # the call returned the answer
    assert by_kind[("calculator", "final")] == [(1, None)] * 2  # "The answer is ...": the user thanked
    assert [s for s, _ in by_kind[("convert_units", "first")]] == [-1]  # error: unknown unit 'parsec'
    assert [s for s, _ in by_kind[("convert_units", "final")]] == [-1]  # "The answer is error: ..." is wrong
    assert [s for s, _ in by_kind[("lookup_country", "first")]] == [-1]  # no call, no answer
    assert len(by_kind[("plain", "first")]) == 2
    # every failed first reply to a tool task left a demonstration: its call, then EOS, reward +1
    assert len(demos) == 2 and all(r == 1.0 and not teacher for _, r, teacher in demos)
    from clawrl.models import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir("tiny", model_cache))
    texts = sorted(tok.decode(ids) for ids, _, _ in demos)
    hints = sorted(h + tok.eos_token for (tool, stage), vs in by_kind.items() for s, h in vs
                   if stage == "first" and tool != "plain" and s == -1)
    assert texts == hints and all(t.startswith("<tool_call>\n{") for t in texts)


def test_the_tools_demo_gates_with_the_tools_evaluator_when_the_config_names_it(tmp_path, model_cache):
    """With `[gate] evaluator = "clawrl.sim.validation:tools"` (and a guard on its plain questions) the
    tools demo gates each candidate on the tools evaluator's prompts, with the demo's seed and answer
    budget; without it the demo serves every checkpoint, as a persona evaluator cannot judge tool calls."""
    from clawrl.cli.demo import _gate_overrides
    from clawrl.config import load_settings
    from clawrl.evaluation import load_eval_set

    gated = tmp_path / "gated.toml"
    gated.write_text((ROOT / "conf" / "demo-tools.toml").read_text().replace('name = "smollm2-135m"', 'name = "tiny"')
                     .replace("rollout_batch_size = 24", "rollout_batch_size = 3")  # one step from 3 users
                     + f'\n[storage]\ndata_root = "{tmp_path}"\nmodel_cache = "{model_cache}"\n\n[gate]\n'
                     'evaluator = "clawrl.sim.validation:tools"\nsize = 6\nguard = ["plain"]\n')
    # ungated: no canary either (a canary share needs the gate)
    assert _gate_overrides(load_settings(ROOT / "conf" / "demo-tools.toml"), "tools", "concise", 3, 64) == \
        {"gate.enabled": False, "gate.canary_share": 0.0}
    assert _gate_overrides(load_settings(gated), "tools", "concise", 3, 64) == {"gate.seed": 3, "ppo.max_new_tokens": 64}
    run = tmp_path / "run"
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "demo", "--scenario", "tools", "-c", str(gated),
                      "--steps", "1", "--users", "3", "--heldout", "2", "--eval-samples", "1",
                      "--run-dir", str(run)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((run / "reports" / "learning_curve.json").read_text())
    assert rows[1]["gate"] in ("promote", "refuse") and rows[1]["val_candidate"] is not None
    from clawrl.storage.catalog import run_query

    [promo] = run_query(run, "select eval_key, n, source, reason from promotions").to_pylist()
    want = load_eval_set("clawrl.sim.validation:tools", size=6, samples=2, seed=0, max_tokens=64, temperature=0.3)
    assert promo["eval_key"] == want.key and promo["n"] == 6 and promo["source"] == "gate"
    assert want.groups == ("tools",) * 3 + ("plain",) * 3
    evals = run_query(run, "select weight_version, scores from evaluations order by weight_version").to_pylist()
    assert [e["weight_version"] for e in evals] == ["0", "1"] and all(len(e["scores"]) == 6 for e in evals)


def _run_summary(run: Path) -> dict:
    """What a run did, without its random ids: each turn's output by (session, turn index), each batch as
    the sorted (session, turn index, output) of its samples, and the curve's rates."""
    from clawrl.storage.catalog import run_query

    turns = {(r["session_id"], r["turn_index"]): list(r["output_ids"])
             for r in run_query(run, "select session_id, turn_index, output_ids from turns").to_pylist()}
    batches = run_query(run, """select b.step, t.session_id, t.turn_index, s.output_ids
                                from (select step, unnest(sample_ids) as sample_id from batches) b
                                join samples s using (sample_id) join turns t using (turn_id)""").to_pylist()
    by_step: dict = {}
    for r in batches:
        by_step.setdefault(r["step"], []).append((r["session_id"], r["turn_index"], list(r["output_ids"])))
    rows = json.loads((run / "reports" / "learning_curve.json").read_text())
    rates = [{k: r.get(k) for k in ("step", "tool_use", "call_rate", "solved", "plain_quality", "false_call_rate",
                                "samples", "weight_version")} for r in rows]
    return {"turns": turns, "batches": {k: sorted(v) for k, v in by_step.items()}, "rates": rates,
            "loss": [r.get("loss") for r in rows]}


def _first_apart(x: list[int], y: list[int]) -> tuple[int, int, int]:
    """(position, x's token, y's token) where two outputs first differ (-1 past the shorter's end)."""
    i = next(i for i in range(max(len(x), len(y))) if i >= min(len(x), len(y)) or x[i] != y[i])
    return i, (x + [-1])[min(i, len(x))], (y + [-1])[min(i, len(y))]


def _when(key: tuple[str, int] | None) -> tuple[int, int, int]:
    """When a (session, turn index) happened: round n's users ('trainNNN-...') come before the held-out
    answers after its step ('evalNNN-...')."""
    session, turn = key
    kind, n = re.match(r"(train|eval)(\d+)-", session).groups()
    return int(n), 0 if kind == "train" else 1, turn


@pytest.mark.slow
def test_the_tools_demo_reproduces_its_run_with_the_same_config_and_seed(tmp_path, model_cache):
    """Two runs at once (so their turns complete in different orders): the same turns, the same batches,
    the same rates. A round yields more samples than a batch takes (6 users: 6 replies + 4 demonstrations,
    batches of 4): which ones a batch takes used to follow the order the gateway completed the turns in.
    Not bit for bit: the CPU engine's logprobs depend at ~1e-6 on which requests share a decode step, and
    they enter the loss (truncated importance sampling), so losses agree to ~1e-6, not exactly; a draw
    as close to a boundary of the inverse CDF (sampled in vocabulary order) flips to the next token id,
    and what follows that turn may then differ (4 of 6 runs beside other work had such a flip)."""
    conf = tmp_path / "tiny.toml"
    conf.write_text((ROOT / "conf" / "demo-tools.toml").read_text().replace('name = "smollm2-135m"', 'name = "tiny"')
                    .replace("rollout_batch_size = 24", "rollout_batch_size = 4")
                    + f'\n[storage]\ndata_root = "{tmp_path}"\nmodel_cache = "{model_cache}"\n')
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [spawn([sys.executable, "-m", "clawrl.cli", "demo", "--scenario", "tools", "-c", str(conf),
                    "--steps", "2", "--users", "6", "--heldout", "2", "--eval-samples", "1",
                    "--run-dir", str(run)], tmp_path, run.name, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
             for run in runs]
    for p in procs:
        out = p.result()
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a, b = (_run_summary(run) for run in runs)
    assert len(a["turns"]) > 20 and a["turns"].keys() == b["turns"].keys()
    apart = {k: _first_apart(a["turns"][k], b["turns"][k]) for k in a["turns"] if a["turns"][k] != b["turns"][k]}
    # a draw within ~1e-6 of a CDF boundary picks the neighbouring token id in one run (the engine's log-probs
    # move in the last bits with what shares a decode step): the first turn apart must be such a flip, and
    # what follows from it may differ; everything before it must not
    first = min(apart, key=_when, default=None)
    assert first is None or abs(apart[first][1] - apart[first][2]) == 1, apart
    flip_round = _when(first)[0] if first else 99
    train_flip = min((_when(k)[0] for k in apart if k[0].startswith("train")), default=99)
    assert sorted(a["batches"]) == [1, 2] and all(len(v) == 4 for v in a["batches"].values())
    assert all(a["batches"][n] == b["batches"][n] for n in a["batches"] if n < train_flip)
    assert [r for r in a["rates"] if r["step"] < flip_round] == [r for r in b["rates"] if r["step"] < flip_round]
    assert a["loss"][1:train_flip] == pytest.approx(b["loss"][1:train_flip], rel=1e-4)
