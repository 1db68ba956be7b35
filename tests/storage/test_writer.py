"""The append path: WAL -> Parquet, exact round trips, partitioning, crash recovery, group commit."""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import orjson
import pyarrow.parquet as pq
import pytest

from clawrl.records import FateRecord, JudgeVerdict, NextStateRecord
from clawrl.storage import convert, wal
from clawrl.storage.catalog import run_query
from clawrl.storage.schemas import TABLES
from clawrl.storage.wal import TableLog
from clawrl.storage.writer import DataStore
from tests.utils.waiting import wait_until

TURNS = TABLES["turns"].schema


@pytest.fixture(params=["pyarrow", "duckdb"])
def parser(request, monkeypatch):
    """Run a test through both conversion parsers (small segments: pyarrow; large: DuckDB).

    `parser.fallbacks` lists segments that needed the line-by-line path, which would otherwise
    hide a broken fast path behind correct results.
    """
    monkeypatch.setattr(convert, "DUCKDB_MIN_BYTES", 0 if request.param == "duckdb" else 1 << 40)
    fallbacks = []
    real = convert._parse_lines

    def parse_lines(body, schema):
        fallbacks.append(body.count(b"\n"))
        return real(body, schema)

    monkeypatch.setattr(convert, "_parse_lines", parse_lines)
    return SimpleNamespace(name=request.param, fallbacks=fallbacks)


def parquet_files(root, table="turns"):
    return sorted((root / "tables" / table).glob("date=*/*.parquet"))


def wal_segments(root, table="turns"):
    return sorted((root / "tables" / table / "_wal").glob("*.wal"))


def test_append_flush_round_trips_ids_and_logprobs_exactly(data_root, make_turn, parser):
    turns = [make_turn(i, n_prompt=200, n_output=64) for i in range(50)]
    with DataStore(data_root, background=False) as store:
        assert store.append(turns) == 50
        assert store.flush() == 50
    got = run_query(data_root, "SELECT * FROM turns ORDER BY turn_id").to_pylist()
    assert len(got) == 50
    for turn, row in zip(turns, got):
        assert row["turn_id"] == turn.turn_id
        assert row["prompt_ids"] == turn.prompt_ids
        assert row["output_ids"] == turn.output_ids
        assert row["rollout_logprobs"] == turn.rollout_logprobs  # exact, not within a tolerance
        assert row["created_at"] == turn.created_at
        assert row["request_messages"] == turn.request_messages
        assert row["request_tools"] is None
    (part,) = parquet_files(data_root)
    assert pq.read_schema(part).remove_metadata() == TURNS
    assert parser.fallbacks == []


def test_every_record_type_lands_in_its_table(data_root, make_turn, parser):
    with DataStore(data_root, background=False) as store:
        store.append([
            make_turn(0),
            NextStateRecord("turn-000000", "s0", 0, True, "[]", "next_request"),
            JudgeVerdict("turn-000000", "h1", "rule", 1, "majority", [1, None, 1], "[]"),
            FateRecord("turn-000000", "s0", "h1", "sample"),
            FateRecord("turn-000001", "s0", "h1", "score_zero", "tie"),
        ])
        store.flush()
    counts = run_query(data_root, """
        SELECT (SELECT count(*) FROM turns), (SELECT count(*) FROM next_states),
               (SELECT count(*) FROM verdicts), (SELECT count(*) FROM turn_fate)""").to_pylist()[0]
    assert list(counts.values()) == [1, 1, 1, 2]
    votes = run_query(data_root, "SELECT votes FROM verdicts").column("votes").to_pylist()
    assert votes == [[1, None, 1]]
    assert parser.fallbacks == []


def test_a_samples_topk_rows_round_trip_exactly(data_root, parser):
    from clawrl.records import SampleRecord

    rows = dict(topk_ids=[[5, 7], [9, 2]], student_topk_logprobs=[[-0.1, -2.5], [-1 / 3, -20.000001]],
                teacher_topk_logprobs=[[-0.7, -1e-9], [-3.25, -0.2]])
    samples = [SampleRecord("a", "t", "s", "h", "combine", [1, 2], [5, 9], [-0.5, -0.25], 1.0, True, [-0.7, -3.25],
                            "0", **rows),
               SampleRecord("b", "t", "s", "h2", "grpo", [1, 2], [5, 9], [-0.5, -0.25], 1.0, False, None, "0")]
    with DataStore(data_root, background=False) as store:
        store.append(samples)
        store.flush()
    got = run_query(data_root, "SELECT * FROM samples ORDER BY sample_id").to_pylist()
    assert {k: got[0][k] for k in rows} == rows  # exact
    assert all(got[1][k] is None for k in rows)
    assert parser.fallbacks == []


