"""The promotion gate's replay evaluation set (``[gate] eval_set = "replay"``): which stored turns it
picks, how the judge rates an answer with no next state, what the configuration refuses, and the
refusal when too few turns were judged."""

import asyncio
import json
from datetime import timedelta

import pytest

from clawrl.config import ConfigError
from clawrl.records import FateRecord, JudgeVerdict
from clawrl.storage.catalog import open_catalog
from clawrl.storage.writer import DataStore
from tests.utils.turns import T0, build_turn

HASH = "h" * 16


def _judged(store, turn, *, at, chash=HASH, error=None):
    fate = "judge_error" if error else "sample"
    store.append([JudgeVerdict(turn.turn_id, chash, "engine", 1, "majority", [1], "[]", error=error, created_at=at),
                  FateRecord(turn.turn_id, turn.session_id, chash, fate, created_at=at)])


def _turn(session, index, minutes, **kw):
    t = build_turn([{"role": "user", "content": f"{session} question {index}"}], session_id=session,
                   turn_index=index, **kw)
    t.created_at = t.completed_at = T0 + timedelta(minutes=minutes)
    return t


def _stored_set(root):
    """Sessions a (3 turns), b (2), c (1), d (1), e (1) and which of their turns count; returns the turns."""
    t = {name: _turn(name[0], int(name[1]), minutes) for name, minutes in
         (("a0", 1), ("a1", 5), ("a2", 9), ("b0", 2), ("b1", 8), ("c0", 7), ("d0", 6), ("e0", 3), ("e1", 4))}
    t["x0"] = _turn("x", 0, 10, turn_type="side")  # a side turn, judged: never a prompt
    with DataStore(root) as store:
        store.append(list(t.values()))
        for name in ("a0", "a1", "a2", "b0", "b1", "c0", "x0", "e1"):
            _judged(store, t[name], at=T0 + timedelta(hours=1))
        _judged(store, t["d0"], at=T0 + timedelta(hours=3))  # judged after the cut-off used below
        _judged(store, t["e0"], at=T0 + timedelta(hours=1), chash="other" * 3 + "o")  # another judge config
        _judged(store, t["e1"], at=T0 + timedelta(hours=2), error="judge: all 3 votes failed")  # the newest: an error
    return t


def test_the_replay_set_is_the_newest_judged_main_turns_distinct_sessions_first(tmp_path):
    from clawrl.storage.promotions import replay_turns

    t = _stored_set(tmp_path)
    ids = {v.turn_id: k for k, v in t.items()}
    with open_catalog(tmp_path) as con:
        every = [ids[r["turn_id"]] for r in replay_turns(con, HASH, 10)]
        cut = [ids[r["turn_id"]] for r in replay_turns(con, HASH, 10, T0 + timedelta(hours=2))]
        four = replay_turns(con, HASH, 4, T0 + timedelta(hours=2))
        again = replay_turns(con, HASH, 4, T0 + timedelta(hours=2))
    # each session's newest judged main turn, newest first (a2 9', b1 8', c0 7', d0 6'), then second-newest ones
    assert every == ["a2", "b1", "c0", "d0", "a1", "b0", "a0"]
    assert cut == ["a2", "b1", "c0", "a1", "b0", "a0"]  # d0 was judged after the cut-off
    assert [ids[r["turn_id"]] for r in four] == ["a2", "b1", "c0", "a1"] and four == again
    assert json.loads(four[0]["request_messages"]) == [{"role": "user", "content": "a question 2"}]
    assert four[0]["session_id"] == "a" and four[0]["request_tools"] is None


def test_a_namespaces_replay_set_is_its_own_turns(tmp_path):
    import dataclasses

    from clawrl.records import make_turn_id
    from clawrl.storage.promotions import replay_turns

    turns = [dataclasses.replace(_turn(f"{ns}-s", i, minutes=i), namespace=ns, turn_id=make_turn_id(ns, f"{ns}-s", i))
             for ns in ("key-a", "key-b") for i in range(3)]
    with DataStore(tmp_path) as store:
        store.append(turns)
        for turn in turns:
            _judged(store, turn, at=T0 + timedelta(hours=1))
    with open_catalog(tmp_path) as con:
        mine = replay_turns(con, HASH, 10, namespace="key-a")
        every = replay_turns(con, HASH, 10)
    assert [r["turn_id"] for r in mine] == [make_turn_id("key-a", "key-a-s", i) for i in (2, 1, 0)]
    assert len(every) == 6


