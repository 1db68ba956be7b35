"""The append path of one table: a write-ahead log of JSON lines, converted into Parquet.

Layout: ``<root>/<table>/_wal/<segment-id>.wal``, one JSON line per row, from one writer.

**Durability point.** ``TableLog.append`` returns only after the rows' bytes have gone to the
segment file in one ``os.write``: that is the acknowledgement. From then on a ``kill -9`` of the
process cannot lose them: the kernel's page cache holds the bytes, and the next ``recover()`` (run
when any writer opens the table, and every ``recover_interval_s`` by each running writer)
converts them. A power loss or kernel crash can still lose what the kernel had not yet written
back (~30 s by default) unless ``fsync=True``: then ``append`` also waits for ``fdatasync``,
shared by concurrent appenders (group commit: one fsync covers every write done before it began).

**A failed append** (disk full, EFBIG, EIO) raises and is not acknowledged: a partial write is cut
back, and the segment is retired from appends, so if even the cut failed the torn bytes stay its
last line, which conversion drops; the next append starts a new segment.

**What readers see.** Only Parquet, never the WAL (``clawrl sql`` first waits for the segments there
are when it starts: ``wait_converted``). A segment is closed when its first row is
``flush_interval_s`` old (background thread), at ``flush_rows`` rows or ``flush_bytes`` bytes, or
on ``flush()``; it is then converted (storage/convert.py, exactly once) and deleted.

**Several writers.** Each writer has its own segment ids (pid + uuid) and holds an ``flock`` on
every segment it owns until the segment is deleted. ``recover()`` replays only segments whose lock
it can take, i.e. whose writer is dead (the kernel drops a dead process's locks), so processes can
append to one table at once and clean up after each other without touching live segments. This
needs ``flock`` semantics (a local filesystem; not NFS, where closing any descriptor of a file
drops its locks). A forked child must open its own log: appending through the parent's raises.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from clawrl.storage.convert import convert_segment, fsync_path

log = logging.getLogger(__name__)

WAL_DIR = "_wal"
SEGMENT_SUFFIX = ".wal"
_NEW_SUFFIX = ".wal.new"  # a segment being created: locked first, then renamed to .wal
# A .wal.new is unlocked for the moment between its creation and its writer's flock: recovery
# removes only ones older than this, so it never deletes a live writer's segment under its feet.
ORPHAN_NEW_AGE_S = 60.0
_MIB = 1 << 20
_JSON_OPTS = orjson.OPT_APPEND_NEWLINE



SETTLE_S = 10.0  # a live writer converts a segment within flush_interval_s (0.5 s); recovery within 10 s


def wait_converted(tables: Path, timeout_s: float = SETTLE_S) -> list[str]:
    """Wait until every segment under ``tables`` (``<root>/tables``) now is converted into Parquet, so a
    reader sees every row acknowledged before it asked; the segments still there after ``timeout_s``."""
    waiting, deadline = set(tables.glob(f"*/{WAL_DIR}/*{SEGMENT_SUFFIX}")), time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = {p for p in waiting if p.exists()}
    return sorted(str(p) for p in waiting)

@dataclass
class _Segment:
    id: str
    path: Path
    fd: int  # O_WRONLY|O_APPEND, holds the segment's flock until the segment is deleted
    opened_at: float = field(default_factory=time.monotonic)
    rows: int = 0
    nbytes: int = 0
    longest_line: int = 0  # bytes, newline included: the JSON reader's block must hold it


class TableLog:
    """An append-only table: rows go to a write-ahead log, then to Parquet (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, table: str, schema: pa.Schema, *,
                 flush_rows: int = 50_000, flush_bytes: int = 64 * _MIB,
                 flush_interval_s: float = 0.5, fsync: bool = False,
                 recover_interval_s: float = 10.0, background: bool = True) -> None:
        if flush_rows < 1 or flush_bytes < 1 or flush_interval_s <= 0:
            raise ValueError("flush_rows, flush_bytes and flush_interval_s must be positive")
        self.table = table
        self.schema = schema
        self.table_dir = Path(root) / table
        self.wal_dir = self.table_dir / WAL_DIR
        self.flush_rows = flush_rows
        self.flush_bytes = flush_bytes
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self.recover_interval_s = recover_interval_s
        self._pid = os.getpid()
        self.writer_id = f"{self._pid}-{uuid.uuid4().hex[:12]}"
        self._seq = 0
        # Lock order: _sync_lock before _lock. _lock guards the active segment and the counters;
        # _sync_lock is held during an fsync so that rotation cannot close the fd under it.
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._convert_lock = threading.Lock()
        self._active: _Segment | None = None
        self._pending: deque[_Segment] = deque()  # closed segments awaiting conversion
        self._written = 0  # appends so far (group-commit tickets)
        self._synced = 0  # appends covered by an fsync
        self._unsyncable = 0  # appends up to here sit in a retired segment whose fdatasync failed
        self._closed = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.wal_dir.mkdir(parents=True, exist_ok=True)
        self.recover()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=f"tablelog-{table}", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    def append(self, rows: Sequence[Any]) -> int:
        """Write rows (dataclass instances or dicts matching the schema) to the WAL; return the count.

        Returns only once the rows are in the segment file (the durability point), after an
        fsync too when ``fsync=True``. Values are not type-checked here (DataStore does that).
        """
        if not rows:
            return 0
        lines = [orjson.dumps(row, option=_JSON_OPTS) for row in rows]
        longest = max(map(len, lines))
        payload = b"".join(lines)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"TableLog {self.table!r} is closed")
            if os.getpid() != self._pid:  # a forked child shares our fds and locks: it must open its own
                raise RuntimeError(f"TableLog {self.table!r} was opened in process {self._pid}; open a new one")
            seg = self._active or self._open_segment()
            try:
                _write_all(seg, payload)
            except BaseException:
                self._retire_failed(seg)
                raise
            seg.rows += len(rows)
            seg.nbytes += len(payload)
            seg.longest_line = max(seg.longest_line, longest)
            self._written += 1
            ticket = self._written
            full = seg.rows >= self.flush_rows or seg.nbytes >= self.flush_bytes
        if self.fsync:
            self._sync(ticket)
        if full:
            self._rotate(only=seg)
            self._wake.set()
        return len(rows)

    def flush(self) -> int:
        """Close the active segment and convert every closed one now; return the rows converted.

        After it returns, every row appended before the call is visible to readers.
        """
        self._rotate()
        return self._convert_pending(raise_errors=True)

    def close(self) -> None:
        """Stop the background thread, flush, release the segments. Idempotent."""
        with self._lock:
            if self._closed or os.getpid() != self._pid:  # never flush the parent's segments from a fork
                return
            self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self._rotate()
            self._convert_pending(raise_errors=True)
        finally:
            # A segment that failed to convert stays on disk; releasing its lock lets recovery take it.
            for seg in self._pending:
                os.close(seg.fd)
            self._pending.clear()

    def recover(self) -> int:
        """Replay segments left by dead writers (this one's own live segments are skipped)."""
        converted = 0
        for path in sorted(self.wal_dir.glob(f"*{_NEW_SUFFIX}")):
            if _age_s(path) < ORPHAN_NEW_AGE_S:
                continue
            fd = _lock_orphan(path)
            if fd is not None:  # died between creating and publishing it: never written to
                path.unlink(missing_ok=True)
                os.close(fd)
        for path in sorted(self.wal_dir.glob(f"*{SEGMENT_SUFFIX}")):
            fd = _lock_orphan(path)
            if fd is None:
                continue
            try:
                segment_id = path.name[: -len(SEGMENT_SUFFIX)]
                rows = convert_segment(path, self.schema, self.table_dir, segment_id, fsync=self.fsync)
                log.info("recovered %d rows of %s from segment %s", rows, self.table, segment_id)
                converted += rows
                _drop_segment(path, self.wal_dir, self.fsync)
            finally:
                os.close(fd)
        return converted

    def _open_segment(self) -> _Segment:
        """Create, lock and publish a new segment (caller holds _lock)."""
        self._seq += 1
        segment_id = f"{self.writer_id}-{self._seq:06d}"
        path, new = self.wal_dir / f"{segment_id}{SEGMENT_SUFFIX}", self.wal_dir / f"{segment_id}{_NEW_SUFFIX}"
        fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            # Lock before the .wal name exists: a recovering process must never see an unlocked live segment.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(new, path)
        except BaseException:  # e.g. a full disk: leave neither a descriptor nor a file behind
            os.close(fd)
            new.unlink(missing_ok=True)
            raise
        self._active = _Segment(segment_id, path, fd)
        if self.fsync:
            fsync_path(self.wal_dir)
        self._wake.set()  # the background thread sleeps while no segment is open: its flush clock starts now
        return self._active

    def _retire_failed(self, seg: _Segment) -> None:
        """A write to ``seg`` raised (caller holds _lock): nothing of it is acknowledged.

        _write_all cut the file back, but if the cut failed too (EIO) a torn line may remain, so
        the segment is closed for appends: the next append starts a new file and the torn bytes stay
        the LAST line of this one, which conversion drops. Appending after them would glue the next
        acknowledged row to the fragment, and the line-by-line parser would set both aside.
        """
        self._active = None
        self._pending.append(seg)
        self._wake.set()
        if self.fsync:  # what rotation does: appenders waiting in _sync find their rows synced
            try:
                os.fdatasync(seg.fd)
            except OSError:
                log.exception("fdatasync of %s segment %s failed after a failed write", self.table, seg.id)
                self._unsyncable = self._written  # appends up to here may never reach the disk
            else:
                self._synced = self._written  # every successful write is in seg or an older, synced one

    def _sync(self, ticket: int) -> None:
        """Group commit: return once an fdatasync started after append `ticket` has finished."""
        with self._sync_lock:
            with self._lock:  # read under _lock: _retire_failed updates these under it alone
                if self._synced >= ticket:
                    return  # another appender's fsync (or a rotation) already covered this write
                if ticket <= self._unsyncable:
                    raise OSError(errno.EIO, f"{self.table}: the segment holding this append could not be synced")
                target = self._written
                seg = self._active
            # Rotation and _retire_failed sync what they close, so if `ticket` is not yet synced
            # (and not in a segment whose sync failed) it is in this segment.
            assert seg is not None
            os.fdatasync(seg.fd)
            with self._lock:
                self._synced = max(self._synced, target)

    def _rotate(self, only: _Segment | None = None) -> None:
        """Close the active segment (if it has rows, and is `only` when given) for conversion."""
        with self._sync_lock, self._lock:
            seg = self._active
            if seg is None or seg.rows == 0 or (only is not None and seg is not only):
                return
            if self.fsync:
                os.fdatasync(seg.fd)
                self._synced = self._written
            self._active = None
            self._pending.append(seg)

    def _convert_pending(self, *, raise_errors: bool) -> int:
        converted = 0
        with self._convert_lock:
            while True:
                with self._lock:
                    if not self._pending:
                        return converted
                    seg = self._pending[0]
                try:
                    rows = convert_segment(seg.path, self.schema, self.table_dir, seg.id, fsync=self.fsync,
                                           longest_line=seg.longest_line, n_rows=seg.rows)
                    _drop_segment(seg.path, self.wal_dir, self.fsync)
                except Exception:
                    if raise_errors:
                        raise
                    log.exception("converting %s segment %s failed; will retry", self.table, seg.id)
                    return converted
                with self._lock:
                    self._pending.popleft()
                with self._sync_lock:  # an fsync that picked this segment before it was retired is done
                    os.close(seg.fd)
                converted += rows

    def _run(self) -> None:
        next_recover = time.monotonic() + self.recover_interval_s
        while not self._stop.is_set():
            # asleep until the active segment is due, a failed conversion is retried, or (an idle table)
            # the next recovery: idle logs must not wake twice a second, each wake takes the GIL from
            # the serving threads
            seg = self._active  # a glance without the lock: _rotate checks again under it
            due = next_recover if seg is None else min(next_recover, seg.opened_at + self.flush_interval_s)
            if self._pending:
                due = min(due, time.monotonic() + self.flush_interval_s)
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                seg = self._active
                if seg is not None and time.monotonic() - seg.opened_at >= self.flush_interval_s:
                    self._rotate(only=seg)
                self._convert_pending(raise_errors=False)
                if time.monotonic() >= next_recover:
                    next_recover = time.monotonic() + self.recover_interval_s
                    self.recover()
            except Exception:  # the thread must survive a full disk; appends still go to the WAL
                log.exception("background conversion of %s failed", self.table)


def _drop_segment(path: Path, wal_dir: Path, fsync: bool) -> None:
    """Delete a converted segment (a seam of its own, so tests can kill the process right before it)."""
    path.unlink()
    if fsync:
        fsync_path(wal_dir)


def _write_all(seg: _Segment, payload: bytes) -> None:
    """Append payload to the segment; on failure cut the file back so no torn line stays mid-file."""
    view = memoryview(payload)
    done = 0
    try:
        while done < len(view):  # one os.write in practice; a short write only on a full disk
            done += os.write(seg.fd, view[done:])
    except BaseException:
        try:
            os.ftruncate(seg.fd, seg.nbytes)  # O_APPEND: the next write lands at the new end
        except OSError:  # the caller retires the segment, so a torn tail stays its last line
            log.exception("could not cut a failed write back from %s", seg.path)
        raise  # the write's own error (EFBIG, ENOSPC, EIO), not the truncate's


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # gone: nothing to recover


def _lock_orphan(path: Path) -> int | None:
    """Open and lock a segment whose writer is gone; None if it is live or already gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(path)  # replayed and deleted by someone else meanwhile
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    return fd
