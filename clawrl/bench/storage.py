"""Sustained append rate of served turns through ``DataStore``, Parquet conversion included.

Each turn is realistic in size: a ``prompt_len``-token prompt, an ``output_len``-token output
with one float log-prob per token (float32 values, as an engine returns them), a JSON message
list of a few hundred characters and JSON sampling parameters. Records are copies of a pool of
random templates with fresh ids, so the benchmark measures storage, not random number generation;
the pool (4096 x ~1.7 KB of ids) is larger than what zstd can match across, so Parquet sizes stay
close to those of unique turns.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from clawrl.records import TurnRecord, make_turn_id, utcnow
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore

POOL = 4096  # templates: more bytes than zstd can match across (module docstring)


def build_turn_templates(
    n: int, *, prompt_len: int = 200, output_len: int = 64, vocab: int = 49_152, seed: int = 0
) -> list[TurnRecord]:
    rng = np.random.default_rng(seed)
    now = utcnow()
    templates = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "You are a coding agent working in the user's repository."},
            {"role": "user", "content": f"Run the tests in module m{i} and fix what fails; keep the API."},
        ]
        # float32 values, as a float32 engine returns them
        logprobs = (-rng.exponential(1 / 1.5, output_len)).astype(np.float32).tolist()
        templates.append(TurnRecord(
            turn_id="", session_id="", turn_index=0, turn_type="main", namespace="open",
            model="clawrl-policy", weight_version="v0",
            request_messages=orjson.dumps(messages).decode(), request_tools=None,
            request_params='{"temperature":0.7,"top_p":1.0,"max_new_tokens":512,"logprobs":true}',
            prompt_ids=rng.integers(vocab, size=prompt_len).tolist(),
            output_ids=rng.integers(vocab, size=output_len).tolist(),
            rollout_logprobs=logprobs, text="I ran the tests; the failure was an off-by-one, fixed.",
            tool_calls=None, finish_reason="stop", created_at=now, completed_at=now, latency_ms=412.5,
        ))
    return templates


def run_append_bench(
    n_turns: int = 200_000, *, data_root: str | os.PathLike | None = None, prompt_len: int = 200,
    output_len: int = 64, flush_interval_s: float = 0.5,
) -> dict[str, Any]:
    """Append `n_turns` turns one call each (as the gateway does), flush, and count them in DuckDB.

    turns_per_s covers the whole run: building each record, appending it, the background Parquet
    conversion and the final flush. append_us_* are per-call latencies of ``DataStore.append``;
    cpu_us_per_turn (this process's CPU time) is steadier than turns_per_s on a shared machine.
    """
    templates = build_turn_templates(POOL, prompt_len=prompt_len, output_len=output_len)
    latencies = [0] * n_turns
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="clawrl-bench-") as tmp:
        root = Path(data_root) if data_root is not None else Path(tmp)
        cpu0, t0 = time.process_time(), time.perf_counter()
        with DataStore(root, flush_interval_s=flush_interval_s) as store:
            for i in range(n_turns):
                turn = copy.copy(templates[i % POOL])
                turn.session_id, turn.turn_index = f"bench-{i // 8}", i % 8
                turn.turn_id = make_turn_id("open", turn.session_id, turn.turn_index)
                a = time.perf_counter_ns()
                store.append(turn)
                latencies[i] = time.perf_counter_ns() - a
            store.flush()
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        files = list((root / "tables" / "turns").glob("date=*/*.parquet"))
        parquet_bytes = sum(f.stat().st_size for f in files)
        counted = run_query(root, "SELECT count(*) AS n, count(DISTINCT turn_id) AS ids FROM turns").to_pylist()[0]
    p50, p99, p999 = (np.percentile(latencies, [50, 99, 99.9]) / 1e3).tolist()
    return {
        "n_turns": n_turns,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "turns_per_s": round(n_turns / elapsed),
        "append_us_p50": p50,
        "append_us_p99": p99,
        "append_us_p999": p999,
        "cpu_us_per_turn": round(cpu_s / n_turns * 1e6, 1),
        "wal_bytes_per_turn": len(orjson.dumps(templates[0], option=orjson.OPT_APPEND_NEWLINE)),
        "parquet_files": len(files),
        "parquet_bytes_per_turn": round(parquet_bytes / n_turns, 1),
        "rows_in_duckdb": int(counted["n"]),
        "distinct_turn_ids": int(counted["ids"]),
        "loadavg_1m_before": load_before,
    }
