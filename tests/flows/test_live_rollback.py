"""Live rollback: the judged score of live turns that the champion served drops significantly below
the previous champion's, and the judge flow serves the previous champion again through the usual
sync (no request refused), recorded with its evidence."""

from datetime import datetime, timedelta, timezone

import pytest

from clawrl.config import dump_toml
from clawrl.records import FateRecord, JudgeVerdict, TurnRecord
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.flows.test_gate_flow import _write_samples
from tests.utils.traffic import generate, steady_traffic
from tests.utils.waiting import wait_until

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def _live_turns(chash: str, version: str, scores: list[int], start: int) -> list:
    recs = []
    for k, score in enumerate(scores):
        i, at = start + k, T0 + timedelta(seconds=start + k)
        recs += [TurnRecord(turn_id=f"live{i}", session_id=f"user{i}", turn_index=0, turn_type="main", namespace="open",
                            model="m", weight_version=version, request_messages="[]", request_tools=None,
                            request_params="{}", prompt_ids=[1, 2], output_ids=[3], rollout_logprobs=[-0.5], text="ok",
                            tool_calls=None, finish_reason="stop", created_at=at, completed_at=at, latency_ms=1.0),
                 JudgeVerdict(f"live{i}", chash, "rule", score, "majority", [score], "[]"),
                 FateRecord(f"live{i}", f"user{i}", chash, "sample" if score else "score_zero", "")]
    return recs


def test_a_live_score_drop_rolls_serving_back_to_the_previous_champion(prefect_harness, make_settings, tmp_path,
                                                                        tiny_dir, monkeypatch):
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.lineage import REGISTERED_MODEL, client as mlflow_client
    from tests.utils.engine_server import CONTEXT, PROMPT, make_tiny_engine, running_engine_server

    with running_engine_server(lambda: make_tiny_engine(tiny_dir), max_context_len=CONTEXT) as srv:
        s = make_settings({"engine.url": srv.url, "ppo.rollout_batch_size": 2,
                           "ppo.advantage_estimator": "grpo", "ppo.lr": 1e-3, "prm.backend": "rule",
                           "gate.size": 2, "ppo.max_new_tokens": 4})
        monkeypatch.setattr("clawrl.flows.judge.LIVE_MIN_TURNS", 8)
        conf = tmp_path / "live.toml"
        conf.write_text(dump_toml(s))
        _write_samples(s, 4)
        steps = train_flow(config_path=str(conf), max_steps=2)["steps"]
        assert [st["gate"]["serve_version"] for st in steps] == ["1", "2"]

        def serving() -> str:
            return srv.call(srv.engine.model_info())["weight_version"]

        chash = build_judge_config_hash(s)
        with DataStore(s.storage.data_root) as store:  # version 1 pleased its users, version 2 does not
            store.append(_live_turns(chash, "1", [1] * 9 + [-1], 0) + _live_turns(chash, "2", [-1] * 8 + [1] * 2, 10))
        with steady_traffic(generate(srv.url, PROMPT)) as (served, failures):
            out = judge_flow(config_path=str(conf))
            assert serving() == "1"
            again = judge_flow(config_path=str(conf))  # version 1 against the initial weights: no live turns of 0
            wait_until(lambda: len(served) >= 2, "2 answers")
    live = out["live"]
    assert live["rollback"] and (live["champion"], live["previous"]) == ("2", "1") and live["sync"]["success"]
    assert live["mean_diff"] == pytest.approx(-0.6 - 0.8) and live["p_value"] < 0.05
    assert not again["live"]["rollback"] and again["live"]["reason"].startswith("not enough judged live turns")
    assert failures == [] and len(served) >= 2
    [row] = run_query(s.storage.data_root, "select * from promotions where action = 'rollback'").to_pylist()
    assert (row["weight_version"], row["champion_version"], row["source"], row["n"]) == ("1", "2", "live", 10)
    assert row["candidate_mean"] == pytest.approx(-0.6) and row["champion_mean"] == pytest.approx(0.8)
    assert row["reason"].startswith("live score of version 2 dropped by more than 0.1, significantly (p < 0.05)")
    alias = mlflow_client(s.storage.data_root).get_model_version_by_alias(REGISTERED_MODEL, "champion")
    assert alias.tags["weight_version"] == "1"
