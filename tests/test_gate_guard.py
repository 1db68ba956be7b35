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
    plain = Guard("plain", candidate=0.75, base=1.0)
    d = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.0, guards=[plain])
    assert not d.promoted and d.mean_diff == pytest.approx(0.375)
    assert d.reason.startswith("below the initial model on guarded group 'plain': 0.750 vs 1.000 (guard_tolerance 0)")
    # within the guard's tolerance the gain decides
    ok = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, min_gain=0.0, guards=[plain], guard_tolerance=0.25)
    assert ok.promoted and ok.reason.startswith("not worse, and ahead of the champion by more than min_gain 0")
    # level with the initial model passes; the first failing guard is the one named
    level = [Guard("tools", 0.5, 0.5), Guard("plain", 0.7, 0.8), Guard("chat", 0.0, 0.9)]
    assert decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, guards=level[:1]).promoted
    d = decide_promotion(cand, champ, tolerance=0.05, alpha=0.05, guards=level, guard_tolerance=0.05)
    assert d.reason.startswith("below the initial model on guarded group 'plain': 0.700 vs 0.800 (guard_tolerance "
                               "0.05)")
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


def test_the_gate_guards_against_the_initial_models_stored_group_means(tmp_path):
    from clawrl.promotion import gate_candidate

    kw = dict(engine=None, adapter=None, eval_set=_eval_set(), base_dir=tmp_path, tolerance=0.05, alpha=0.05,
              min_gain=0.0, guard=["plain"], guard_tolerance=0.25)
    with DataStore(tmp_path) as store:
        _scores(store, "0", [0.0, 0.0, 0.5, 0.5])  # the initial weights: mean 0.25, plain 0.5
        _scores(store, "1", [0.5, 0.5, 1.0, 1.0])  # mean 0.75, plain 1.0
        _scores(store, "2", [1.0, 1.0, 0.5, 0.25])  # mean 0.6875 < 0.75 - 0.05: worse overall
        _scores(store, "3", [1.0, 1.0, 0.75, 0.5])  # mean 0.8125; plain 0.625: below v1's, above the base's
        _scores(store, "4", [1.0, 1.0, 1.0, 0.5])  # mean 0.875; plain 0.75
        _scores(store, "5", [1.0, 1.0, 0.0, 0.0])  # plain 0.0 < 0.5 - 0.25
        out = {v: gate_candidate(store, tmp_path, candidate=v, **kw) for v in ("1", "2", "3", "4")}
        # with the other clauses opened wide, the guard alone decides
        low = gate_candidate(store, tmp_path, candidate="5", **{**kw, "tolerance": 1.0, "min_gain": None})
        with pytest.raises(ValueError, match=r"no prompts in group 'chat' \(its groups: plain, tools\)"):
            gate_candidate(store, tmp_path, candidate="5", **{**kw, "guard": ["chat"]})
    assert [out[v]["decision"] for v in ("1", "2", "3", "4")] == ["promote", "refuse", "promote", "promote"]
    assert out["2"]["reason"].startswith("worse by more than the tolerance 0.05")
    # v3's plain 0.625 is below v1's 1.0 but within the guard of the initial model's 0.5: promoted
    assert out["3"]["mean_diff"] == pytest.approx(0.0625)
    assert low["decision"] == "refuse"
    assert low["reason"].startswith("below the initial model on guarded group 'plain': 0.000 vs 0.500 (guard_tolerance "
                                    "0.25)")
    rows = run_query(tmp_path, "select weight_version, action from promotions order by weight_version").to_pylist()
    assert [(r["weight_version"], r["action"]) for r in rows] == [
        ("1", "promote"), ("2", "refuse"), ("3", "promote"), ("4", "promote"), ("5", "refuse")]


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
    assert make_settings({"gate.guard": ["plain"]}).gate.guard == ["plain"]


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