def test_rows_are_partitioned_by_the_utc_date_of_created_at(data_root, make_turn, parser):
    times = [
        datetime(2026, 11, 29, 23, 59, 59, tzinfo=timezone.utc),
        datetime(2026, 11, 30, 1, 0, tzinfo=timezone(timedelta(hours=2))),  # 23:00 UTC on the 29th
        datetime(2026, 11, 30, 0, 0, 1, tzinfo=timezone.utc),
    ]
    with DataStore(data_root, background=False) as store:
        store.append([make_turn(i, created_at=t) for i, t in enumerate(times)])
        store.flush()
    files = parquet_files(data_root)
    assert [f.parent.name for f in files] == ["date=2026-11-29", "date=2026-11-30"]
    assert files[0].name == files[1].name  # both named after the one segment they came from
    by_date = run_query(data_root, "SELECT CAST(date AS VARCHAR) d, count(*) n FROM turns GROUP BY d ORDER BY d")
    assert by_date.to_pylist() == [{"d": "2026-11-29", "n": 2}, {"d": "2026-11-30", "n": 1}]
    assert parser.fallbacks == []


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("rollout_logprobs", [-0.1, math.nan], ValueError),
        ("rollout_logprobs", [-0.1, -math.inf], ValueError),
        ("prompt_ids", [1, "2"], ValueError),
        ("prompt_ids", [1, None], ValueError),
        ("output_ids", [1, 2.5], ValueError),
        ("created_at", datetime(2026, 11, 29, 12, 0), ValueError),  # naive: which zone?
        ("session_id", None, ValueError),
        ("turn_index", True, ValueError),
        ("latency_ms", math.inf, ValueError),
    ],
)
def test_append_rejects_a_bad_value_before_writing_anything(data_root, make_turn, field, value, error):
    turn = make_turn(1)
    setattr(turn, field, value)
    with DataStore(data_root, background=False) as store:
        with pytest.raises(error, match=field):
            store.append([make_turn(0), turn])  # the good turn is not written either
        assert store.flush() == 0
    assert wal_segments(data_root) == [] and parquet_files(data_root) == []


def test_append_rejects_a_vote_that_is_neither_an_int_nor_none(data_root):
    with DataStore(data_root, background=False) as store:
        with pytest.raises(ValueError, match=r"JudgeVerdict\.votes = \[1, None, 'yes'\]"):
            store.append(JudgeVerdict("t0", "h1", "rule", 1, "majority", [1, None, "yes"], "[]"))
        assert store.flush() == 0


def test_append_rejects_objects_that_are_not_records(data_root):
    with DataStore(data_root, background=False) as store, pytest.raises(TypeError, match="TurnRecord"):
        store.append({"turn_id": "x"})


def test_append_after_close_raises(data_root, make_turn):
    store = DataStore(data_root, background=False)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.append(make_turn(0))


def test_background_thread_publishes_without_flush(data_root, make_turn):
    with DataStore(data_root, flush_interval_s=0.05) as store:
        store.append([make_turn(i) for i in range(20)])
        wait_until(lambda: run_query(data_root, "SELECT count(*) n FROM turns").column("n")[0].as_py() == 20,
                   "the background conversion to publish the rows")
        assert wal_segments(data_root) == []


def test_an_idle_log_sleeps_until_its_next_recovery_and_an_append_wakes_it(data_root, make_turn):
    class CountingEvent(threading.Event):
        waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            return super().wait(timeout)

    log_ = TableLog(data_root, "turns", TURNS, flush_interval_s=0.05, recover_interval_s=60, background=False)
    log_._wake = wake = CountingEvent()
    log_._thread = threading.Thread(target=log_._run, daemon=True)  # the background thread, on the counting event
    log_._thread.start()
    wait_until(lambda: wake.waits >= 1, "the background thread to go to sleep")
    time.sleep(1.0)  # a window in which it must not wake
    assert wake.waits == 1  # asleep until the recovery due in 60 s (it woke 20 times a second before)
    log_.append([make_turn(0)])
    wait_until(lambda: list((data_root / "turns").glob("date=*/*.parquet")),
               "the append to wake the background thread and publish")
    assert 2 <= wake.waits <= 4  # woken by the new segment, slept until it was due, published it
    log_.close()


def test_a_segment_closes_at_flush_rows(data_root, make_turn):
    log_ = TableLog(data_root, "turns", TURNS, flush_rows=10, background=False)
    for i in range(25):
        log_.append([make_turn(i)])
    assert len(log_._pending) == 2  # rows 0-9 and 10-19 closed; 20-24 still in the active segment
    log_.close()
    # 25 rows / 10 per segment -> segments of 10, 10 and 5 -> three files
    sizes = sorted(pq.read_metadata(f).num_rows for f in (data_root / "turns").glob("date=*/*.parquet"))
    assert sizes == [5, 10, 10]


