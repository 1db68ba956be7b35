"""Every record field has a column of the right type, the derived schemas are exactly the ones on disk, and a
field of a type without a column type fails loudly."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa
import pytest

from clawrl import records
from clawrl.storage import schemas
from clawrl.storage.schemas import TABLES

# Written out independently of storage/schemas.py: annotation text -> the column type it must get.
EXPECTED_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "datetime": pa.timestamp("us", tz="UTC"),
    "list[int]": pa.list_(pa.field("item", pa.int32(), nullable=False)),
    "list[int | None]": pa.list_(pa.field("item", pa.int32(), nullable=True)),
    "list[float]": pa.list_(pa.field("item", pa.float64(), nullable=False)),  # float64: exact logprobs
    "list[str]": pa.list_(pa.field("item", pa.string(), nullable=False)),
    # top-k rows, one per output token
    "list[list[int]]": pa.list_(pa.field("item", pa.list_(pa.field("item", pa.int32(), nullable=False)),
                                         nullable=False)),
    "list[list[float]]": pa.list_(pa.field("item", pa.list_(pa.field("item", pa.float64(), nullable=False)),
                                           nullable=False)),
}

RECORDS = {
    "turns": records.TurnRecord,
    "next_states": records.NextStateRecord,
    "verdicts": records.JudgeVerdict,
    "samples": records.SampleRecord,
    "turn_fate": records.FateRecord,
    "batches": records.BatchRecord,
    "checkpoints": records.CheckpointRecord,
    "syncs": records.SyncRecord,
    "evaluations": records.EvaluationRecord,
    "promotions": records.PromotionRecord,
    "adapters": records.AdapterRecord,
    "adapter_serving": records.AdapterServeRecord,
}


def test_one_table_per_record():
    assert {name: spec.record_type for name, spec in TABLES.items()} == RECORDS


@pytest.mark.parametrize("table", sorted(RECORDS))
def test_every_record_field_has_a_column_of_the_right_type(table):
    schema = TABLES[table].schema
    record_fields = fields(RECORDS[table])
    assert schema.names == [f.name for f in record_fields]  # same columns, same order, nothing extra
    for f in record_fields:
        annotation = str(f.type)  # `from __future__ import annotations`: the source text
        nullable = annotation.endswith(" | None")
        base = annotation.removesuffix(" | None")
        column = schema.field(f.name)
        assert column.type == EXPECTED_TYPES[base], (table, f.name, annotation, column.type)
        assert column.nullable == nullable, (table, f.name, annotation)


def test_every_table_is_partitioned_by_a_utc_timestamp():
    for spec in TABLES.values():
        assert spec.schema.field(schemas.PARTITION_SOURCE).type == pa.timestamp("us", tz="UTC")


def test_a_record_field_without_a_column_type_fails_loudly():
    @dataclass
    class FateWithExtra(records.FateRecord):
        new_field: dict = field(default_factory=dict)

    with pytest.raises(TypeError, match="new_field"):
        schemas.schema_of(FateWithExtra)


# The schemas as they were written out by hand before they were derived from the records: files
# already on disk have exactly these types, nullability, order and list item names.
TIMESTAMP = pa.timestamp("us", tz="UTC")
TOKEN_IDS = pa.list_(pa.field("item", pa.int32(), nullable=False))
LOGPROBS = pa.list_(pa.field("item", pa.float64(), nullable=False))
STRINGS = pa.list_(pa.field("item", pa.string(), nullable=False))
VOTES = pa.list_(pa.field("item", pa.int32(), nullable=True))


def _required(name, type_):
    return pa.field(name, type_, nullable=False)


def _optional(name, type_):
    return pa.field(name, type_, nullable=True)


ON_DISK = {
    "turns": pa.schema([
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
        _optional("adapter", pa.string()),
    ]),
    "next_states": pa.schema([
        _required("turn_id", pa.string()),
        _required("session_id", pa.string()),
        _required("turn_index", pa.int64()),
        _required("has_next_state", pa.bool_()),
        _optional("messages", pa.string()),
        _required("reason", pa.string()),
        _required("created_at", TIMESTAMP),
    ]),
    "verdicts": pa.schema([
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
    ]),
    "samples": pa.schema([
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
        _optional("namespace", pa.string()),
        _optional("ref_logprobs", LOGPROBS),
        _optional("topk_ids", pa.list_(pa.field("item", TOKEN_IDS, nullable=False))),
        _optional("student_topk_logprobs", pa.list_(pa.field("item", LOGPROBS, nullable=False))),
        _optional("teacher_topk_logprobs", pa.list_(pa.field("item", LOGPROBS, nullable=False))),
        _required("created_at", TIMESTAMP),
    ]),
    "turn_fate": pa.schema([
        _required("turn_id", pa.string()),
        _required("session_id", pa.string()),
        _required("judge_config_hash", pa.string()),
        _required("fate", pa.string()),
        _required("detail", pa.string()),
        _required("created_at", TIMESTAMP),
    ]),
    "batches": pa.schema([
        _required("batch_id", pa.string()),
        _required("step", pa.int64()),
        _required("sample_ids", STRINGS),
        _required("session_ids", STRINGS),
        _required("method", pa.string()),
        _required("config_hash", pa.string()),
        _required("parent_version", pa.string()),
        _optional("session_namespaces", STRINGS),
        _optional("source_batch_id", pa.string()),
        _required("created_at", TIMESTAMP),
        _optional("namespace", pa.string()),
    ]),
    "checkpoints": pa.schema([
        _required("weight_version", pa.string()),
        _required("step", pa.int64()),
        _required("batch_id", pa.string()),
        _required("parent_version", pa.string()),
        _required("path", pa.string()),
        _required("sha256", pa.string()),
        _optional("mlflow_run_id", pa.string()),
        _required("created_at", TIMESTAMP),
    ]),
    "syncs": pa.schema([
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
        _optional("workers", EXPECTED_TYPES["list[str]"]),
    ]),
    "evaluations": pa.schema([
        _required("evaluation_id", pa.string()),
        _required("weight_version", pa.string()),
        _required("eval_key", pa.string()),
        _required("scores", pa.list_(pa.field("item", pa.float64(), nullable=False))),
        _required("mean", pa.float64()),
        _required("n", pa.int64()),
        _required("samples", pa.int64()),
        _required("seconds", pa.float64()),
        _required("created_at", TIMESTAMP),
        _optional("namespace", pa.string()),
    ]),
    "promotions": pa.schema([
        _required("promotion_id", pa.string()),
        _required("action", pa.string()),
        _required("weight_version", pa.string()),
        _required("champion_version", pa.string()),
        _required("source", pa.string()),
        _required("reason", pa.string()),
        _optional("eval_key", pa.string()),
        _optional("n", pa.int64()),
        *(_optional(k, pa.float64()) for k in ("candidate_mean", "champion_mean", "mean_diff", "ci_low", "ci_high",
                                               "p_value", "tolerance", "alpha")),
        _optional("mlflow_run_id", pa.string()),
        _required("created_at", TIMESTAMP),
        _optional("eval_set", pa.string()),
        _optional("eval_turn_ids", pa.list_(pa.field("item", pa.string(), nullable=False))),
        _optional("namespace", pa.string()),
    ]),
    "adapters": pa.schema([
        _required("namespace", pa.string()),
        _required("version", pa.int64()),
        _required("name", pa.string()),
        _required("batch_id", pa.string()),
        _required("parent", pa.string()),
        _required("base_version", pa.string()),
        _required("path", pa.string()),
        _required("sha256", pa.string()),
        _required("created_at", TIMESTAMP),
        _optional("mlflow_run_id", pa.string()),
    ]),
    "adapter_serving": pa.schema([
        _required("namespace", pa.string()),
        _required("action", pa.string()),
        _optional("adapter", pa.string()),
        _optional("previous", pa.string()),
        _required("ok", pa.bool_()),
        _optional("error", pa.string()),
        _optional("target", pa.string()),
        _required("seconds", pa.float64()),
        _required("reason", pa.string()),
        _required("created_at", TIMESTAMP),
        _optional("last_version", pa.int64()),
    ]),
}


@pytest.mark.parametrize("table", sorted(ON_DISK))
def test_derived_schemas_are_the_on_disk_schemas_byte_for_byte(table):
    derived = TABLES[table].schema
    assert derived.equals(ON_DISK[table], check_metadata=True), (derived, ON_DISK[table])
    # The IPC bytes also hold the list item names, which Schema.equals ignores.
    assert derived.serialize().to_pybytes() == ON_DISK[table].serialize().to_pybytes()
