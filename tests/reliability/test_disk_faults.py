"""Disk faults: a data root that cannot be written at start, and a disk that fills up while serving.

Tests run as root in CI containers, where chmod does not stop a write; so the unwritable data roots
here fail for root too: a data root below a regular file, a data root that is a file, and a file
size limit of 0 (RLIMIT_FSIZE, which makes every write to a file fail with EFBIG as if the disk were
full). "Disk full" while serving is RLIMIT_FSIZE lowered on the running gateway process with
prlimit(2) and raised again later: real failing write(2) calls in a real process, no mock.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from clawrl.gateway.routes import create_app
from clawrl.serving import serve_in_thread
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataRootError, DataStore
from tests.utils.gateway_process import REPO, free_port, gateway_process, listening, serve_env
from tests.utils.waiting import CAP_S, HANG_S, join, run_to_end, spawn, wait_until

pytestmark = [pytest.mark.reliability]

INF = resource.RLIM_INFINITY


def _limit_file_size(nbytes: int):
    def preexec() -> None:  # in the child, before exec: only the soft limit, so it can be raised again
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, INF))

    return preexec


def _wal_files(data: Path) -> list[Path]:
    return sorted(data.glob("tables/*/_wal/*.wal"))


# ------------------------------------------------------------------------------ not writable at start


@pytest.mark.timeout(HANG_S)
def test_serve_exits_before_serving_when_the_data_root_cannot_be_written(tmp_path, model_cache, tiny_dir):
    t_start = time.monotonic()
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory\n")
    cases = {  # name -> (data root, preexec_fn, expected words); each fails for root too
        "under_a_file": (blocker / "data", None, "Not a directory"),
        "is_a_file": (blocker, None, "Not a directory"),
        "no_space": (tmp_path / "full-disk", _limit_file_size(0), "File too large"),
    }
    if os.geteuid() != 0:  # permissions only stop a non-root user
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o500)
        cases["read_only_dir"] = (ro / "data", None, "Permission denied")
    procs = {}
    for name, (root, preexec, _) in cases.items():
        port = free_port()
        procs[name] = (port, spawn([sys.executable, "-m", "clawrl.cli", "serve", "--port", str(port)], tmp_path, name,
                                   cwd=REPO, env=serve_env(root, model_cache), preexec_fn=preexec))
    figures = {}
    for name, (port, child) in procs.items():
        t0 = time.monotonic()
        done = child.result(f"serve ({name}) to exit")
        out, err = done.stdout, done.stderr
        root, _, words = cases[name]
        assert done.returncode == 2, (name, out, err)
        message = " ".join(err.split())  # the console may wrap a long line
        assert f"storage error: data root {root}" in message and words in message, (name, err)
        assert "Traceback" not in err and "gateway on" not in out  # one clear line, and it never served
        assert not listening(port)
        figures[name] = round(time.monotonic() - t0, 1)
    assert not (tmp_path / "full-disk" / "tables" / "turns").exists()  # it stopped before opening any table
    print(f"\nFIGURES data_root_unwritable: cases={sorted(cases)} exit=2 each, served=0, "
          f"wall_s={time.monotonic() - t_start:.1f}")


@pytest.mark.timeout(HANG_S)
def test_up_exits_before_starting_anything_when_the_data_root_cannot_be_written(tmp_path, model_cache):
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory\n")
    proc = run_to_end([sys.executable, "-m", "clawrl.cli", "up", "--prefect-port", str(free_port()),
                       "--mlflow-port", str(free_port()), "--trainer-port", str(free_port())],
                      cwd=REPO, env=serve_env(blocker / "data", model_cache))
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"storage error: data root {blocker / 'data'}" in message and "Not a directory" in message
    assert "Traceback" not in proc.stderr and "http://" not in proc.stdout  # nothing was started or announced


@pytest.mark.timeout(HANG_S)
def test_gateway_app_fails_cleanly_when_the_data_root_goes_bad_before_startup(make_settings, tiny_engine, tmp_path):
    s = make_settings({"server.open_mode": True})
    # Checked at creation, before any engine or model is built:
    bad = make_settings({"server.open_mode": True, "storage.data_root": str(tmp_path / "file" / "data")})
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataRootError, match=f"data root {tmp_path / 'file' / 'data'} is not usable"):
        create_app(bad)
    # Checked again when the app starts: the root became a file between creation and startup.
    app = create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer)
    root = s.storage.data_root
    for p in sorted(root.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    root.rmdir()
    root.write_text("now a file\n")
    with pytest.raises(RuntimeError, match="server failed to start"):
        serve_in_thread(app, startup_timeout_s=CAP_S)  # it fails at startup: only a hang would reach the cap
    assert not hasattr(app.state, "service")  # no half-started gateway: the lifespan never finished


# ------------------------------------------------------------------------------ full while serving


@pytest.mark.timeout(HANG_S)
def test_disk_full_while_serving_gives_507_and_never_acknowledges_an_unwritten_turn(tmp_path, model_cache, tiny_dir):
    t_start = time.monotonic()
    data = tmp_path / "data"
    gw = gateway_process(tmp_path, serve_env(data, model_cache))
    gw.start()
    gw.wait_ready()
    client = OpenAI(base_url=gw.url + "/v1", api_key="open", max_retries=0, timeout=60)
    acked: list[tuple[str, int]] = []
    history = [{"role": "user", "content": "first question"}]

    def turn(sid: str, messages: list[dict]) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                          json={"model": "m", "messages": messages, "max_tokens": 4, "session_id": sid})

    try:
        r = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                           extra_body={"session_id": "kept"})
        acked.append(("kept", r.model_extra["turn_index"]))
        history += [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "second question"}]
        # the segment rotates (flush_interval_s 0.5) and converts: the next append opens a new one
        wait_until(lambda: not list(data.glob("tables/turns/_wal/*.wal")), "the first turn's WAL segment converted",
                   proc=gw.proc, log=gw.log_path)

        # The disk "fills up": files of this process may not grow beyond 100 bytes. A new segment
        # takes the first 100 bytes of a ~3 KB turn (a short write), then write(2) fails with EFBIG.
        resource.prlimit(gw.pid, resource.RLIMIT_FSIZE, (100, INF))
        failures = []
        new = turn("fresh", [{"role": "user", "content": "hello"}])  # no pending turn: the turn's own append fails
        linked = turn("kept", history)  # a pending turn: linking its next state fails first
        stream = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "session_id": "s"})
        for r, what in ((new, "the turn"), (linked, "the previous turn's next state")):
            assert r.status_code == 507, r.text
            err = r.json()["error"]
            assert err["type"] == "storage_error" and err["code"] is None and err["param"] is None
            assert err["message"].startswith(f"could not record {what}:") and "File too large" in err["message"]
            failures.append(r.status_code)
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "storage_error" and "could not record the turn" in events[-1]["error"]["message"]
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)  # never completed
        failures.append(507)
        health = httpx.get(gw.url + "/healthz", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "storage_unwritable"
        # No WAL segment keeps a torn line: a failed write was cut back (or its segment retired).
        assert all(p.read_bytes()[-1:] in (b"", b"\n") for p in _wal_files(data))

        # Space comes back: the same process records again, and the session goes on where it was.
        resource.prlimit(gw.pid, resource.RLIMIT_FSIZE, (INF, INF))
        assert httpx.get(gw.url + "/healthz", timeout=30).json()["status"] == "ok"
        r = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                           extra_body={"session_id": "kept"})
        assert r.model_extra["turn_index"] == 1  # the index of the failed attempt was given back
        acked.append(("kept", 1))
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=4, extra_body={"session_id": "fresh"})
        acked.append(("fresh", r.model_extra["turn_index"]))
    finally:
        if gw.proc.poll() is None:
            resource.prlimit(gw.pid, resource.RLIMIT_FSIZE, (INF, INF))
        rc = gw.stop()
    assert rc == -signal.SIGTERM, gw.log_tail()
    DataStore(data, background=False).close()
    rows = run_query(data, "SELECT session_id, turn_index FROM turns ORDER BY ALL").to_pylist()
    assert [(r["session_id"], r["turn_index"]) for r in rows] == sorted(acked) == [("fresh", 0), ("kept", 0), ("kept", 1)]
    links = run_query(data, "SELECT turn_index, reason FROM next_states WHERE session_id = 'kept'").to_pylist()
    assert links == [{"turn_index": 0, "reason": "next_request"}]  # linked once, by the attempt that succeeded
    assert not list(data.glob("tables/*/_rejected/*"))  # no torn line was ever parsed as a row
    print(f"\nFIGURES disk_full: requests during full disk={len(failures)} -> 507 each (acknowledged 0), "
          f"turns acknowledged={len(acked)} stored={len(rows)} lost=0 unacknowledged_stored=0, recovered without "
          f"restart: yes, wall_s={time.monotonic() - t_start:.1f}")


# ------------------------------------------------------------------------------ the WAL append path

WAL_CHILD = textwrap.dedent('''
    import errno, os, resource, signal, sys
    from datetime import datetime, timezone
    from clawrl.records import TurnRecord
    from clawrl.storage.writer import DataStore

    def turn(i):
        t = datetime(2026, 7, 1, tzinfo=timezone.utc)
        return TurnRecord(turn_id=f"t{i}", session_id="s", turn_index=i, turn_type="main", namespace="open",
                          model="m", weight_version="0", request_messages="[]", request_tools=None,
                          request_params="{}", prompt_ids=list(range(300)), output_ids=[1, 2],
                          rollout_logprobs=[-1.0, -2.0], text="ok", tool_calls=None, finish_reason="stop",
                          created_at=t, completed_at=t, latency_ms=1.0)

    store = DataStore(sys.argv[1], background=False, fsync=sys.argv[2].endswith("fsync"))
    if sys.argv[2].startswith("truncate_fails"):  # injected: a failing ftruncate cannot be produced on demand
        def broken_ftruncate(fd, length):
            raise OSError(errno.EIO, "Input/output error")
        os.ftruncate = broken_ftruncate
    for i in range(3):
        store.append(turn(i))
        print("acked", i, flush=True)
    [seg] = [p for p in os.scandir(os.path.join(sys.argv[1], "tables", "turns", "_wal"))]
    size = os.path.getsize(seg.path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.RLIM_INFINITY))  # room for 100 bytes
    try:
        store.append(turn(3))
        print("acked", 3, flush=True)
    except OSError as e:
        print("failed", 3, errno.errorcode[e.errno], os.path.getsize(seg.path) - size, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for i in (4, 5):
        store.append(turn(i))
        print("acked", i, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: recovery reads the WAL as a crash leaves it
''')


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("mode", ["truncate_works", "truncate_fails", "truncate_fails_fsync"])
def test_a_failed_wal_append_is_not_acknowledged_and_recovery_keeps_every_acked_row(tmp_path, mode):
    data = tmp_path / "data"
    child = run_to_end([sys.executable, "-c", WAL_CHILD, str(data), mode], cwd=REPO)
    assert child.returncode == -signal.SIGKILL, child.stderr
    lines = [line.split() for line in child.stdout.splitlines()]
    acked = [int(w[1]) for w in lines if w[0] == "acked"]
    [failed] = [w for w in lines if w[0] == "failed"]
    assert acked == [0, 1, 2, 4, 5] and failed[:3] == ["failed", "3", "EFBIG"]
    # The short write put 100 bytes of row 3 in the file; they were cut back, or (cut failed) left
    # as the last bytes of a segment retired from appends.
    assert int(failed[3]) == (0 if mode == "truncate_works" else 100)
    segments = _wal_files(data)
    assert len(segments) == 2  # the failed write retired the first segment; 4 and 5 went to a new one
    with DataStore(data, background=False):  # recovery of the dead writer's segments
        pass
    ids = run_query(data, "SELECT turn_index FROM turns ORDER BY 1").column("turn_index").to_pylist()
    assert ids == [0, 1, 2, 4, 5]
    assert not list(data.glob("tables/turns/_rejected/*")) and _wal_files(data) == []


@pytest.mark.timeout(HANG_S)
def test_concurrent_appends_through_failing_writes_keep_exactly_the_acknowledged_rows(tmp_path, monkeypatch):
    """Eight threads append with group commit (fsync=True) while one large write in seven fails
    after a short write and one cut-back in three fails too. Injected in-process (a mock of
    os.write / os.ftruncate): a real disk cannot be made to fail this often, this randomly. Every
    append that returned is stored once; none that raised is stored; no torn line is parsed."""
    import random
    import threading

    from clawrl.records import TurnRecord, utcnow

    rng = random.Random(7)
    rng_lock = threading.Lock()
    real_write, real_ftruncate = os.write, os.ftruncate
    failing: set[int] = set()  # fds whose next write fails (after a short one), as on a full disk

    def flaky_write(fd, data):
        if len(data) < 1000:  # not a turn line (pytest's own output, a probe...)
            return real_write(fd, data)
        with rng_lock:
            if fd in failing:
                failing.discard(fd)
                raise OSError(28, "No space left on device")
            if rng.random() < 1 / 7:
                failing.add(fd)
                return real_write(fd, bytes(data[: len(data) // 3]))  # short write: a torn line
        return real_write(fd, data)

    def flaky_ftruncate(fd, length):
        with rng_lock:
            fail = rng.random() < 1 / 3
        if fail:
            raise OSError(5, "Input/output error")
        return real_ftruncate(fd, length)

    def turn(t: int, i: int) -> TurnRecord:
        now = utcnow()
        return TurnRecord(turn_id=f"t{t}-{i}", session_id=f"s{t}", turn_index=i, turn_type="main", namespace="open",
                          model="m", weight_version="0", request_messages="[]", request_tools=None,
                          request_params="{}", prompt_ids=list(range(400)), output_ids=[1, 2],
                          rollout_logprobs=[-1.0, -2.0], text="ok", tool_calls=None, finish_reason="stop",
                          created_at=now, completed_at=now, latency_ms=1.0)

    data = tmp_path / "data"
    store = DataStore(data, fsync=True, flush_interval_s=0.05)
    monkeypatch.setattr(os, "write", flaky_write)
    monkeypatch.setattr(os, "ftruncate", flaky_ftruncate)
    acked: set[str] = set()
    refused: set[str] = set()

    def worker(t: int) -> None:
        for i in range(60):
            rec = turn(t, i)
            try:
                store.append(rec)
            except OSError:
                refused.add(rec.turn_id)
            else:
                acked.add(rec.turn_id)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    join(*threads)
    monkeypatch.undo()
    store.close()
    stored = run_query(data, "SELECT turn_id, count(*) AS n FROM turns GROUP BY 1").to_pylist()
    assert len(acked) + len(refused) == 480 and len(refused) >= 20  # the faults did happen
    assert {r["turn_id"] for r in stored} == acked and {r["n"] for r in stored} == {1}
    assert not list(data.glob("tables/turns/_rejected/*")) and _wal_files(data) == []
    print(f"\nFIGURES wal_failing_writes: appends=480 acknowledged={len(acked)} refused={len(refused)} "
          f"stored={len(stored)} lost=0 unacknowledged_stored=0")
