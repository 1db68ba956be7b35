"""DuckDB over the Parquet tables: a view per table for ad-hoc SQL and for storage/queries.py, and
the export of a result for ``clawrl sql`` (csv, json, parquet).

The catalog is an in-memory DuckDB: a ``.duckdb`` file would let only one process open it, while
any number of readers can read Parquet next to the writers, and they only ever see complete files
(storage/convert.py). ``open_catalog`` hands out a cursor of one connection per process and data
root, whose views are defined once and again only when a table gained its first file or lost its
last: defining them reads every file's footer, ~0.1-0.3 s that each of the flows' tasks paid
before. ``run_query`` and read-only catalogs use a connection of their own.

Every view exists on an empty data root (empty, with its columns). A view's columns are its
record's fields (``clawrl.records`` documents each) plus ``date`` (DATE), the UTC date of
``created_at`` from the hive directory ``date=YYYY-MM-DD``: filtering on it skips whole
directories. Times are TIMESTAMP WITH TIME ZONE (UTC), id lists INTEGER[], log-prob lists DOUBLE[]
(exact engine values), judge votes INTEGER[] (NULL = an unparseable vote); the text fields that
hold JSON (request_messages, tool_calls, messages, raw_outputs, ...) are JSON text.

``turns``, ``next_states``, ``turn_fate``, ``batches``, ``checkpoints``, ``syncs``, ``evaluations``,
``promotions``, ``adapters``, ``adapter_serving``: every row written (``TurnRecord``, ``NextStateRecord``,
``FateRecord``, ``BatchRecord``, ``CheckpointRecord``, ``SyncRecord``, ``EvaluationRecord``, ``PromotionRecord``,
``AdapterRecord``, ``AdapterServeRecord``). ``verdicts``: the judge's verdicts (``JudgeVerdict``), one per
(turn_id, judge_config_hash): the newest, i.e. the one of the attempt that wrote the fate (an
attempt killed before its fate is judged again). ``verdict_attempts``: every verdict ever
written. ``samples`` (``SampleRecord``): one row per sample_id, the newest write.

A view is bound to the files at query time, so a long-lived connection sees new files, except
that a table with no file at all when the connection was opened stays an empty view until
``refresh_views`` (DuckDB cannot glob a pattern that matches nothing).
"""
from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from clawrl.storage.schemas import TABLES, duckdb_type

# view name -> table directory under <data_root>/tables/: a view per table under its name, and the verdicts
# table a second time, whole (``verdicts`` shows the newest verdict per turn and judge config)
VIEWS: dict[str, str] = {t: t for t in TABLES} | {"verdict_attempts": "verdicts"}

# Views over the table views, for ``clawrl doctor`` and anyone's SQL. turn_outcomes: one row per
# (turn, judge config), the turn's newest fate with what the turn and its verdict say;
# learning_by_version: the judged score of live main turns by the weight version that served them
# (n, mean, a normal 95% interval clipped to the scores' range -1..1), per judge config.
DERIVED_VIEWS: dict[str, str] = {
    "turn_outcomes": """
        WITH f AS (SELECT * EXCLUDE (date) FROM turn_fate
                   QUALIFY row_number() OVER (PARTITION BY turn_id, judge_config_hash ORDER BY created_at DESC) = 1),
        t AS (SELECT * EXCLUDE (date) FROM turns
              QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1)
        SELECT f.judge_config_hash, f.turn_id, t.session_id, t.turn_index, t.turn_type, t.weight_version,
               f.fate, f.detail, j.score, j.score_reason, j.votes, j.hint IS NOT NULL AS has_hint,
               j.hint_raw_outputs IS NOT NULL AS hint_asked, j.error AS judge_error, t.created_at
        FROM f JOIN t USING (turn_id) LEFT JOIN verdicts j USING (turn_id, judge_config_hash)""",
    "learning_by_version": """
        SELECT judge_config_hash, weight_version,
               try_cast(regexp_extract(weight_version, '(\\d+)$', 1) AS BIGINT) AS version_number,
               count(*) AS n, avg(score) AS mean_score,
               greatest(-1, avg(score) - 1.96 * coalesce(stddev_samp(score), 0) / sqrt(count(*))) AS ci_low,
               least(1, avg(score) + 1.96 * coalesce(stddev_samp(score), 0) / sqrt(count(*))) AS ci_high
        FROM turn_outcomes WHERE turn_type = 'main' AND score IS NOT NULL AND judge_error IS NULL
        GROUP BY ALL ORDER BY judge_config_hash, version_number, weight_version""",
}