class ScriptedJudge:
    """A judge backend whose votes are scripted; it keeps the prompts it was asked."""

    def __init__(self, votes):
        self.votes, self.prompts = votes, []

    async def complete(self, messages, *, n, temperature, max_tokens):
        self.prompts.append(messages)
        return list(self.votes)[:n]


def test_the_judge_rates_an_answer_from_the_conversation_alone():
    from clawrl.judge.backends import JudgeBackendError
    from clawrl.judge.prompts import NEXT_STATE_HEADER, RATING_SYSTEM
    from clawrl.judge.rating import rate_answer

    msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}]

    def rate(votes):
        judge = ScriptedJudge(votes)
        score = asyncio.run(rate_answer(judge, msgs, "Paris \\boxed{1}", n=len(votes), temperature=0.0,
                                        max_tokens=64, budget_chars=4000))
        return score, judge.prompts

    score, [prompt] = rate(["fine \\boxed{1}", "wrong \\boxed{-1}", "good \\boxed{1}"])
    assert score == 1.0  # majority +1 -> 1
    assert prompt[0]["content"] == RATING_SYSTEM and NEXT_STATE_HEADER not in prompt[1]["content"]
    body = prompt[1]["content"]
    assert "Answer in one word." in body and "Capital of France?" in body
    assert "Paris boxed{1}" in body  # the answer's own box is defused, never read as the judge's
    assert rate(["\\boxed{-1}"] * 3)[0] == 0.0
    assert rate(["\\boxed{1}", "\\boxed{-1}", "no box"])[0] == 0.5  # a tie scores 0
    assert rate(["nothing", "parses"])[0] == 0.5
    with pytest.raises(JudgeBackendError, match="all 2 votes failed: RuntimeError: down"):
        rate([RuntimeError("down"), RuntimeError("down")])


def test_replay_with_the_rule_judge_is_a_config_error(make_settings):
    with pytest.raises(ConfigError) as e:
        make_settings({"gate.eval_set": "replay"})  # prm.backend defaults to the rule judge
    msg = str(e.value)
    assert "[gate] eval_set = 'replay' with [prm] backend = 'rule'" in msg
    assert "set [prm] backend to a model judge (engine or provider)" in msg
    assert "[gate] evaluator to an import path of fn(messages, answer) -> score in [0, 1]" in msg
    assert make_settings({"gate.eval_set": "replay", "prm.backend": "engine"}).gate.eval_set == "replay"
    ok = make_settings({"gate.eval_set": "replay", "gate.evaluator": "tests.utils.gate_eval:rate"})
    assert ok.gate.evaluator == "tests.utils.gate_eval:rate"
    assert make_settings().gate.eval_set == "validation"


def test_too_few_judged_turns_refuse_for_want_of_evidence(tmp_path):
    from clawrl.evaluation import replay_eval_set
    from clawrl.promotion import gate_candidate
    from clawrl.storage.catalog import run_query
    from clawrl.storage.promotions import replay_turns

    t = _turn("a", 0, 1)
    with DataStore(tmp_path) as store:
        store.append(t)
        _judged(store, t, at=T0)
        store.flush()
        with open_catalog(tmp_path) as con:
            turns = replay_turns(con, HASH, 16)
        eval_set = replay_eval_set(turns, lambda m, a: 1.0, scorer="test", samples=1, seed=0, max_tokens=4,
                                   temperature=0.0)
        assert eval_set.prompts == [] and eval_set.turn_ids == (t.turn_id,)
        out = gate_candidate(store, tmp_path, candidate="1", engine=None, adapter=None, eval_set=eval_set,
                             base_dir=tmp_path, tolerance=0.05, alpha=0.05)
    assert out["decision"] == "refuse" and out["n"] == 0 and out["serve_version"] == "0"
    assert out["reason"] == ("no evaluation prompts: nothing shows the candidate is not worse (eval_set 'replay' "
                             "found 1 judged main turn(s) under this judge configuration before the candidate's "
                             "batch; it needs 2)")
    [row] = run_query(tmp_path, "select action, eval_set, eval_turn_ids, n, candidate_mean from promotions").to_pylist()
    assert row == {"action": "refuse", "eval_set": "replay", "eval_turn_ids": [t.turn_id], "n": 0,
                   "candidate_mean": None}
