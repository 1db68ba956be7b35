"""The store: every clawrl table under ``<data_root>/tables/``, one ``TableLog`` each (storage/wal.py).

``DataStore.append`` refuses a record whose values would not fit their columns before anything
is written: the WAL then holds only rows that convert, and a bad record fails its caller instead
of landing in ``_rejected/`` later. ``check_data_root`` proves a data root writable before a
server starts (``DataStore`` runs it too) and raises ``DataRootError`` naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import math
import operator
import os
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from clawrl.storage.schemas import TABLE_OF_RECORD, TABLES, arrow_field
from clawrl.storage.wal import TableLog

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
        with open(probe, "xb", buffering=0) as f:  # unbuffered: one write(2), whose count tells a short write
            if f.write(_PROBE) != len(_PROBE):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        raise DataRootError(f"data root {root} is not writable: cannot write {probe}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return tables


class DataStore:
    """Every clawrl table under ``<data_root>/tables/``; append any ``clawrl.records`` record.

    Thread-safe; several processes may open the same data root. Append is cheap enough to call
    inline from an asyncio handler (p50 ~13 us for a 264-token turn on 2 loaded cores; see
    clawrl/bench/storage.py).
    """

    def __init__(self, data_root: str | os.PathLike, *, fsync: bool = False,
                 flush_interval_s: float = 0.5, flush_rows: int = 50_000,
                 background: bool = True) -> None:
        self.data_root = Path(data_root)
        self.tables_dir = check_data_root(self.data_root)
        self._logs: dict[str, TableLog] = {}
        self._checks = {spec.record_type: _record_check(spec.schema) for spec in TABLES.values()}
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
        field that would not fit its column (wrong type, None in a required column, naive
        datetime, NaN/inf), before anything is written. Rows of one table go in one write; a mixed
        list is one write per table.
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
                raise TypeError(f"cannot store {type(record).__name__}; records: "
                                + ", ".join(t.__name__ for t in TABLE_OF_RECORD))
            self._check(record)
            by_table.setdefault(table, []).append(record)
        return sum(self._logs[table].append(rows) for table, rows in by_table.items())

    def flush(self) -> int:
        """Make every appended row visible to readers now; return the rows converted."""
        return sum(log_.flush() for log_ in self._logs.values())

    def recover(self) -> int:
        return sum(log_.recover() for log_ in self._logs.values())

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
        values, columns = self._checks[type(record)]
        for value, (name, fits, nullable, type_) in zip(values(record), columns):
            if not (fits(value) or (nullable and value is None)):
                raise ValueError(f"{type(record).__name__}.{name} = {value!r:.80} does not fit column type {type_}")


# What fits a column, tested in Python: converting a record with pyarrow costs ~30-60 us, more than
# a whole append (~13 us). Summing a list of ids or log-probs costs ~1 us for 200 and tells what
# matters: a None or str item makes it raise, a float item turns an int sum into a float, a NaN or
# inf item makes a float sum non-finite. What these checks cannot see (an id >= 2**31) fails at
# conversion instead, where the row is set aside in _rejected/.
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sum(v: Any) -> Any:
    try:
        return sum(v) if isinstance(v, (list, tuple)) else None
    except TypeError:
        return None


# Keyed by the column type of each annotation the schema rules know (None is checked by the caller).
_FITS: dict[pa.DataType, Callable[[Any], bool]] = {arrow_field("", annotation).type: fits for annotation, fits in {
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
    int: _is_int,
    float: _is_finite,
    datetime: lambda v: isinstance(v, datetime) and v.utcoffset() is not None,  # naive: which zone?
    list[int]: lambda v: _is_int(_sum(v)),
    list[float]: lambda v: _is_finite(_sum(v)),
    list[str]: lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    list[int | None]: lambda v: isinstance(v, (list, tuple)) and all(x is None or _is_int(x) for x in v),
    list[list[int]]: lambda v: isinstance(v, (list, tuple)) and all(_is_int(_sum(row)) for row in v),
    list[list[float]]: lambda v: isinstance(v, (list, tuple)) and all(_is_finite(_sum(row)) for row in v),
}.items()}


def _record_check(schema: pa.Schema) -> tuple[Callable[[Any], tuple], list[tuple[str, Callable, bool, pa.DataType]]]:
    """A getter of every field's value at once, and (name, fits, nullable, type) of each column."""
    names = schema.names
    values = operator.attrgetter(*names) if len(names) > 1 else (lambda r, n=names[0]: (getattr(r, n),))
    return values, [(f.name, _FITS[f.type], f.nullable, f.type) for f in schema]