# Views that show one row per key, the newest write: a judge attempt cut short by a crash before
# its fate was written is re-run, and the re-run's verdict and sample supersede the first ones
# (the fate, written last, belongs to the newest). The superseded rows stay in the files.
LATEST_BY: dict[str, str] = {
    "verdicts": "turn_id, judge_config_hash",
    "samples": "sample_id",
}


def sql_str(text: str) -> str:
    """`text` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


# resolved data root -> (its connection, the tables that had files when its views were defined)
_shared: dict[str, tuple[duckdb.DuckDBPyConnection, frozenset[str]]] = {}
_shared_lock = threading.Lock()
_inherited: list[Any] = []  # a forked child's copies of its parent's connections: never used, never closed


def _forget_parent_connections() -> None:
    _inherited.extend(_shared.values())
    _shared.clear()


os.register_at_fork(after_in_child=_forget_parent_connections)


def _tables_with_files(data_root: str | os.PathLike) -> frozenset[str]:
    tables = Path(data_root) / "tables"
    return frozenset(t for t in set(VIEWS.values()) if any((tables / t).glob("date=*/*.parquet")))


def _connect(config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:", config=config or {})
    con.execute("SET enable_progress_bar = false")  # it would be drawn into `clawrl sql --format csv` output
    return con


def _shared_cursor(data_root: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """A cursor of this process's connection for ``data_root``, its views current (module docstring)."""
    key, with_files = str(Path(data_root).resolve()), _tables_with_files(data_root)
    with _shared_lock:
        con, defined_for = _shared.get(key, (None, None))
        if con is None:
            con = _connect()
        if defined_for != with_files:
            refresh_views(con, data_root)
            _shared[key] = (con, with_files)
        return con.cursor()


