"""Query results as text or files for ``clawrl sql``: csv, json, parquet, and one cell as plain text."""

from __future__ import annotations

import csv
import io
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

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
