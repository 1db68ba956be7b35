"""Readers in one process, writers in others: no reader error, counts only grow, no row twice."""

from __future__ import annotations

import time

from clawrl.storage.catalog import run_query
from tests.utils.waiting import wait_until

WRITER = """
    store = DataStore(sys.argv[1], flush_interval_s=0.02)
    start, n = int(sys.argv[2]), int(sys.argv[3])
    for i in range(start, start + n):
        store.append(make_turn(i))
        if i % 20 == 0:
            time.sleep(0.01)  # pacing: spread the rows over many small Parquet files
    store.close()
    print("done", flush=True)
"""


def test_a_reader_sees_growing_counts_and_never_an_error_while_a_process_writes(data_root, spawn):
    child = spawn(WRITER, str(data_root), "0", "3000")
    seen = []
    while child.poll() is None:
        n = run_query(data_root, "SELECT count(*) n FROM turns").column("n")[0].as_py()  # raises on a partial file
        seen.append(n)
        time.sleep(0.005)  # pacing: the reader asks as often as it can
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert seen == sorted(seen)  # monotonic: a file, once visible, stays and never shrinks
    assert len(set(seen)) >= 3, f"reader saw too few intermediate states: {sorted(set(seen))}"
    final = run_query(data_root, "SELECT count(*) n, count(DISTINCT turn_id) d FROM turns").to_pylist()[0]
    assert final == {"n": 3000, "d": 3000}


def test_two_processes_append_to_one_table_without_losing_or_doubling_rows(data_root, spawn):
    a = spawn(WRITER, str(data_root), "0", "1500")
    b = spawn(WRITER, str(data_root), "100000", "1500")
    for child in (a, b):
        wait_until(lambda: child.poll() is not None, "a writer to finish", proc=child)
        out, err = child.communicate()
        assert child.returncode == 0 and out == "done\n", err
    got = run_query(data_root, """
        SELECT count(*) n, count(DISTINCT turn_id) d, count(*) FILTER (WHERE turn_index >= 100000) b
        FROM turns""").to_pylist()[0]
    assert got == {"n": 3000, "d": 3000, "b": 1500}
    assert list((data_root / "tables" / "turns" / "_wal").glob("*.wal")) == []
