"""A closed write-ahead-log segment (storage/wal.py) becomes immutable Parquet files, exactly once.

``<table>/date=YYYY-MM-DD/part-<segment-id>.parquet`` holds the segment's rows of that UTC date of
``created_at``; ``<table>/_rejected/<segment-id>.jsonl`` its rows that did not fit the schema.
Each file is written under a temp name that the readers' glob (``date=*/*.parquet``) does not
match and ``os.replace``d into place, so a reader never sees a partial file. Files are never
rewritten: the name is derived from the segment id and a date whose file exists is skipped, so
converting a segment again after a crash at any point adds each row once.

Parsing: a segment of ``DUCKDB_MIN_BYTES`` or more goes through DuckDB's JSON reader (~9 vs ~25 us
of CPU per 3.5 KB turn), a smaller one through pyarrow's (a DuckDB query costs ~5 ms however
small). DuckDB is lenient where pyarrow is strict (it ignores unknown keys and casts 2.5 into an
INTEGER), which is safe because ``DataStore.append`` checks values before the WAL; the row count
and the nulls that both let through are checked after either. A segment that does not parse goes
through the same parser line by line: good rows are converted, misfits kept in ``_rejected/``.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from clawrl.storage.schemas import PARTITION_SOURCE, duckdb_type

log = logging.getLogger(__name__)

REJECTED_DIR = "_rejected"
DUCKDB_MIN_BYTES = 1 << 20
_MIB = 1 << 20
_TMP_SUFFIX = ".tmp"  # Parquet being written; "*.parquet" globs never match it
_PARSE_ERRORS = (duckdb.Error, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


def convert_segment(path: Path, schema: pa.Schema, table_dir: Path, segment_id: str, *,
                    fsync: bool = False, longest_line: int | None = None,
                    n_rows: int | None = None) -> int:
    """Turn one closed WAL segment into ``date=*/part-<segment_id>.parquet`` files under table_dir;
    return the rows now in Parquet (including rows whose file already existed).

    The caller owns the segment (holds its lock). Idempotent: a date whose file exists is skipped.
    `longest_line` (bytes) and `n_rows` come from the writer; recovery leaves them out and they
    are measured.
    """
    torn = _cut_torn_tail(path)
    if torn:
        log.warning("%s segment %s: cut %d bytes of an unterminated last line (never acknowledged)",
                    table_dir.name, segment_id, torn)
    size = path.stat().st_size
    if size == 0:
        return 0
    if torn or n_rows is None:
        n_rows = path.read_bytes().count(b"\n")
    try:
        table = _parse(path, schema, n_rows, longest_line or size)
    except _PARSE_ERRORS as e:
        log.error("%s segment %s does not parse as a whole (%s); parsing line by line", table_dir.name, segment_id, e)
        table, rejected = _parse_lines(path.read_bytes(), schema)
        if rejected:
            kept = table_dir / REJECTED_DIR / f"{segment_id}.jsonl"
            _publish(kept, fsync, lambda tmp: tmp.write_bytes(b"".join(orjson.dumps(
                {"error": err, "line": line.decode("utf-8", "replace")}, option=orjson.OPT_APPEND_NEWLINE)
                for line, err in rejected)))
            log.error("%d rows did not fit the schema; kept in %s", len(rejected), kept)
    if table.num_rows:
        dates = pc.cast(table[PARTITION_SOURCE], pa.date32())  # tz-aware timestamps are UTC inside
        days = sorted(pc.unique(dates).to_pylist())
        for day in days:
            final = table_dir / f"date={day.isoformat()}" / f"part-{segment_id}.parquet"
            if final.exists():
                continue  # written before a crash; the name says it holds exactly these rows
            rows = table if len(days) == 1 else table.filter(pc.equal(dates, pa.scalar(day, pa.date32())))
            _publish(final, fsync, lambda tmp: pq.write_table(rows, tmp, compression="zstd"))
    return table.num_rows


def _parse(source: Path | bytes, schema: pa.Schema, n_rows: int, longest_line: int) -> pa.Table:
    """`n_rows` JSON lines (a segment file, or the bytes of one line) as a table of `schema`."""
    if isinstance(source, Path) and source.stat().st_size >= DUCKDB_MIN_BYTES:
        with _duckdb_lock:
            table = _conversion_connection().read_json(
                str(source), format="newline_delimited", records="true",
                columns={f.name: duckdb_type(f.type) for f in schema},
                maximum_object_size=max(16 * _MIB, longest_line + 1),
            ).to_arrow_table()
    else:
        table = pajson.read_json(
            pa.BufferReader(source if isinstance(source, bytes) else source.read_bytes()),
            read_options=pajson.ReadOptions(block_size=max(_MIB, longest_line + 1)),  # a block holds whole lines
            parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"),
        )
    if table.num_rows != n_rows:
        raise pa.ArrowInvalid(f"{n_rows} lines gave {table.num_rows} rows")
    for f in schema:  # neither reader enforces a non-nullable field
        column = table[f.name]
        if not f.nullable and column.null_count:
            raise pa.ArrowInvalid(f"required column {f.name!r} has nulls")
        if pa.types.is_list(f.type) and not f.type.value_field.nullable and pc.list_flatten(column).null_count:
            raise pa.ArrowInvalid(f"column {f.name!r} has null items")
    return table.select(schema.names).cast(schema)


def _parse_lines(body: bytes, schema: pa.Schema) -> tuple[pa.Table, list[tuple[bytes, str]]]:
    """The slow path: parse each line alone. Good rows are kept; misfits are returned with their error."""
    good: list[pa.Table] = []
    rejected: list[tuple[bytes, str]] = []
    for line in body.splitlines(keepends=True):
        try:
            good.append(_parse(line, schema, 1, len(line)))
        except _PARSE_ERRORS as e:
            rejected.append((line, str(e)))
    return (pa.concat_tables(good) if good else schema.empty_table()), rejected


_duckdb_lock = threading.Lock()
_duckdb_con: tuple[int, duckdb.DuckDBPyConnection] | None = None  # (pid, connection), made on first use


def _conversion_connection() -> duckdb.DuckDBPyConnection:
    """This process's one DuckDB connection for conversion (opening one costs ~20-40 ms)."""
    global _duckdb_con
    if _duckdb_con is None or _duckdb_con[0] != os.getpid():  # a forked child must not share its parent's
        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")  # a conversion over 2 s would draw one on the terminal
        _duckdb_con = (os.getpid(), con)
    return _duckdb_con[1]


def _cut_torn_tail(path: Path) -> int:
    """Truncate an unterminated last line (a write cut short by a crash); return the bytes cut."""
    with path.open("rb+") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            end = m.rfind(b"\n") + 1  # reads only the pages of the last line
        if end < size:
            f.truncate(end)
        return size - end


def _publish(final: Path, fsync: bool, write: Callable[[Path], Any]) -> None:
    """Have `write` fill a temp file, then rename it to `final`: readers never see a partial file."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + _TMP_SUFFIX)  # deterministic: a replay overwrites a crashed attempt
    write(tmp)
    if fsync:
        fsync_path(tmp)
    _replace(tmp, final)
    if fsync:
        fsync_path(final.parent)
        fsync_path(final.parent.parent)


def _replace(tmp: Path, final: Path) -> None:
    """The publication step, a seam of its own so tests can kill the process right before or after it."""
    os.replace(tmp, final)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory so that a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
