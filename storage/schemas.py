"""One pyarrow schema per table: the on-disk shape of every record in ``clawrl.records``.

Each schema lists the dataclass's fields in declaration order, with these types:

- ``str`` -> ``string`` (not null); ``str | None`` -> nullable ``string``; ``bool`` -> ``bool``;
  ``int`` -> ``int64``; ``float`` -> ``float64``; ``datetime`` -> ``timestamp[us, UTC]``;
  ``X | None`` -> the same type, nullable.
- ``list[int]`` (token ids) -> ``list<int32 not null>``: vocabularies are far below 2**31, and
  int32 halves the in-memory size of the largest columns. ``list[int | None]`` (judge votes) ->
  ``list<int32>`` with nullable items. ``list[str]`` -> ``list<string not null>``.
- ``list[float]`` (every one of them is a log-prob list) -> ``list<float64 not null>``, not float32. The PPO
  ratio is ``exp(logprobs - rollout_logprobs)``, so storage must give back exactly what the engine
  returned. float32 does not: its spacing is 2**-19 ~ 1.9e-6 for |x| in [16, 32), so a log-prob
  of -20 could move by ~1e-6, and sampled tokens at temperature 1 do reach -20. float64 holds any
  Python float exactly, and costs 4 extra bytes per generated token (~256 B for a 64-token
  output, before compression).

Hive partitioning adds a ``date`` column (``DATE``, the UTC date of ``created_at``) in the
directory name, not in the files. ``tests/storage/test_schemas.py`` checks every dataclass field
against its column, so a field added to a record without a schema change here fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from clawrl.records import (
    BatchRecord,
    CheckpointRecord,
    FateRecord,
    JudgeVerdict,
    NextStateRecord,
    SampleRecord,
    SyncRecord,
    TurnRecord,
)

TIMESTAMP = pa.timestamp("us", tz="UTC")
# List items are required (the JSON reader then rejects a null id or log-prob); only judge votes
# have nullable items, a None vote being an unparseable judge reply.
TOKEN_IDS = pa.list_(pa.field("item", pa.int32(), nullable=False))
LOGPROBS = pa.list_(pa.field("item", pa.float64(), nullable=False))
STRINGS = pa.list_(pa.field("item", pa.string(), nullable=False))
VOTES = pa.list_(pa.field("item", pa.int32(), nullable=True))

# The column every table is partitioned by (its UTC date becomes the hive ``date=`` directory).
PARTITION_SOURCE = "created_at"


def _required(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


def _optional(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=True)


TURNS = pa.schema([
    _required("turn_id", pa.string()),
    _required("session_id", pa.string()),
    _required("turn_index", pa.int64()),
    _required("turn_type", pa.string()),
    _required("namespace", pa.string()),
    _required("model", pa.string()),
    _required("weight_version", pa.string()),
    _required("request_messages", pa.string()),
    _optional("request_tools", pa.string()),
    _required("request_params", pa.string()),
    _required("prompt_ids", TOKEN_IDS),
    _required("output_ids", TOKEN_IDS),
    _required("rollout_logprobs", LOGPROBS),
    _required("text", pa.string()),
    _optional("tool_calls", pa.string()),
    _required("finish_reason", pa.string()),
    _required("created_at", TIMESTAMP),
    _required("completed_at", TIMESTAMP),
    _required("latency_ms", pa.float64()),
    _required("weight_versions", pa.string()),
])

NEXT_STATES = pa.schema([
    _required("turn_id", pa.string()),
    _required("session_id", pa.string()),
    _required("turn_index", pa.int64()),
    _required("has_next_state", pa.bool_()),
    _optional("messages", pa.string()),
    _required("reason", pa.string()),
    _required("created_at", TIMESTAMP),
])

VERDICTS = pa.schema([
    _required("turn_id", pa.string()),
    _required("judge_config_hash", pa.string()),
    _required("judge_backend", pa.string()),
    _required("score", pa.int64()),
    _required("score_reason", pa.string()),
    _required("votes", VOTES),
    _required("raw_outputs", pa.string()),
    _optional("hint", pa.string()),
    _optional("hint_raw_outputs", pa.string()),
    _optional("error", pa.string()),
    _required("created_at", TIMESTAMP),
])

SAMPLES = pa.schema([
    _required("sample_id", pa.string()),
    _required("turn_id", pa.string()),
    _required("session_id", pa.string()),
    _required("judge_config_hash", pa.string()),
    _required("method", pa.string()),
    _required("prompt_ids", TOKEN_IDS),
    _required("output_ids", TOKEN_IDS),
    _required("rollout_logprobs", LOGPROBS),
    _required("reward", pa.float64()),
    _required("has_teacher", pa.bool_()),
    _optional("teacher_logprobs", LOGPROBS),
    _required("weight_version", pa.string()),
    _required("created_at", TIMESTAMP),
])

TURN_FATE = pa.schema([
    _required("turn_id", pa.string()),
    _required("session_id", pa.string()),
    _required("judge_config_hash", pa.string()),
    _required("fate", pa.string()),
    _required("detail", pa.string()),
    _required("created_at", TIMESTAMP),
])

BATCHES = pa.schema([
    _required("batch_id", pa.string()),
    _required("step", pa.int64()),
    _required("sample_ids", STRINGS),
    _required("session_ids", STRINGS),
    _required("method", pa.string()),
    _required("config_hash", pa.string()),
    _required("parent_version", pa.string()),
    _required("created_at", TIMESTAMP),
])

CHECKPOINTS = pa.schema([
    _required("weight_version", pa.string()),
    _required("step", pa.int64()),
    _required("batch_id", pa.string()),
    _required("parent_version", pa.string()),
    _required("path", pa.string()),
    _required("sha256", pa.string()),
    _optional("mlflow_run_id", pa.string()),
    _required("created_at", TIMESTAMP),
])

SYNCS = pa.schema([
    _required("sync_id", pa.string()),
    _required("weight_version", pa.string()),
    _required("target", pa.string()),
    _required("ok", pa.bool_()),
    _required("skipped", pa.bool_()),
    _optional("error", pa.string()),
    _optional("serving_version", pa.string()),
    _optional("checkpoint_path", pa.string()),
    _optional("mlflow_run_id", pa.string()),
    _required("started_at", TIMESTAMP),
    _required("seconds", pa.float64()),
    _required("created_at", TIMESTAMP),
])


@dataclass(frozen=True)
class TableSpec:
    """A table on disk: its directory name, the record it stores and its Parquet schema."""

    name: str
    record_type: type
    schema: pa.Schema


TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        TableSpec("turns", TurnRecord, TURNS),
        TableSpec("next_states", NextStateRecord, NEXT_STATES),
        TableSpec("verdicts", JudgeVerdict, VERDICTS),
        TableSpec("samples", SampleRecord, SAMPLES),
        TableSpec("turn_fate", FateRecord, TURN_FATE),
        TableSpec("batches", BatchRecord, BATCHES),
        TableSpec("checkpoints", CheckpointRecord, CHECKPOINTS),
        TableSpec("syncs", SyncRecord, SYNCS),
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
    """The DuckDB type of a column of Arrow type `t` (only the types used above)."""
    if pa.types.is_list(t):
        return duckdb_type(t.value_type) + "[]"
    return _DUCKDB_SCALARS[t]