@contextlib.contextmanager
def open_catalog(data_root: str | os.PathLike, *, read_only: bool = False,
                 private: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """A DuckDB connection with the views above over ``<data_root>/tables/``, closed on exit: a cursor
    of this process's shared connection (module docstring), or with ``private`` or ``read_only`` a
    connection of its own, for statements that change the connection (SET, CREATE, ...).

    ``read_only``: after the views are defined, DuckDB may only open paths under
    ``<data_root>/tables/`` (``allowed_directories`` + ``enable_external_access = false``: no
    reading /etc/passwd, no ATTACH, no INSTALL/LOAD of extensions), never spills to a temp
    directory, and the configuration is locked so a ``SET`` cannot undo any of it. DuckDB cannot
    tell reads from writes inside an allowed directory, so ``run_query`` checks the statements
    too (``check_read_only``).
    """
    if not (read_only or private):
        cur = _shared_cursor(data_root)
        try:
            yield cur
        finally:
            cur.close()
        return
    config = {"temp_directory": "", "autoinstall_known_extensions": False,
              "autoload_known_extensions": False} if read_only else {}
    with _connect(config) as con:
        refresh_views(con, data_root)
        if read_only:
            con.execute(f"SET allowed_directories = [{sql_str(str(Path(data_root) / 'tables') + os.sep)}]")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
        yield con


def refresh_views(con: duckdb.DuckDBPyConnection, data_root: str | os.PathLike) -> None:
    """(Re)define every view; a table that has gained its first file since the last call now shows it."""
    for view, table in VIEWS.items():
        table_dir = Path(data_root) / "tables" / table
        if any(table_dir.glob("date=*/*.parquet")):
            pattern = sql_str(str(table_dir / "date=*" / "*.parquet"))
            # union_by_name: files written before a column was added read it as NULL.
            latest = (f" QUALIFY row_number() OVER (PARTITION BY {LATEST_BY[view]} ORDER BY created_at DESC) = 1"
                      if view in LATEST_BY else "")
            con.execute(
                f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet({pattern}, "
                "hive_partitioning = true, hive_types = {'date': DATE}, union_by_name = true)" + latest
            )
        else:
            # Typed NULLs, not a registered Arrow table: con.register imports pandas (~2 s).
            columns = [f"NULL::{duckdb_type(f.type)} AS {f.name}" for f in TABLES[table].schema]
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT {', '.join(columns)}, NULL::DATE AS date WHERE false")
    for view, sql in DERIVED_VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")


class ReadOnlyQueryError(ValueError):
    """A statement other than a query was sent to a read-only catalog."""


_EXPLAIN = re.compile(r"^\s*explain\s+(?:analy[sz]e\s+)?(?:\([^)]*\)\s*)?(.*)$", re.IGNORECASE | re.DOTALL)


def check_read_only(sql: str) -> None:
    """Raise ``ReadOnlyQueryError`` unless every statement in ``sql`` is a query (SELECT, WITH,
    FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, or EXPLAIN of one). COPY, EXPORT, CREATE, INSERT,
    ATTACH, INSTALL, LOAD, SET, PRAGMA and CALL are refused; so is EXPLAIN ANALYZE COPY, which would
    run the COPY. A statement DuckDB cannot parse passes, so DuckDB reports the syntax error itself."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return
    for st in statements:
        kind = st.type
        if kind == duckdb.StatementType.EXPLAIN:
            m = _EXPLAIN.match(st.query.strip().rstrip(";"))
            try:
                inner = duckdb.extract_statements(m.group(1)) if m else []
            except duckdb.Error:
                inner = []
            if inner and all(s.type == duckdb.StatementType.SELECT for s in inner):
                continue
        elif kind == duckdb.StatementType.SELECT:
            continue
        name = (st.query.split() or [kind.name])[0].upper()  # INSTALL, not DuckDB's LOAD_STATEMENT
        raise ReadOnlyQueryError(f"the catalog is read-only: {name} statements are not allowed, only queries "
                                 "(SELECT ...); to save a result use --format csv|json|parquet --out FILE")


def run_query(data_root: str | os.PathLike, sql: str, *, read_only: bool = False) -> pa.Table:
    """Run SQL over the views in a fresh in-memory DuckDB and return the result.

    ``read_only`` (what ``clawrl sql`` uses): queries only, on a read-only catalog; anything else
    raises ``ReadOnlyQueryError`` before it runs. Otherwise nothing here writes the data root,
    though DuckDB's own COPY/EXPORT are not blocked. Raises ``duckdb.Error`` with DuckDB's message
    for a bad query. A statement with no result (SET, CREATE ...) returns an empty table. Columns of
    one name are renamed apart (``unique_names``).
    """
    if read_only:
        check_read_only(sql)
    with open_catalog(data_root, read_only=read_only, private=True) as con:
        rel = con.sql(sql)
        table = rel.to_arrow_table() if rel is not None else pa.table({})
    return table.rename_columns(unique_names(table.column_names))


def unique_names(names: list[str]) -> list[str]:
    """Column names made unique as DuckDB names a table's columns (``a, a, a_1`` -> ``a, a_1, a_1_1``,
    compared without case): a result with two columns of one name, as a join may give, would otherwise
    show one column's value under the other's name wherever rows are read as dicts (csv, json, the table)."""
    seen: set[str] = set()
    out = []
    for name in names:
        new, n = name, 0
        while new.lower() in seen:
            n += 1
            new = f"{name}_{n}"
        seen.add(new.lower())
        out.append(new)
    return out


EXPORT_FORMATS = ("csv", "json", "parquet")


def export_table(table: pa.Table, fmt: str, out: str | os.PathLike | None = None) -> str | None:
    """Write a query result as csv / json / parquet to `out`, or return csv / json text.

    csv: one header row; lists as JSON arrays, timestamps ISO 8601. json: one array of row
    objects. parquet: needs `out`.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(EXPORT_FORMATS)}")
    if fmt == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file")
        pq.write_table(table, out)
        return None
    rows = table.to_pylist()
    if fmt == "json":
        text = orjson.dumps(rows, default=_json_default,
                            option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE).decode()
    else:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([("" if v is None else format_cell(v)) for v in row.values()] for row in rows)
        text = buf.getvalue()
    if out is None:
        return text
    Path(out).write_text(text)
    return None


def format_cell(value: Any) -> str:
    """One value as plain text: lists and dicts as JSON, None as NULL."""
    if value is None:
        return "NULL"
    if isinstance(value, (list, dict)):
        return orjson.dumps(value, default=_json_default).decode()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):  # DuckDB's sum() of integers is a HUGEINT -> decimal128
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
