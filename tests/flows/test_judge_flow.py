"""The judge flow end to end: a scripted session through the gateway (real openai SDK) -> Prefect
flow -> verdicts, samples and fates in storage, queryable with DuckDB and `clawrl status`."""

import json
import re

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from clawrl.config import dump_toml
from clawrl.gateway.routes import create_app
from clawrl.judge.runner import build_judge_config_hash
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.samples import two_turn_session


@pytest.fixture
def judged(prefect_harness, make_settings, tiny_engine, tmp_path):
    def run(method="combine", **kw):
        s = make_settings({"server.open_mode": True, "ppo.advantage_estimator": method, "ppo.temperature": 1.0,
                           "ppo.rollout_batch_size": 2, "prm.backend": "rule", **kw})
        conf = tmp_path / f"{method}.toml"
        conf.write_text(dump_toml(s))
        store = DataStore(s.storage.data_root)
        app = create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)
        with running_gateway(app) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="x")
            two_turn_session(client, "corrected", "What is the capital of France?", "no, that's wrong, answer in one word")
            two_turn_session(client, "thanked", "Name a primary color.", "thanks, that's great!")
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}], max_tokens=2,
                                           extra_body={"session_id": "hb", "turn_type": "side"})
        store.close()
        from clawrl.flows.judge import judge_flow

        out = judge_flow(config_path=str(conf))
        return s, conf, out

    return run


def q(s, sql):
    return run_query(s.storage.data_root, sql).to_pylist()


def test_rule_judge_flow_scores_correction_and_thanks(judged, tiny_engine):
    s, conf, out = judged("combine")
    chash = build_judge_config_hash(s)
    assert out["judge_config_hash"] == chash
    # 2 first turns with a next state, 2 final turns closed by session_done, 1 side turn
    assert out["judged"] == 5
    assert out["fates"] == {"sample": 2, "no_next_state": 2, "side_turn": 1}
    verdicts = {r["session_id"]: r for r in q(s, "select j.*, t.session_id from verdicts j join turns t using (turn_id)")}
    assert verdicts["corrected"]["score"] == -1 and verdicts["thanked"]["score"] == 1
    assert verdicts["corrected"]["hint"] == "answer in one word" and verdicts["thanked"]["hint"] is None
    assert all(len(json.loads(v["raw_outputs"])) == s.prm.judge_samples for v in verdicts.values())
    samples = {r["session_id"]: r for r in q(s, "select * from samples")}
    corrected, thanked = samples["corrected"], samples["thanked"]
    assert corrected["reward"] == -1.0 and corrected["has_teacher"]
    assert len(corrected["teacher_logprobs"]) == len(corrected["output_ids"]) == len(corrected["rollout_logprobs"])
    assert thanked["reward"] == 1.0 and not thanked["has_teacher"] and thanked["teacher_logprobs"] is None
    fates = q(s, "select fate, count(*) as n from turn_fate group by fate order by fate")
    assert fates == [{"fate": "no_next_state", "n": 2}, {"fate": "sample", "n": 2}, {"fate": "side_turn", "n": 1}]
    assert out["status"]["trainable"] == 2 and out["status"]["full_batches"] == 1


