"""Every record field has a column of the right type; a field added without a column fails loudly."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa
import pytest

from clawrl import records
from clawrl.storage import schemas, writer
from clawrl.storage.schemas import TABLES, TableSpec

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


def test_a_record_field_without_a_column_fails_when_the_store_opens(monkeypatch, tmp_path):
    @dataclass
    class FateWithExtra(records.FateRecord):
        new_field: str = field(default="")

    patched = dict(TABLES, turn_fate=TableSpec("turn_fate", FateWithExtra, schemas.TURN_FATE))
    monkeypatch.setattr(writer, "TABLES", patched)
    with pytest.raises(RuntimeError, match="new_field"):
        writer.DataStore(tmp_path)
