"""Forgetting a namespace in the tables (storage/forget.py), on real Parquet: every row of the namespace goes -
by its name, by one of its turns, by a sample of it - in every table and in the replays under the data root;
other rows that list its ids keep their other entries; every other row comes back with the same values; the
record that it was forgotten stays; a file left with no row is removed, none is left half written."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

from clawrl.records import (AdapterRecord, AdapterServeRecord, BatchRecord, EvaluationRecord, FateRecord, JudgeVerdict,
                            NextStateRecord, PromotionRecord, SampleRecord, TurnRecord, make_turn_id)
from clawrl.storage.catalog import run_query
from clawrl.storage.forget import forget_rows
from clawrl.storage.writer import DataStore
from tests.utils.turns import T0, build_turn

A, B = "key-aaaaaaaaaaaaaaaa", "key-bbbbbbbbbbbbbbbb"
A_SESSION, B_SESSION = "alpha-session-5d1e", "beta-session-77c0"


def _turn(namespace: str, session: str, i: int) -> TurnRecord:
    t = build_turn([{"role": "user", "content": f"question {i} of {session}"}], session_id=session, turn_index=i)
    return dataclasses.replace(t, namespace=namespace, turn_id=make_turn_id(namespace, session, i),
                               created_at=T0 + timedelta(seconds=i))


def _rows_of(turn: TurnRecord, namespace: str | None) -> list:
    """What the judge writes for a turn: its next state, verdict, sample (``namespace`` on it or not) and fate."""
    return [NextStateRecord(turn.turn_id, turn.session_id, turn.turn_index, True, '[{"role": "user"}]', "next_request"),
            JudgeVerdict(turn.turn_id, "h", "rule", 1, "rule:thanks", [1], "[]"),
            SampleRecord(sample_id=f"smp-{turn.turn_id}", turn_id=turn.turn_id, session_id=turn.session_id,
                         judge_config_hash="h", method="grpo", prompt_ids=[1, 2], output_ids=[3], rollout_logprobs=[-1.0],
                         reward=1.0, has_teacher=False, teacher_logprobs=None, weight_version="0", namespace=namespace),
            FateRecord(turn.turn_id, turn.session_id, "h", "sample")]


def _promotion(pid: str, namespace: str | None, turn_ids: list[str] | None = None) -> PromotionRecord:
    return PromotionRecord(promotion_id=pid, action="promote", weight_version=f"{namespace}@v1" if namespace else "1",
                           champion_version="0", source="gate", reason="not worse", eval_key="k", n=2,
                           candidate_mean=1.0, champion_mean=1.0, mean_diff=0.0, ci_low=0.0, ci_high=0.0, p_value=1.0,
                           tolerance=0.05, alpha=0.05, mlflow_run_id=None, eval_set="replay", eval_turn_ids=turn_ids,
                           namespace=namespace)


def test_forgetting_removes_every_row_of_the_namespace_and_keeps_the_others_value_for_value(tmp_path):
    root = tmp_path / "data"
    a = [_turn(A, A_SESSION, i) for i in range(2)]
    b = [_turn(B, B_SESSION, i) for i in range(2)]
    with DataStore(root) as store:
        store.append(a + b)
        store.flush()  # A's and B's turns in one file: rewritten, not removed
        store.append(_rows_of(a[0], A) + _rows_of(a[1], None) + _rows_of(b[0], B))
        store.append([
            BatchRecord("ba", 1, [f"smp-{a[0].turn_id}"], [A_SESSION], "grpo", "c", f"{A}@v0", [A], namespace=A),
            BatchRecord("shared", 1, [f"smp-{a[1].turn_id}", f"smp-{b[0].turn_id}"], [A_SESSION, B_SESSION], "grpo",
                        "c", "0", [A, B]),
            EvaluationRecord("e1", f"{A}@v1", "k", [1.0], 1.0, 1, 2, 0.1, namespace=A),
            EvaluationRecord("e2", f"{B}@v1", "k", [1.0], 1.0, 1, 2, 0.1, namespace=B),
            _promotion("pa", A), _promotion("pb", B), _promotion("shared", None, [a[1].turn_id, b[0].turn_id]),
            AdapterRecord(A, 1, f"{A}@v1", "ba", f"{A}@v0", "0", "/x", "sha"),
            AdapterServeRecord(A, "sync", f"{A}@v1", None, True, None, "in-process", 0.1),
            AdapterServeRecord(A, "forget", None, f"{A}@v1", True, None, None, 0.0, "asked", last_version=1)])
    rejected = root / "tables" / "turns" / "_rejected" / "seg.jsonl"
    rejected.parent.mkdir()
    rejected.write_text(json.dumps({"error": "x", "line": json.dumps({"namespace": A, "session_id": A_SESSION},
                                                                    separators=(",", ":"))}) + "\n"
                        + json.dumps({"error": "x", "line": '{"namespace":"' + B + '"}'}) + "\n")
    replay = root / "replays" / "r1"  # a replay of A's adapter: all of it is A's
    replay.mkdir(parents=True)
    (replay / "replay.json").write_text(json.dumps({"namespace": A, "excluded_sessions": [[A, A_SESSION]]}))
    other = root / "replays" / "r2"  # a replay of the shared policy whose tables hold one of A's turns
    with DataStore(other) as store:
        store.append([a[0], b[1]])

    def b_view() -> dict:
        return {t: sorted(map(repr, run_query(root, f"SELECT * EXCLUDE (date) FROM {t} WHERE turn_id IN "
                                              f"(SELECT turn_id FROM turns WHERE namespace = '{B}')").to_pylist()))
                for t in ("turns", "next_states", "verdicts", "samples", "turn_fate")}

    before = b_view()
    removed = forget_rows(root, A)
    # turns: its 2, its rejected line and its turn in the replay of the shared policy; 2 of each judge table (one
    # sample named A, one only through its turn); A's adapter batch, evaluation, promotion, adapter and sync; the
    # shared rows lose A's entries (rewritten, not counted)
    assert removed == {"turns": 4, "next_states": 2, "verdicts": 2, "samples": 2, "turn_fate": 2, "batches": 1,
                       "evaluations": 1, "promotions": 1, "adapters": 1, "adapter_serving": 1, "replays": 1,
                       "wal_segments_left": 0}
    for path in root.rglob("*"):
        assert not (path.is_file() and A_SESSION.encode() in path.read_bytes()), path
    assert not replay.exists() and run_query(other, "SELECT session_id FROM turns").to_pylist() == [
        {"session_id": B_SESSION}]
    assert b_view() == before
    batches = run_query(root, "SELECT batch_id, sample_ids, session_ids, session_namespaces FROM batches").to_pylist()
    assert batches == [{"batch_id": "shared", "sample_ids": [f"smp-{b[0].turn_id}"], "session_ids": [B_SESSION],
                        "session_namespaces": [B]}]
    promotions = run_query(root, "SELECT promotion_id, eval_turn_ids FROM promotions ORDER BY 1").to_pylist()
    assert promotions == [{"promotion_id": "pb", "eval_turn_ids": None},
                          {"promotion_id": "shared", "eval_turn_ids": [b[0].turn_id]}]
    assert run_query(root, "SELECT namespace, action, last_version FROM adapter_serving").to_pylist() == [
        {"namespace": A, "action": "forget", "last_version": 1}]
    assert [json.loads(x)["line"] for x in rejected.read_text().splitlines()] == ['{"namespace":"' + B + '"}']
    assert not list(Path(root, "tables").rglob("*.tmp"))  # nothing half written left behind
    assert not list(Path(root, "tables", "adapters").glob("date=*/*.parquet"))  # its only file was A's: removed