def test_rows_that_do_not_fit_the_schema_are_set_aside_not_lost(data_root, make_turn, parser):
    good = [orjson.loads(orjson.dumps(make_turn(i))) for i in range(3)]
    bad_type = dict(good[1], turn_id="bad-type", prompt_ids=[1, "two"])
    null_item = dict(good[1], turn_id="null-item", output_ids=[1, None])  # DuckDB reads it: caught after
    log_ = TableLog(data_root, "turns", TURNS, background=False)
    log_.append([good[0], bad_type, null_item, good[2]])
    log_.close()
    table = pq.read_table(next((data_root / "turns").glob("date=*/*.parquet")))
    assert table.column("turn_id").to_pylist() == ["turn-000000", "turn-000002"]
    (rejected,) = (data_root / "turns" / convert.REJECTED_DIR).glob("*.jsonl")
    entries = [orjson.loads(line) for line in rejected.read_bytes().splitlines()]
    assert [orjson.loads(e["line"])["turn_id"] for e in entries] == ["bad-type", "null-item"]
    assert all(e["error"] for e in entries)
    assert parser.fallbacks == [4]  # the whole segment failed the fast parse, then went line by line


def test_recover_leaves_a_live_writers_segment_alone(data_root, make_turn):
    a = DataStore(data_root, background=False)
    a.append([make_turn(i) for i in range(5)])
    (segment,) = wal_segments(data_root)
    with DataStore(data_root, background=False) as b:  # opening recovers: it must skip a's segment
        assert b.recover() == 0
        assert wal_segments(data_root) == [segment]
    a.flush()
    a.close()
    assert run_query(data_root, "SELECT count(*) n FROM turns").column("n")[0].as_py() == 5


def test_recover_removes_only_an_old_unpublished_segment(data_root):
    """A .wal.new is unlocked between its creation and its writer's flock: a recovery running then
    (another store opening) must not take it for a dead writer's and delete it (the writer's rename
    failed with FileNotFoundError in a judge flow before this rule). Only an old one is an orphan."""
    with DataStore(data_root, background=False) as store:
        wal_dir = data_root / "tables" / "turns" / "_wal"
        fresh, old = wal_dir / f"1-fresh-000001{wal._NEW_SUFFIX}", wal_dir / f"1-old-000001{wal._NEW_SUFFIX}"
        fresh.touch()
        old.touch()
        past = time.time() - wal.ORPHAN_NEW_AGE_S - 1
        os.utime(old, (past, past))
        assert store.recover() == 0
        assert fresh.exists() and not old.exists()


def test_recovery_drops_only_an_unterminated_last_line(data_root, make_turn, parser):
    wal = data_root / "tables" / "turns" / "_wal"
    wal.mkdir(parents=True)
    lines = [orjson.dumps(make_turn(i), option=orjson.OPT_APPEND_NEWLINE) for i in range(4)]
    # A write cut short by kill -9 mid-syscall: the 4th row was never acknowledged.
    (wal / "123-deadbeef-000001.wal").write_bytes(b"".join(lines[:3]) + lines[3][:40])
    with DataStore(data_root, background=False):
        pass
    ids = run_query(data_root, "SELECT turn_id FROM turns ORDER BY 1").column("turn_id").to_pylist()
    assert ids == ["turn-000000", "turn-000001", "turn-000002"]
    assert wal_segments(data_root) == []
    assert not (data_root / "tables" / "turns" / convert.REJECTED_DIR).exists()  # a torn tail is no misfit
    assert parser.fallbacks == []


def test_group_commit_shares_one_fsync_between_concurrent_appends(data_root, make_turn, monkeypatch):
    calls = []
    real = os.fdatasync

    def slow_fdatasync(fd):
        calls.append(fd)
        time.sleep(0.005)  # a disk's flush latency; appends arriving meanwhile share the next one
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    n_threads, per_thread = 8, 25
    with DataStore(data_root, fsync=True, background=False) as store:
        def worker(t):
            for i in range(per_thread):
                store.append(make_turn(t * 1000 + i))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        appends = n_threads * per_thread
        # 200 acknowledged appends, fewer fsyncs. Measured on 2 cores: 45-122 (groups of ~2-4): waiters
        # leave _sync_lock one by one (each handoff waits for the GIL), so the next leader's fsync covers
        # only what was appended meanwhile. A followers-wait-on-a-condition design would batch more.
        assert 0 < len(calls) <= appends * 0.8, len(calls)
        store.flush()
    got = run_query(data_root, "SELECT count(*) n, count(DISTINCT turn_id) d FROM turns").to_pylist()[0]
    assert got == {"n": 200, "d": 200}


def test_the_conversion_connection_draws_no_progress_bar():
    # A large segment takes DuckDB >2 s on a slow machine; its bar would land on the gateway's terminal.
    con = convert._conversion_connection()
    assert con.sql("SELECT current_setting('enable_progress_bar') AS p").fetchall() == [(False,)]
