"""`[gate] guard`: groups of the evaluation prompts that must not get worse, whatever a candidate gains
on the others - the rule by hand, the gate over stored evaluations, the evaluator contract that tags
prompts, and the tools scenario's evaluator."""

import pytest

from clawrl.config import ConfigError
from clawrl.evaluation import EvalSet, load_eval_set
from clawrl.gate import Guard, decide_promotion
from clawrl.hooks import HookError
from clawrl.records import EvaluationRecord
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore

GROUPS = ("tools", "tools", "plain", "plain")


def test_a_guarded_group_refuses_a_candidate_that_gained_overall():
    # overall: candidate (1 + 1 + 1 + 0.5) / 4 = 0.875 vs champion 0.5: a gain of 0.375
    cand, champ = [1.0, 1.0, 1.0, 0.5], [0.0, 0.0, 1.0, 1.0]
    plain = Guard("plain", candidate=0.75, champion=1.0, floor=1.0)
    d = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.0, guards=[plain])
    assert not d.promoted and d.mean_diff == pytest.approx(0.375)
    assert d.reason.startswith("worse than the champion on guarded group 'plain': 0.750 vs 1.000 (guard_tolerance 0)")
    # within the guard's tolerance the gain decides
    ok = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.0, guards=[plain], guard_tolerance=0.25)
    assert ok.promoted and ok.reason.startswith("better than the champion by more than min_gain 0")
    # level with the champion but below the best promoted version by more than the guard tolerance
    low = Guard("plain", candidate=0.6, champion=0.6, floor=0.9)
    d = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, guards=[low], guard_tolerance=0.25)
    assert d.reason.startswith("below the best promoted score 0.900 on guarded group 'plain': 0.600 (guard_tolerance "
                               "0.25)")
    # the whole set's clauses come first: worse overall is refused as worse overall
    d = decide_promotion(champ, cand, tolerance=0.05, alpha=0.05, guards=[plain])
    assert d.reason.startswith("worse by more than the tolerance 0.05")
    with pytest.raises(ValueError, match="guard_tolerance must be >= 0"):
        decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, guard_tolerance=-0.1)


def _eval_set() -> EvalSet:
    return EvalSet([[{"role": "user", "content": str(i)}] for i in range(4)], lambda i, a: 0.0, 1, 0, 8, 0.0,
                   "k" * 16, groups=GROUPS)


def _scores(store, version: str, scores: list[float]) -> None:
    store.append(EvaluationRecord(evaluation_id=f"e{version}", weight_version=version, eval_key="k" * 16,
                                  scores=scores, mean=sum(scores) / len(scores), n=len(scores), samples=1, seconds=0.0))


def test_the_gate_reads_group_means_and_floors_from_stored_evaluations(tmp_path):
    from clawrl.promotion import gate_candidate

    kw = dict(engine=None, adapter=None, eval_set=_eval_set(), base_dir=tmp_path, tolerance=0.05, alpha=0.05,
              min_gain=0.0, guard=["plain"], guard_tolerance=0.25)
    with DataStore(tmp_path) as store:
        _scores(store, "0", [0.0, 0.0, 1.0, 1.0])  # the initial weights: mean 0.5, plain 1.0
        _scores(store, "1", [0.5, 0.5, 1.0, 0.5])  # mean 0.625; plain 0.75: within 0.25 of 1.0
        _scores(store, "2", [1.0, 1.0, 1.0, 0.0])  # 0.75; plain 0.5: within 0.25 of v1's 0.75, not of the floor 1.0
        _scores(store, "3", [1.0, 1.0, 0.5, 0.5])  # 0.75; plain 0.5 as well
        first = gate_candidate(store, tmp_path, candidate="1", **kw)
        second = gate_candidate(store, tmp_path, candidate="2", **kw)
        unguarded = gate_candidate(store, tmp_path, candidate="3", **{**kw, "guard": []})
        with pytest.raises(ValueError, match=r"no prompts in group 'chat' \(its groups: plain, tools\)"):
            gate_candidate(store, tmp_path, candidate="3", **{**kw, "guard": ["chat"]})
    assert first["decision"] == "promote" and first["serve_version"] == "1"
    assert second["decision"] == "refuse" and second["serve_version"] == "1"
    assert second["reason"].startswith("below the best promoted score 1.000 on guarded group 'plain': 0.500")
    # without the guard the same drop is promoted: the overall gain is all the rest of the rule sees
    assert unguarded["decision"] == "promote" and unguarded["mean_diff"] == pytest.approx(0.125)
    rows = run_query(tmp_path, "select weight_version, action from promotions order by weight_version").to_pylist()
    assert [(r["weight_version"], r["action"]) for r in rows] == [("1", "promote"), ("2", "refuse"), ("3", "promote")]


