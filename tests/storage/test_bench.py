"""The storage benchmark runs end to end and counts what it wrote (speed is reported, not asserted)."""

from __future__ import annotations

import pytest

from clawrl.bench.storage import build_turn_templates, run_append_bench


def test_turn_templates_have_the_benchmark_shape():
    (turn,) = build_turn_templates(1, prompt_len=200, output_len=64)
    assert len(turn.prompt_ids) == 200 and len(turn.output_ids) == 64 and len(turn.rollout_logprobs) == 64
    assert all(lp < 0 for lp in turn.rollout_logprobs)


@pytest.mark.bench
def test_append_bench_counts_every_turn_in_duckdb(tmp_path):
    result = run_append_bench(3000, data_root=tmp_path, flush_interval_s=0.05)
    assert result["rows_in_duckdb"] == 3000 and result["distinct_turn_ids"] == 3000
    assert result["turns_per_s"] > 0 and result["append_us_p50"] > 0
    assert result["parquet_files"] >= 1
    assert result["wal_bytes_per_turn"] > 200 * 2  # 200 prompt ids alone take >= 2 bytes each in JSON