def _judge_runs() -> dict[str, str]:
    """{flow run id: name} of the session's Prefect server's runs of the judge flow."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as pc:
        runs = pc.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["judge"])))
    return {str(r.id): r.name for r in runs}


def test_rerun_is_exactly_once_and_status_reports(judged):
    before = _judge_runs()  # other tests' runs in the session's server (some name theirs themselves)
    s, conf, out = judged("grpo")
    from clawrl.flows.judge import judge_flow

    again = judge_flow(config_path=str(conf))
    assert again["judged"] == 0
    names = [name for run_id, name in _judge_runs().items() if run_id not in before]
    # named for what they do, not "sandy-oyster"; the rerun found nothing: named idle, not like a judging run
    assert sorted(re.sub(r"\d{8}-\d{6}", "T", n) for n in names) == ["judge-T", "judge-idle-T"], names
    assert q(s, "select count(*) as n from turn_fate")[0]["n"] == 5
    assert q(s, "select count(distinct sample_id) as n, count(*) as rows from samples")[0] == {"n": 2, "rows": 2}
    from clawrl.cli import app

    res = CliRunner().invoke(app, ["status", "--config", str(conf)])
    assert res.exit_code == 0, res.output
    assert "trainable samples waiting" in res.output and "2 / rollout_batch_size 2" in res.output
    assert "excluded: no_next_state" in res.output and "excluded: side_turn" in res.output


def test_opd_teacher_logprobs_align_with_the_rollout(judged):
    """Teacher = frozen initial model = the policy here (no update yet): with the hint the teacher
    prompt differs, but the teacher scores exactly len(output_ids) tokens."""
    s, conf, out = judged("on_policy_distillation")
    assert out["fates"] == {"sample": 1, "no_hint": 1, "no_next_state": 2, "side_turn": 1}
    [sample] = q(s, "select * from samples")
    assert sample["reward"] == 0.0 and sample["has_teacher"]
    assert len(sample["teacher_logprobs"]) == len(sample["output_ids"])
    assert all(lp <= 0 for lp in sample["teacher_logprobs"])


class _Flaky:
    """The configured judge, except that the first turn of the session ``bad`` raises on its first ``times``
    attempts (stands in for a judge backend erroring: the rule judge never fails)."""

    def __init__(self, judge, times: int):
        self.judge_impl, self.times, self.calls = judge, times, {}

    def __getattr__(self, name):
        return getattr(self.judge_impl, name)

    async def judge(self, turn, next_state):
        self.calls[turn.turn_id] = self.calls.get(turn.turn_id, 0) + 1
        if (turn.session_id, turn.turn_index) == ("bad", 0) and self.calls[turn.turn_id] <= self.times:
            raise ConnectionError(f"judge backend down for {turn.turn_id}")
        return await self.judge_impl.judge(turn, next_state)


@pytest.mark.parametrize("times, fate", [(1, "sample"), (9, "judge_error")])
def test_a_failing_turn_is_retried_alone_and_ends_judge_error_when_it_keeps_failing(
        prefect_harness, make_settings, tiny_engine, tmp_path, monkeypatch, times, fate):
    import flows.judge as fj

    monkeypatch.setattr(fj, "RETRY_DELAY_S", 0.01)  # retried twice (RETRIES), quickly
    monkeypatch.setattr(fj, "MAX_IN_FLIGHT", 2)
    s = make_settings({"server.open_mode": True, "prm.backend": "rule", "ppo.rollout_batch_size": 2})
    conf = tmp_path / "flaky.toml"
    conf.write_text(dump_toml(s))
    store = DataStore(s.storage.data_root)
    with running_gateway(create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        for sid in ("a", "b", "bad", "c"):
            two_turn_session(client, sid, "Name a primary color.", "thanks, that's great!")
    store.close()
    flaky = {}
    real_judge_for = fj.judge_for
    monkeypatch.setattr(fj, "judge_for", lambda s: flaky.setdefault("j", _Flaky(real_judge_for(s), times)))

    out = fj.judge_flow(config_path=str(conf))
    # 8 turns in one chunk of 4 x max_in_flight; only the failing turn is judged again on each retry
    assert out["judged"] == 8
    calls = flaky["j"].calls
    [bad_first] = [r["turn_id"] for r in q(s, "select turn_id from turns where session_id = 'bad' and turn_index = 0")]
    assert calls[bad_first] == (2 if fate == "sample" else 3)  # 1 + retries at most
    assert all(n == 1 for t, n in calls.items() if t != bad_first)
    assert out["fates"] == ({"sample": 4, "no_next_state": 4} if fate == "sample"
                            else {"sample": 3, "no_next_state": 4, "judge_error": 1})
    rows = q(s, f"select fate, detail from turn_fate where turn_id = '{bad_first}'")
    assert [r["fate"] for r in rows] == [fate]
    if fate == "judge_error":
        assert "ConnectionError: judge backend down" in rows[0]["detail"]
    assert q(s, "select count(*) as n from turn_fate")[0]["n"] == 8  # one fate each, none twice


def _demo_round(store: DataStore, round_no: int, users: int, evaluations: int) -> None:
    """What a round of `clawrl demo` leaves for the judge, in the order it is made: the previous step's
    held-out evaluation (``evaluations`` side turns), then ``users`` sessions of a question with the user's
    reply as its next state and that reply's turn, closed (session_done)."""
    from dataclasses import replace
    from datetime import timedelta

    from tests.utils.turns import T0, build_next_state, build_turn

    at = iter(T0 + timedelta(hours=round_no, seconds=i) for i in range(evaluations + 2 * users))
    ask = [{"role": "user", "content": "What is gravity?"}]
    records = [replace(build_turn(ask, session_id=f"eval{round_no}-e{i:02d}", turn_type="side"), created_at=next(at))
               for i in range(evaluations)]
    for u in range(users):
        sid = f"train{round_no}-u{u:02d}"
        first = replace(build_turn(ask, session_id=sid), created_at=next(at))
        reply = [{"role": "assistant", "content": first.text}, {"role": "user", "content": "thanks, that's great!"}]
        last = replace(build_turn(ask + reply, session_id=sid, turn_index=1), created_at=next(at))
        records += [first, build_next_state(first, reply[1:]), last, build_next_state(last, None)]
    store.append(records)


