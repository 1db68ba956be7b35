"""The append path: a write-ahead log per table, converted into immutable Parquet files.

Layout of one table, ``<root>/<table>/``::

    _wal/<segment-id>.wal                       JSON lines, one per row, from one writer
    date=YYYY-MM-DD/part-<segment-id>.parquet   that segment's rows whose created_at has this UTC date
    _rejected/<segment-id>.jsonl                rows of that segment that did not fit the schema

**Durability point.** ``TableLog.append`` (and ``DataStore.append``) returns only after the rows'
bytes have gone to the segment file in one ``os.write``: that is the acknowledgement. From then on
a ``kill -9`` of the process cannot lose them, because the kernel's page cache holds the bytes and
the next ``recover()`` (run when any writer opens the table, and every ``recover_interval_s`` by
each running writer) converts them. A power loss or kernel crash can still lose what the kernel
had not yet written back (up to ~30 s with default settings) unless ``fsync=True``: then
``append`` also waits for ``fdatasync``, shared by concurrent appenders (group commit: one fsync
covers every write that happened before it started).

**A failed append** (disk full, EFBIG past a file size limit, EIO) raises and is not acknowledged:
a partial write is cut back, and the segment is retired from appends in any case, so if even the
cut failed the torn bytes stay its last line, which conversion drops (``_cut_torn_tail``); the
next append starts a new segment. ``check_data_root`` proves a data root writable before a server
starts (``DataStore`` runs it too) and raises ``DataRootError`` naming the path.

**What readers see.** Only Parquet files, never the WAL. A segment is closed when its first row is
``flush_interval_s`` old (background thread), when it reaches ``flush_rows`` rows or
``flush_bytes`` bytes, or on ``flush()``. It is then converted: each date's rows go to a temp name
that the readers' glob (``date=*/*.parquet``) does not match, and are ``os.replace``d into place,
so a reader never sees a partial file (ref/stack.md section 4). Files are never rewritten.

**Exactly once.** The Parquet name is derived from the segment id, a date whose file already exists
is skipped, and the segment is deleted only after all its files are in place. Replaying a segment
after a crash at any point (before, between or after the renames, before the delete) therefore
adds each row once.

**Several writers.** Each writer has its own segment ids (pid + uuid) and holds an ``flock`` on
every segment it owns until the segment is deleted. ``recover()`` replays only segments whose lock
it can take, i.e. whose writer is dead (the kernel drops a dead process's locks), so processes can
append to one table at the same time and clean up after each other without touching live segments.
This needs ``flock`` semantics (a local filesystem; not NFS, where closing any descriptor of a file
drops its locks). A forked child must open its own store: appending through the parent's raises.

**Conversion** parses a small segment with pyarrow's strict JSON parser and a large one
(``DUCKDB_MIN_BYTES``) with DuckDB's reader, which takes ~2.5x less CPU but is lenient (it ignores
unknown keys and casts 2.5 into an INTEGER); row count and nulls are checked after it. Types are
therefore checked before the WAL: ``DataStore.append`` refuses a record whose values do not fit,
and ``TableLog.append`` trusts its caller. A segment that does not parse goes through pyarrow line
by line: good rows are converted, misfits are kept in ``_rejected/`` with the error, never dropped.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import math
import operator
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from clawrl.storage.schemas import PARTITION_SOURCE, TABLE_OF_RECORD, TABLES, duckdb_type

log = logging.getLogger(__name__)

WAL_DIR = "_wal"
REJECTED_DIR = "_rejected"
SEGMENT_SUFFIX = ".wal"
_NEW_SUFFIX = ".wal.new"  # a segment being created: locked first, then renamed to .wal
# A .wal.new is unlocked for the moment between its creation and its writer's flock: recovery
# removes only ones older than this, so it never deletes a live writer's segment under its feet.
ORPHAN_NEW_AGE_S = 60.0
_TMP_SUFFIX = ".tmp"  # Parquet being written; "*.parquet" globs never match it
_MIB = 1 << 20
_JSON_OPTS = orjson.OPT_APPEND_NEWLINE


@dataclass
class _Segment:
    id: str
    path: Path
    fd: int  # O_WRONLY|O_APPEND, holds the segment's flock until the segment is deleted
    opened_at: float = field(default_factory=time.monotonic)
    rows: int = 0
    nbytes: int = 0
    longest_line: int = 0  # bytes, newline included: the JSON reader's block must hold it


@dataclass(frozen=True)
class ConvertResult:
    rows: int  # rows now in Parquet (including rows whose file already existed)
    files: tuple[Path, ...]  # files written by this call
    rejected: int  # rows set aside in _rejected/
    torn_bytes: int  # bytes of an unterminated last line (a write that was never acknowledged)


class TableLog:
    """An append-only table: rows go to a write-ahead log, then to Parquet (see module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike,
        table: str,
        schema: pa.Schema,
        *,
        flush_rows: int = 50_000,
        flush_bytes: int = 64 * _MIB,
        flush_interval_s: float = 0.5,
        fsync: bool = False,
        recover_interval_s: float = 10.0,
        background: bool = True,
    ) -> None:
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

    # ---------------------------------------------------------------------------- append path

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
                result = convert_segment(path, self.schema, self.table_dir, segment_id, fsync=self.fsync)
                log.info("recovered %d rows of %s from segment %s", result.rows, self.table, segment_id)
                converted += result.rows
                _drop_segment(path, self.wal_dir, self.fsync)
            finally:
                os.close(fd)
        return converted

    # ---------------------------------------------------------------------------- internals

    def _open_segment(self) -> _Segment:
        """Create, lock and publish a new segment (caller holds _lock)."""
        self._seq += 1
        segment_id = f"{self.writer_id}-{self._seq:06d}"
        path = self.wal_dir / f"{segment_id}{SEGMENT_SUFFIX}"
        new = path.with_name(path.name[: -len(SEGMENT_SUFFIX)] + _NEW_SUFFIX)
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
            _fsync_dir(self.wal_dir)
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
                    result = convert_segment(seg.path, self.schema, self.table_dir, seg.id, fsync=self.fsync,
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
                converted += result.rows

    def _run(self) -> None:
        next_recover = time.monotonic() + self.recover_interval_s
        while not self._stop.is_set():
            with self._lock:
                seg = self._active
                due = self.flush_interval_s if seg is None else seg.opened_at + self.flush_interval_s - time.monotonic()
            self._wake.wait(max(due, 0.0))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._lock:
                    seg = self._active
                    is_due = seg is not None and time.monotonic() - seg.opened_at >= self.flush_interval_s
                if is_due:
                    self._rotate(only=seg)
                self._convert_pending(raise_errors=False)
                if time.monotonic() >= next_recover:
                    next_recover = time.monotonic() + self.recover_interval_s
                    self.recover()
            except Exception:  # the thread must survive a full disk; appends still go to the WAL
                log.exception("background conversion of %s failed", self.table)


# -------------------------------------------------------------------------------- conversion


def convert_segment(
    path: Path,
    schema: pa.Schema,
    table_dir: Path,
    segment_id: str,
    *,
    fsync: bool = False,
    longest_line: int | None = None,
    n_rows: int | None = None,
) -> ConvertResult:
    """Turn one closed WAL segment into ``date=*/part-<segment_id>.parquet`` files under table_dir.

    The caller owns the segment (holds its lock). Idempotent: a date whose file exists is skipped,
    so a replay after a crash adds nothing twice. `longest_line` (bytes) and `n_rows` come from
    the writer; recovery leaves them out and they are measured.
    """
    torn = _cut_torn_tail(path)
    if torn:
        log.warning("%s segment %s: cut %d bytes of an unterminated last line (never acknowledged)",
                    table_dir.name, segment_id, torn)
        n_rows = None
    size = path.stat().st_size
    if size == 0:
        return ConvertResult(0, (), 0, torn)
    rejected: list[tuple[bytes, str]] = []
    try:
        if size < DUCKDB_MIN_BYTES:
            table = _parse_strict(path.read_bytes(), schema, longest_line)
        else:
            table = _read_segment(path, schema, longest_line or size, n_rows)
    except (duckdb.Error, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        log.error("%s segment %s does not parse as a whole (%s); parsing line by line", table_dir.name, segment_id, e)
        table, rejected = _parse_lines(path.read_bytes(), schema)
    if rejected:
        _write_rejected(rejected, table_dir / REJECTED_DIR / f"{segment_id}.jsonl", fsync)
    written: list[Path] = []
    if table.num_rows:
        dates = pc.cast(table[PARTITION_SOURCE], pa.date32())  # tz-aware timestamps are UTC inside
        days = sorted(pc.unique(dates).to_pylist())
        for day in days:
            final = table_dir / f"date={day.isoformat()}" / f"part-{segment_id}.parquet"
            if final.exists():
                continue  # written before a crash; the name says it holds exactly these rows
            rows = table if len(days) == 1 else table.filter(pc.equal(dates, pa.scalar(day, pa.date32())))
            _publish_parquet(rows, final, fsync)
            written.append(final)
    return ConvertResult(table.num_rows, tuple(written), len(rejected), torn)


# Below this size pyarrow's parser is cheaper than a DuckDB query's fixed cost (~5 ms); above it
# DuckDB's reader wins (~9 vs ~25 us of CPU per 3.5 KB turn).
DUCKDB_MIN_BYTES = _MIB
_duckdb_lock = threading.Lock()
_duckdb_con: tuple[int, duckdb.DuckDBPyConnection] | None = None  # (pid, connection), made on first use


def _duckdb_query(sql: str) -> pa.Table:
    """Run a query on this process's one conversion connection (opening one costs ~20-40 ms)."""
    global _duckdb_con
    with _duckdb_lock:
        if _duckdb_con is None or _duckdb_con[0] != os.getpid():
            # No progress bar: a conversion taking >2 s would draw one on the gateway's terminal.
            con = duckdb.connect()
            con.execute("SET enable_progress_bar = false")
            _duckdb_con = (os.getpid(), con)
        return _duckdb_con[1].sql(sql).to_arrow_table()


def _read_segment(path: Path, schema: pa.Schema, longest_line: int, n_rows: int | None) -> pa.Table:
    """The fast path for large segments: DuckDB's JSON reader.

    It is lenient where pyarrow is strict (it ignores unknown keys and would truncate 2.5 into an
    INTEGER), so DataStore checks types at append; nulls in required columns or list items, and
    a row count that differs from the line count, are checked here and send the segment down the
    strict line-by-line path.
    """
    columns = ", ".join(f"{_sql_str(f.name)}: {_sql_str(duckdb_type(f.type))}" for f in schema)
    table = _duckdb_query(
        f"SELECT * FROM read_json({_sql_str(str(path))}, format = 'newline_delimited', records = true, "
        f"columns = {{{columns}}}, maximum_object_size = {max(16 * _MIB, longest_line + 1)})"
    )
    if n_rows is None:
        n_rows = path.read_bytes().count(b"\n")
    if table.num_rows != n_rows:
        raise pa.ArrowInvalid(f"{n_rows} lines gave {table.num_rows} rows")
    _check_required(table, schema)
    return table.cast(schema)


def _check_required(table: pa.Table, schema: pa.Schema) -> None:
    for f in schema:
        column = table[f.name]
        if not f.nullable and column.null_count:
            raise pa.ArrowInvalid(f"required column {f.name!r} has nulls")
        if pa.types.is_list(f.type) and not f.type.value_field.nullable and pc.list_flatten(column).null_count:
            raise pa.ArrowInvalid(f"column {f.name!r} has null items")


def _parse_strict(body: bytes, schema: pa.Schema, longest_line: int | None = None) -> pa.Table:
    """pyarrow's parser: rejects unknown keys, nulls where the schema forbids them and values that
    do not convert. Used for small segments and, line by line, for segments that failed."""
    if longest_line is None:
        longest_line = max(map(len, body.splitlines(keepends=True)), default=0)
    table = pajson.read_json(
        pa.BufferReader(body),
        read_options=pajson.ReadOptions(block_size=max(_MIB, longest_line + 1)),  # a block holds whole lines
        parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"),
    )
    n_rows = body.count(b"\n")
    if table.num_rows != n_rows:
        raise pa.ArrowInvalid(f"{n_rows} lines gave {table.num_rows} rows")
    _check_required(table, schema)
    return table.select(schema.names).cast(schema)


def _parse_lines(body: bytes, schema: pa.Schema) -> tuple[pa.Table, list[tuple[bytes, str]]]:
    """The slow path: parse each line alone. Good rows are kept; misfits are returned with their error."""
    good: list[pa.Table] = []
    rejected: list[tuple[bytes, str]] = []
    for line in body.splitlines(keepends=True):
        try:
            good.append(_parse_strict(line, schema, len(line)))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            rejected.append((line, str(e)))
    table = pa.concat_tables(good) if good else schema.empty_table()
    return table, rejected


def _cut_torn_tail(path: Path) -> int:
    """Truncate an unterminated last line (a write cut short by a crash); return the bytes cut."""
    with path.open("rb+") as f:
        size = end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - 64 * 1024)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            f.truncate(end)
        return size - end


def _publish_parquet(table: pa.Table, final: Path, fsync: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + _TMP_SUFFIX)  # deterministic: a replay overwrites a crashed attempt
    pq.write_table(table, tmp, compression="zstd")
    if fsync:
        _fsync_file(tmp)
    _replace(tmp, final)
    if fsync:
        _fsync_dir(final.parent)
        _fsync_dir(final.parent.parent)


def _write_rejected(rejected: list[tuple[bytes, str]], path: Path, fsync: bool) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    tmp.write_bytes(b"".join(orjson.dumps({"error": err, "line": line.decode("utf-8", "replace")},
                                          option=_JSON_OPTS) for line, err in rejected))
    if fsync:
        _fsync_file(tmp)
    _replace(tmp, path)
    log.error("%d rows did not fit the schema; kept in %s", len(rejected), path)


# Two seams, named so tests can simulate a crash right before/after publishing.
def _replace(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)


def _drop_segment(path: Path, wal_dir: Path, fsync: bool) -> None:
    path.unlink()
    if fsync:
        _fsync_dir(wal_dir)


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


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------- the store


_PROBE = b"clawrl write probe\n" * 3450  # ~64 KiB: room for a turn with a long prompt, not just for a byte


class DataRootError(RuntimeError):
    """The data root cannot be created or written; the message names the path and the OS error."""


def check_data_root(data_root: str | os.PathLike) -> Path:
    """Create ``<data_root>/tables/`` if needed and prove it writable with a probe file (created,
    written, removed); return the tables directory. A server calls this before it serves, so a data
    root under a file, on a read-only or full disk, or without permission stops it with one clear
    message instead of failing every turn later. The probe name matches no table glob. The gateway's
    health check runs it again after an append failed, to tell when space has come back."""
    root = Path(data_root)
    tables = root / "tables"
    try:
        tables.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataRootError(f"data root {root} is not usable: cannot create directory {tables}: "
                            f"{e.strerror or e}") from None
    probe = tables / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if os.write(fd, _PROBE) != len(_PROBE):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            os.close(fd)
    except OSError as e:
        raise DataRootError(f"data root {root} is not writable: cannot write {probe}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return tables


class DataStore:
    """Every clawrl table under ``<data_root>/tables/``; append any ``clawrl.records`` record.

    Thread-safe; several processes may open the same data root. Append is cheap enough to call
    inline from an asyncio handler (p50 ~14 us for a 264-token turn on 2 loaded cores; see
    clawrl/bench/storage.py).
    """

    def __init__(
        self,
        data_root: str | os.PathLike,
        *,
        fsync: bool = False,
        flush_interval_s: float = 0.5,
        flush_rows: int = 50_000,
        background: bool = True,
    ) -> None:
        self.data_root = Path(data_root)
        self.tables_dir = check_data_root(self.data_root)
        self._logs: dict[str, TableLog] = {}
        # per record type: a getter of every field's value at once, and each column's check
        self._checks: dict[type, tuple[Callable[[Any], tuple], list[tuple[str, Callable[[Any], bool], pa.DataType]]]] = {}
        for name, spec in TABLES.items():
            names = [f.name for f in fields(spec.record_type)]
            if names != spec.schema.names:
                raise RuntimeError(
                    f"storage/schemas.py is out of date for {spec.record_type.__name__}: record fields "
                    f"{names} vs columns {spec.schema.names}"
                )
            values = operator.attrgetter(*names) if len(names) > 1 else (lambda r, n=names[0]: (getattr(r, n),))
            self._checks[spec.record_type] = (values, [(f.name, _value_check(f), f.type) for f in spec.schema])
        try:
            for name, spec in TABLES.items():
                self._logs[name] = TableLog(
                    self.tables_dir, name, spec.schema, flush_rows=flush_rows,
                    flush_interval_s=flush_interval_s, fsync=fsync, background=background,
                )
        except BaseException:
            self.close()
            raise

    def append(self, records: Any) -> int:
        """Append one record or a list of records (any mix of tables); return the rows written.

        Raises TypeError for an object that is not a clawrl.records record and ValueError for a
        field that would not fit its column (wrong type, naive datetime, NaN/inf), before anything
        is written. Rows of one table go in one write; a mixed list is one write per table.
        """
        if not isinstance(records, (list, tuple)):  # one record (the gateway's turn): no grouping
            table = TABLE_OF_RECORD.get(type(records))
            if table is not None:
                self._check(records)
                return self._logs[table].append((records,))
            records = (records,)
        by_table: dict[str, list[Any]] = {}
        for record in records:
            table = TABLE_OF_RECORD.get(type(record))
            if table is None:
                raise TypeError(
                    f"cannot store {type(record).__name__}; records: "
                    + ", ".join(t.__name__ for t in TABLE_OF_RECORD)
                )
            self._check(record)
            by_table.setdefault(table, []).append(record)
        return sum(self._logs[table].append(rows) for table, rows in by_table.items())

    def flush(self) -> int:
        """Make every appended row visible to readers now; return the rows converted."""
        return sum(log_.flush() for log_ in self._logs.values())

    def recover(self) -> int:
        return sum(log_.recover() for log_ in self._logs.values())

    def table_log(self, table: str) -> TableLog:
        return self._logs[table]

    def close(self) -> None:
        errors = []
        for log_ in self._logs.values():
            try:
                log_.close()
            except Exception as e:  # close the others; their data is safe in the WAL either way
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> DataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, record: Any) -> None:
        values, checks = self._checks[type(record)]
        for value, (name, check, type_) in zip(values(record), checks):
            if not check(value):
                raise ValueError(
                    f"{type(record).__name__}.{name} = {value!r:.80} does not fit column type {type_}"
                )


def _value_check(f: pa.Field) -> Callable[[Any], bool]:
    """A cheap predicate for one column: type of scalars, finiteness of floats, sums of lists.

    Summing a list costs ~1 us for 200 ids and fails on a None or str item, which is cheaper than
    checking each item. Values it cannot see (an id >= 2**31) are caught at conversion instead.
    """
    t = f.type
    if pa.types.is_string(t):
        check: Callable[[Any], bool] = lambda v: isinstance(v, str)
    elif pa.types.is_boolean(t):
        check = lambda v: isinstance(v, bool)
    elif pa.types.is_integer(t):
        check = lambda v: isinstance(v, int) and not isinstance(v, bool)
    elif pa.types.is_floating(t):
        check = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif pa.types.is_timestamp(t):
        check = lambda v: isinstance(v, datetime) and v.utcoffset() is not None
    elif pa.types.is_list(t):
        check = _list_check(t.value_field)
    else:  # pragma: no cover - a schema type without a check is a programming error
        raise TypeError(f"no check for column type {t}")
    if f.nullable:
        return lambda v: v is None or check(v)
    return check


def _list_check(item: pa.Field) -> Callable[[Any], bool]:
    def sums_to(kinds: tuple[type, ...], finite: bool) -> Callable[[Any], bool]:
        def check(v: Any) -> bool:
            if not isinstance(v, (list, tuple)):
                return False
            try:
                total = sum(v)
            except TypeError:
                return False
            return isinstance(total, kinds) and (not finite or math.isfinite(total))
        return check

    if pa.types.is_integer(item.type):
        if item.nullable:  # judge votes: None items allowed, so only the container is checked
            return lambda v: isinstance(v, (list, tuple))
        return sums_to((int,), finite=False)  # a float item makes the sum a float; None raises
    if pa.types.is_floating(item.type):
        return sums_to((int, float), finite=True)  # NaN/inf anywhere makes the sum non-finite
    if pa.types.is_string(item.type):
        return lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
    raise TypeError(f"no check for list<{item.type}>")  # pragma: no cover


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
