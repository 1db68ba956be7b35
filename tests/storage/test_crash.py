"""kill -9 at the worst moments: every acknowledged row survives, and none is written twice."""

from __future__ import annotations

import signal

from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.waiting import wait_until


def counts(data_root):
    return run_query(data_root, "SELECT count(*) n, count(DISTINCT turn_id) d FROM turns").to_pylist()[0]


def parquet_files(root):
    return sorted((root / "tables" / "turns").glob("date=*/*.parquet"))


def wal_segments(root):
    return sorted((root / "tables" / "turns" / "_wal").glob("*.wal"))


def test_every_acknowledged_turn_survives_kill_9(data_root, spawn):
    # The child prints each id right after append returns (the acknowledgement), then goes on.
    child = spawn(
        """
        store = DataStore(sys.argv[1], flush_interval_s=0.02)
        for i in range(1_000_000):
            turn = make_turn(i)
            store.append(turn)
            print(turn.turn_id, flush=True)
        """,
        str(data_root),
    )
    acked = []
    # Kill it once some rows are already in Parquet and more are only in the WAL (a background thread that
    # never publishes ends the loop at the child's last row: its output ends, and the assert says so).
    while len(acked) < 400 or not parquet_files(data_root):
        line = child.stdout.readline()
        assert line, f"the background thread never published anything: {child.stderr.read()}"
        acked.append(line.strip())
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    # through the same reader readline used: communicate() reads the pipe itself and would skip what readline
    # read ahead, turning the rest of a line into a fake id ("-001949")
    rest = child.stdout.read()
    # the last piece may be a torn print: not acked; nor is a blank piece (the child never prints one)
    acked += [line for line in rest.split("\n")[:-1] if line.strip()]
    visible_before_recovery = counts(data_root)["n"]  # the rest of the acked rows are only in the WAL

    with DataStore(data_root, background=False):  # opening recovers the dead writer's segments
        pass
    assert wal_segments(data_root) == []
    ids = run_query(data_root, "SELECT turn_id, count(*) n FROM turns GROUP BY turn_id").to_pylist()
    stored = {row["turn_id"]: row["n"] for row in ids}
    missing = [i for i in acked if i not in stored]
    assert missing == []
    assert len(stored) >= visible_before_recovery
    assert set(stored.values()) == {1}  # exactly once, acknowledged or not


CRASH_AT = """
    from clawrl.storage import convert, wal
    n = int(sys.argv[2])
    real_replace, replaced = convert._replace, []

    def crash(*args):
        os.kill(os.getpid(), 9)

    def replace_then_maybe_crash(tmp, final):
        if len(replaced) == n:
            crash()
        real_replace(tmp, final)
        replaced.append(final)

    convert._replace = replace_then_maybe_crash
    if sys.argv[3] == "before_delete":
        wal._drop_segment = crash
    store = DataStore(sys.argv[1], background=False)
    # 30 turns, one second apart from 23:59:45: 15 on 2026-11-29 and 15 on 2026-11-30, one segment
    turns = [make_turn(i) for i in range(30)]
    for i, t in enumerate(turns):
        t.created_at = T0.replace(hour=23, minute=59, second=45) + timedelta(seconds=i)
    store.append(turns)
    store.flush()
"""


def crash_child(spawn, data_root, n_replaces_before_crash, where):
    child = spawn(CRASH_AT, str(data_root), str(n_replaces_before_crash), where)
    wait_until(lambda: child.poll() is not None, "the child to crash", proc=child)
    out, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err


def test_crash_between_rename_and_segment_delete_does_not_duplicate(data_root, spawn):
    crash_child(spawn, data_root, 99, "before_delete")  # both dates published, then killed
    assert len(parquet_files(data_root)) == 2 and len(wal_segments(data_root)) == 1
    assert counts(data_root) == {"n": 30, "d": 30}  # already visible before any recovery

    with DataStore(data_root, background=False):
        pass
    assert wal_segments(data_root) == []
    assert counts(data_root) == {"n": 30, "d": 30}
    assert len(parquet_files(data_root)) == 2


def test_crash_between_the_two_dates_of_one_segment_does_not_duplicate(data_root, spawn):
    crash_child(spawn, data_root, 1, "")  # killed right before publishing the second date
    (first,) = parquet_files(data_root)
    assert first.parent.name == "date=2026-11-29"
    assert counts(data_root) == {"n": 15, "d": 15}
    tmp = list((data_root / "tables" / "turns").glob("date=*/*.tmp"))
    assert len(tmp) == 1  # the second date's file was written to its temp name, never published

    with DataStore(data_root, background=False):
        pass
    by_date = run_query(data_root, "SELECT CAST(date AS VARCHAR) d, count(*) n FROM turns GROUP BY d ORDER BY d")
    assert by_date.to_pylist() == [{"d": "2026-11-29", "n": 15}, {"d": "2026-11-30", "n": 15}]
    assert list((data_root / "tables" / "turns").glob("date=*/*.tmp")) == []
    assert wal_segments(data_root) == []


def test_crash_before_the_first_rename_publishes_nothing_until_recovery(data_root, spawn):
    crash_child(spawn, data_root, 0, "")
    assert parquet_files(data_root) == []
    assert counts(data_root) == {"n": 0, "d": 0}  # readers never see the temp file

    with DataStore(data_root, background=False):
        pass
    assert counts(data_root) == {"n": 30, "d": 30}