def test_an_evaluator_may_tag_its_prompts_and_untagged_sets_keep_their_key(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("guard_eval_mod")
    msgs = [{"role": "user", "content": "q"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    mod.plain = lambda size, seed: ([msgs, msgs], lambda i, a: 1.0)
    mod.tagged = lambda size, seed: ([{"messages": msgs, "tools": [tool], "group": "a"}, {"messages": msgs}],
                                     lambda i, a: 1.0)
    mod.bad = lambda size, seed: ([{"messages": msgs, "weight": 2}], lambda i, a: 1.0)
    monkeypatch.setitem(sys.modules, "guard_eval_mod", mod)
    kw = dict(size=2, samples=1, seed=0, max_tokens=4, temperature=0.0)
    plain = load_eval_set("guard_eval_mod:plain", **kw)
    assert plain.groups is None and plain.tools is None
    # the key of untagged prompts is the sha256 it always was (fixed here so that a change shows)
    import hashlib
    import json
    blob = json.dumps({"evaluator": "guard_eval_mod:plain", "prompts": [msgs, msgs], "samples": 1, "seed": 0,
                       "max_tokens": 4, "temperature": 0.0}, sort_keys=True)
    assert plain.key == hashlib.sha256(blob.encode()).hexdigest()[:16]
    tagged = load_eval_set("guard_eval_mod:tagged", **kw)
    assert tagged.groups == ("a", None) and tagged.tools == [[tool], None] and tagged.prompts == [msgs, msgs]
    assert tagged.key != plain.key and tagged.group_indices("a") == [0]
    with pytest.raises(HookError, match="prompt 0 must be a message list or a dict with 'messages'"):
        load_eval_set("guard_eval_mod:bad", **kw)


def test_guard_with_the_replay_set_is_a_config_error(make_settings):
    with pytest.raises(ConfigError, match="guard: the prompts of eval_set 'replay' have no groups"):
        make_settings({"gate.eval_set": "replay", "prm.backend": "engine", "gate.guard": ["plain"]})
    s = make_settings({"gate.guard": ["plain"], "gate.guard_tolerance": 0.02})
    assert s.gate.guard == ["plain"] and s.gate.guard_tolerance == 0.02


def test_the_tools_evaluator_scores_calls_by_their_result_and_plain_answers_by_topic():
    from clawrl.sim.prompts import QUESTIONS, VALIDATION_QUESTIONS
    from clawrl.sim.tools import TOOLS, split_tasks
    from clawrl.sim.validation import tools

    prompts, score = tools(size=8, seed=0)
    groups = [p["group"] for p in prompts]
    assert groups == ["tools"] * 4 + ["plain"] * 4 and all(p["tools"] == TOOLS for p in prompts)
    questions = [p["messages"][-1]["content"] for p in prompts]
    train, held, train_plain, held_plain = split_tasks(0)
    seen = {t.question for t in train + held + train_plain + held_plain} | {q for q, _ in QUESTIONS + VALIDATION_QUESTIONS}
    assert not seen & set(questions)
    assert questions[0] == "What is 50 plus 12?"
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "50+12"}}\n</tool_call>'
    wrong = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "50-12"}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expr": "50+12"}}\n</tool_call>'
    assert [score(0, a) for a in (call, call + wrong, wrong, broken, "It is 62.")] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert questions[4] == "What is a glacier?"
    assert score(4, "A glacier is a slow river of ice.") == 1.0
    assert score(4, "I like mountains.") == 0.0  # off topic
    assert score(4, "Ice. <tool_call>\n{\"name\": \"x\"}\n</tool_call>") == 0.0  # a call, even a broken one
