"""DuckDB views over the tables, and the queries the judge flow and `clawrl status` use."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import duckdb
import pytest

from clawrl.records import (
    BatchRecord,
    CheckpointRecord,
    FateRecord,
    JudgeVerdict,
    NextStateRecord,
    SampleRecord,
)
from clawrl.storage.catalog import VIEWS, open_catalog, refresh_views, run_query
from clawrl.storage.queries import pending_counts, turns_to_judge
from clawrl.storage.schemas import TABLES
from clawrl.storage.writer import DataStore
from tests.storage.conftest import T0, _make_turn


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_every_view_exists_on_an_empty_root_with_its_columns(tmp_path, view):
    result = run_query(tmp_path / "fresh", f"SELECT * FROM {view}")
    assert result.num_rows == 0
    assert result.column_names == TABLES[VIEWS[view]].schema.names + ["date"]
    assert run_query(tmp_path / "fresh", f"SELECT count(*) AS n FROM {view}").to_pylist() == [{"n": 0}]


def test_empty_views_have_the_same_column_types_as_populated_ones(data_root, make_turn):
    def describe():
        with open_catalog(data_root) as con:
            return {view: con.sql(f"DESCRIBE {view}").fetchall() for view in VIEWS}

    empty = describe()
    with DataStore(data_root, background=False) as store:
        store.append([
            make_turn(0),
            NextStateRecord("turn-000000", "s0", 0, True, "[]", "next_request"),
            SampleRecord("x", "turn-000000", "s0", "h", "grpo", [1], [2], [-0.5], 1.0, True, [-0.25], "v0"),
            FateRecord("turn-000000", "s0", "h", "sample"),
            BatchRecord("b0", 0, ["x"], ["s0"], "grpo", "c", "v0"),
        ])
        store.append([JudgeVerdict("turn-000000", "h", "rule", 1, "majority", [1], "[]"),
                      CheckpointRecord("v1", 1, "b0", "v0", "/ckpt", "ab", None)])
        store.flush()
    populated = describe()
    for view in VIEWS:
        assert [c[:2] for c in empty[view]] == [c[:2] for c in populated[view]], view  # (name, type)


def test_a_long_lived_connection_sees_new_files_and_new_tables_after_refresh(data_root, make_turn):
    with open_catalog(data_root) as con, DataStore(data_root, background=False) as store:
        store.append(make_turn(0))
        store.flush()
        assert con.sql("SELECT count(*) FROM turns").fetchall() == [(0,)]  # no file when opened
        refresh_views(con, data_root)
        assert con.sql("SELECT count(*) FROM turns").fetchall() == [(1,)]
        store.append(make_turn(1))
        store.flush()
        assert con.sql("SELECT count(*) FROM turns").fetchall() == [(2,)]  # the glob is re-read per query


def test_run_query_of_a_statement_without_result_returns_an_empty_table(tmp_path):
    assert run_query(tmp_path, "SET threads = 1").num_rows == 0


@pytest.fixture
def judged_root(data_root, make_turn):
    """Ten turns in two sessions, in every state a turn can be in under judge config 'h1'.

    t0..t7 main, t8 t9 side. Next states: t0..t5 arrived, t6 closed without one, t7 none yet.
    Fates under h1: t0 sample, t1 sample, t2 score_zero, t8 side_turn. Under h2: t3 sample.
    Samples under h1: s0 (t0), s1 (t1), and an older s2 (t0 re-judged); batch b0 consumed s0.
    """
    turns = [make_turn(i, session=f"sess{i % 2}", turn_type="side" if i >= 8 else "main") for i in range(10)]
    records = list(turns)
    records += [NextStateRecord(f"turn-{i:06d}", f"sess{i % 2}", i, True, f'[{{"n": {i}}}]', "next_request",
                                created_at=turns[i].completed_at) for i in range(6)]
    records.append(NextStateRecord("turn-000006", "sess0", 6, False, None, "session_done"))
    # a later duplicate next state for t0 must not duplicate the ready row or change its messages
    records.append(NextStateRecord("turn-000000", "sess0", 0, True, '["late"]', "session_done",
                                   created_at=turns[9].completed_at + timedelta(hours=1)))
    records += [FateRecord("turn-000000", "sess0", "h1", "sample"), FateRecord("turn-000001", "sess1", "h1", "sample"),
                FateRecord("turn-000002", "sess0", "h1", "score_zero", "tie"),
                FateRecord("turn-000008", "sess0", "h1", "side_turn"), FateRecord("turn-000003", "sess1", "h2", "sample")]
    sample = dict(prompt_ids=[1, 2], output_ids=[3], rollout_logprobs=[-0.5], reward=1.0, has_teacher=False,
                  teacher_logprobs=None, weight_version="v0", method="grpo")
    records += [SampleRecord("s0", "turn-000000", "sess0", "h1", **sample),
                SampleRecord("s1", "turn-000001", "sess1", "h1", **sample),
                SampleRecord("s2", "turn-000000", "sess0", "h1", **sample),
                SampleRecord("s9", "turn-000003", "sess1", "h2", **sample)]
    records.append(BatchRecord("b0", 0, ["s0"], ["sess0"], "grpo", "cfg", "v0"))
    with DataStore(data_root, background=False) as store:
        store.append(records)
        store.flush()
    return data_root


def test_turns_to_judge_are_the_decidable_turns_without_a_fate_under_that_config(judged_root):
    with open_catalog(judged_root) as con:
        todo = turns_to_judge(con, "h1")
        # main t0..t6 have a next-state row (t7 still waits), side t8 t9 need none; fates under h1: t0 t1 t2 t8
        assert todo.column("turn_id").to_pylist() == [f"turn-{i:06d}" for i in (3, 4, 5, 6, 9)]
        assert todo.column("next_has_state").to_pylist() == [True, True, True, False, None]
        assert todo.column("next_messages").to_pylist() == ['[{"n": 3}]', '[{"n": 4}]', '[{"n": 5}]', None, None]
        for needed in ("prompt_ids", "output_ids", "rollout_logprobs", "request_messages", "weight_version"):
            assert needed in todo.column_names
        # under h2 only t3 has a fate; t0 appears once, with its first next state
        todo2 = turns_to_judge(con, "h2")
        assert todo2.column("turn_id").to_pylist() == [f"turn-{i:06d}" for i in (0, 1, 2, 4, 5, 6, 8, 9)]
        assert todo2.column("next_messages").to_pylist()[0] == '[{"n": 0}]'
        assert turns_to_judge(con, "h2", limit=2).num_rows == 2
        assert turns_to_judge(con, "h2", turn_ids=["turn-000004"]).column("turn_id").to_pylist() == ["turn-000004"]
        assert turns_to_judge(con, "h1", turn_ids=["turn-000000"]).num_rows == 0  # it has a fate under h1
        some = turns_to_judge(con, "h2", turn_ids=["turn-000004", "turn-000001", "nope"])
        assert some.column("turn_id").to_pylist() == ["turn-000001", "turn-000004"]  # oldest first; unknown ignored
        # the judge is called for t0 t1 t2 t4 t5 (a next state arrived); t6 (none will come), t8 t9 (side) are marked
        assert todo2.column("judge_call").to_pylist() == [True] * 5 + [False] * 3


def test_a_limit_of_judge_calls_leaves_the_turns_only_marked_uncounted(data_root, make_turn):
    """Side turns and turns told no next state comes cost no judge call: `judge_calls` = n takes the turns
    up to the n-th one the judge is called for, with every marked turn before the next call."""
    kinds = ["side", "call", "side", "side", "done", "call", "side", "call", "side"]
    turns = [make_turn(i, session=f"s{i}", turn_type="side" if k == "side" else "main") for i, k in enumerate(kinds)]
    records = list(turns)
    for i, k in enumerate(kinds):
        if k == "call":
            records.append(NextStateRecord(f"turn-{i:06d}", f"s{i}", i, True, '[{"n": 1}]', "next_request"))
        elif k == "done":
            records.append(NextStateRecord(f"turn-{i:06d}", f"s{i}", i, False, None, "session_done"))
    with DataStore(data_root, background=False) as store:
        store.append(records)
        store.flush()
    with open_catalog(data_root) as con:
        def taken(n):
            return [int(t[-2:]) for t in turns_to_judge(con, "h", judge_calls=n).column("turn_id").to_pylist()]

        assert taken(0) == [0]  # the side turn before the first call
        assert taken(1) == [0, 1, 2, 3, 4]  # call t1, then two side turns and a closed turn before the next call
        assert taken(2) == [0, 1, 2, 3, 4, 5, 6]
        assert taken(3) == taken(4) == list(range(9))  # the side turn after the last call comes with it
        assert turns_to_judge(con, "h", judge_calls=1, limit=3).num_rows == 3


def test_pending_counts_explain_where_every_turn_is(judged_root):
    with open_catalog(judged_root) as con:
        counts = pending_counts(con, "h1", rollout_batch_size=4)
    assert counts["turns"] == 10 and counts["main_turns"] == 8 and counts["side_turns"] == 2
    assert counts["awaiting_next_state"] == 1  # t7
    assert counts["pending_judgment"] == 3  # t3 t4 t5
    assert counts["pending_no_next_state"] == 1  # t6
    assert counts["judged"] == 4  # t0 t1 t2 t8
    assert counts["side_unmarked"] == 1  # t9
    assert counts["turns"] == sum(counts[k] for k in ("judged", "awaiting_next_state", "pending_judgment",
                                                      "pending_no_next_state", "side_unmarked"))
    assert counts["fates"] == {"sample": 2, "side_turn": 1, "no_next_state": 0, "score_zero": 1,
                               "no_hint": 0, "judge_error": 0, "too_stale": 0}
    assert counts["excluded"] == 2  # side_turn + score_zero
    assert counts["samples"] == 3 and counts["consumed"] == 1  # s0 s1 s2 under h1; b0 took s0
    assert counts["trainable"] == 2 and counts["batches"] == 1
    assert counts["full_batches"] == 0  # 2 // 4
    assert counts["samples_needed"] == 2  # 4 - 2


def test_pending_counts_on_an_empty_root_are_zero(tmp_path):
    with open_catalog(tmp_path) as con:
        counts = pending_counts(con, "h1", rollout_batch_size=32)
    assert counts["turns"] == 0 and counts["trainable"] == 0 and counts["samples_needed"] == 32
    assert sum(counts["fates"].values()) == 0


def test_catalog_connections_draw_no_progress_bar(tmp_path):
    # DuckDB draws one on stdout for queries over ~2 s; it would corrupt `clawrl sql -f csv` output.
    for read_only in (False, True):
        with open_catalog(tmp_path, read_only=read_only) as con:
            assert con.sql("SELECT current_setting('enable_progress_bar')").fetchall() == [(False,)]


def test_a_catalog_connection_is_closed_when_its_block_ends(tmp_path):
    with open_catalog(tmp_path) as con:
        assert con.sql("SELECT count(*) FROM turns").fetchall() == [(0,)]
    with pytest.raises(duckdb.ConnectionException):
        con.sql("SELECT 1")


def _turns_completed_in(root, order: list[int]):
    """Six turns of three sessions (two each, turn index 0 and 1) whose completion times follow ``order``,
    each with a sample; the tools demo's users complete theirs in whatever order the engine finishes."""
    from clawrl.storage.queries import trainable_samples

    recs = []
    for rank, i in enumerate(order):
        turn = replace(_make_turn(i, session=f"u{i // 2}", created_at=T0 + timedelta(seconds=rank)), turn_index=i % 2,
                       turn_id=f"{root.name}-{i}")  # turn ids are random per run: never part of the order
        recs += [turn, SampleRecord(f"{root.name}-s{i}", turn.turn_id, turn.session_id, "h", prompt_ids=[1],
                                    output_ids=[i], rollout_logprobs=[-0.5], reward=1.0, has_teacher=False,
                                    teacher_logprobs=None, weight_version="1" if i < 4 else "0", method="grpo")]
    with DataStore(root, background=False) as store:
        store.append(recs)
    with open_catalog(root) as con:
        rows = trainable_samples(con, "h").to_pylist()
    return [int(r["turn_id"].rsplit("-", 1)[1]) for r in rows], {int(r["turn_id"].rsplit("-", 1)[1]): r["take_order"]
                                                                  for r in rows}


def test_take_order_depends_on_the_turns_not_on_when_they_completed(tmp_path):
    by_time_a, take_a = _turns_completed_in(tmp_path / "a", [0, 1, 2, 3, 4, 5])
    by_time_b, take_b = _turns_completed_in(tmp_path / "b", [5, 2, 0, 4, 3, 1])
    assert by_time_a == [0, 1, 2, 3, 4, 5] and by_time_b == [5, 2, 0, 4, 3, 1]  # rows stay oldest first
    assert take_a == take_b  # the same turns: the same order to take them in
    # version 0 (turns 4, 5) before version 1, whatever their time
    assert sorted(take_a, key=take_a.get)[:2] in ([4, 5], [5, 4])