def test_a_direct_run_judges_every_ready_turn_and_an_exclusive_run_a_bite(prefect_harness, make_settings, tmp_path):
    """A run of `clawrl up` takes a backlog in bites of judge calls (BITE_BATCHES x 16 = 64 = MIN_BITE here) and
    starts training; the turns only marked (side turns, closing replies without a next state) come along
    uncounted. A round of 80 users after 48 held-out answers leaves 80 calls: a bite takes 64 of them, the 48 side
    turns before them and the 64 closing replies among them, and says more wait. A direct run (`clawrl judge`,
    the demo's loop, which trains right after) judges them all: with a bite, each round would leave turns to the
    next, which then judged the last round's leftovers and evaluation instead of its own users' answers."""
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.slots import JUDGE_DEPLOYMENT, TRAIN_DEPLOYMENT
    from tests.utils.prefect_runs import clear_runs

    s = make_settings({"prm.backend": "rule", "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 16})
    conf = tmp_path / "rule.toml"
    conf.write_text(dump_toml(s))
    with DataStore(s.storage.data_root) as store:
        _demo_round(store, 1, users=80, evaluations=48)
    bite = judge_flow(config_path=str(conf), exclusive=True)
    clear_runs(JUDGE_DEPLOYMENT, TRAIN_DEPLOYMENT)  # what it started, if another test registered `up`'s deployments
    # oldest first: the 48 side turns, then the first 64 users' answer (a call) and closing reply each
    assert bite["judged"] == 48 + 2 * 64 and bite["full_bite"]
    assert bite["fates"] == {"side_turn": 48, "sample": 64, "no_next_state": 64}
    with DataStore(s.storage.data_root) as store:
        _demo_round(store, 2, users=16, evaluations=48)
    out = judge_flow(config_path=str(conf))
    # the 16 users the bite left and the whole second round: 32 + 80
    assert out["judged"] == 112 and not out["full_bite"]
    assert out["fates"] == {"side_turn": 48, "sample": 32, "no_next_state": 32}
    assert out["status"]["trainable"] == 96 and out["status"]["awaiting_next_state"] == 0
    fates = q(s, "select t.session_id, t.turn_index, f.fate from turns t join turn_fate f using (turn_id) "
                 "where t.turn_type = 'main'")
    assert len(fates) == 2 * 96
    assert all(r["fate"] == ("sample" if r["turn_index"] == 0 else "no_next_state") for r in fates)
