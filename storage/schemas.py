"""One pyarrow schema per table, derived from its record dataclass in ``clawrl.records``.

A schema lists the dataclass's fields in declaration order, typed by these rules (any other
annotation raises ``TypeError`` when this module is imported):

- ``str`` -> ``string``; ``bool`` -> ``bool``; ``int`` -> ``int64``; ``float`` -> ``float64``;
  ``datetime`` -> ``timestamp[us, UTC]``; all not null, and ``X | None`` -> the same, nullable.
- ``list[int]`` (token ids) -> ``list<int32 not null>``: vocabularies are far below 2**31, and
  int32 halves the in-memory size of the largest columns. ``list[int | None]`` (judge votes, None
  for an unparseable reply) -> ``list<int32>``. ``list[str]`` -> ``list<string not null>``.
- ``list[float]`` (every one a log-prob list) -> ``list<float64 not null>``, not float32: the PPO
  ratio is ``exp(logprobs - rollout_logprobs)``, so storage must give back exactly what the engine
  returned, and float32's spacing is 2**-19 ~ 1.9e-6 for |x| in [16, 32) (sampled tokens at
  temperature 1 do reach -20). float64 holds any Python float exactly, for 4 more bytes a token.
- ``list[list[X]]`` (top-k rows, one per output token) -> a list of the column ``list[X]`` gets.

Hive partitioning adds a ``date`` column (``DATE``, the UTC date of ``created_at``) in the
directory name, not in the files.
"""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass, fields
from datetime import datetime

import pyarrow as pa

from clawrl import records

TIMESTAMP = pa.timestamp("us", tz="UTC")
# The column every table is partitioned by (its UTC date becomes the hive ``date=`` directory).
PARTITION_SOURCE = "created_at"

_SCALARS: dict[type, pa.DataType] = {
    str: pa.string(), bool: pa.bool_(), int: pa.int64(), float: pa.float64(), datetime: TIMESTAMP,
}
_ITEMS = _SCALARS | {int: pa.int32()}  # list items: token ids and votes


def arrow_field(name: str, annotation: object, scalars: dict[type, pa.DataType] = _SCALARS) -> pa.Field:
    """The column of a record field annotated ``annotation`` (a resolved type, see the rules above)."""
    args = typing.get_args(annotation)
    nullable = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    if nullable and len(args) == 2:
        (annotation,) = [a for a in args if a is not type(None)]
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return pa.field(name, pa.list_(arrow_field("item", item, _ITEMS)), nullable=nullable)
    if annotation not in scalars:
        raise TypeError(f"field {name!r}: no column type for {annotation!r}")
    return pa.field(name, scalars[annotation], nullable=nullable)


def schema_of(record_type: type) -> pa.Schema:
    """The Parquet schema of a record dataclass: one column per field, in declaration order."""
    hints = typing.get_type_hints(record_type)
    return pa.schema([arrow_field(f.name, hints[f.name]) for f in fields(record_type)])


@dataclass(frozen=True)
class TableSpec:
    """A table on disk: its directory name, the record it stores and its Parquet schema."""

    name: str
    record_type: type
    schema: pa.Schema


TABLES: dict[str, TableSpec] = {
    name: TableSpec(name, record_type, schema_of(record_type))
    for name, record_type in (
        ("turns", records.TurnRecord),
        ("next_states", records.NextStateRecord),
        ("verdicts", records.JudgeVerdict),
        ("samples", records.SampleRecord),
        ("turn_fate", records.FateRecord),
        ("batches", records.BatchRecord),
        ("checkpoints", records.CheckpointRecord),
        ("syncs", records.SyncRecord),
        ("evaluations", records.EvaluationRecord),
        ("promotions", records.PromotionRecord),
        ("adapters", records.AdapterRecord),
        ("adapter_serving", records.AdapterServeRecord),
    )
}

TABLE_OF_RECORD: dict[type, str] = {spec.record_type: name for name, spec in TABLES.items()}

_DUCKDB_SCALARS = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    TIMESTAMP: "TIMESTAMPTZ",
}


def duckdb_type(t: pa.DataType) -> str:
    """The DuckDB type of a column of Arrow type `t` (only the types the rules above produce)."""
    if pa.types.is_list(t):
        return duckdb_type(t.value_type) + "[]"
    return _DUCKDB_SCALARS[t]
