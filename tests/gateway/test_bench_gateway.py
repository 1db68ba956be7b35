"""`clawrl bench gateway` end to end at toy sizes: both topologies measured in each CPU layout, the
own-core layout's threads where it says, every gateway request recorded in the session log (speed
is reported in docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import os

from clawrl.bench.gateway import _layouts, _prompts, run_gateway_bench
from storage.catalog import open_catalog


def test_prompts_are_distinct_and_of_one_shape():
    ps = _prompts(50)
    texts = [p[0]["content"] for p in ps]
    assert len(set(texts)) == 50 and len({len(t) for t in texts}) == 1


def test_gateway_bench_measures_both_topologies_and_logs_every_request(model_cache):
    result = run_gateway_bench(model_cache=model_cache, concurrencies=(1, 4), n=8, max_tokens=4, append_turns=2000)
    rows = result["latency"]
    layouts = _layouts()
    assert layouts == (["shared", "own-core"] if len(os.sched_getaffinity(0)) >= 2 else ["shared"])
    assert [(r["layout"], r["engine"], r["concurrency"]) for r in rows] == [
        (lay, eng, c) for lay in layouts for eng in ("embedded", "http") for c in (1, 4)]
    allowed = sorted(os.sched_getaffinity(0))
    assert sorted(os.sched_getaffinity(0)) == allowed  # the client got its own mask back
    compute, serving = [allowed[0]], allowed[1:]
    for r in rows:
        if r["layout"] == "shared":
            assert r["engine_masks"] == [allowed] and r["gateway_masks"] == [allowed]
            continue
        # own-core: engine worker threads and the client on the first CPU, serving threads on the others
        assert r["engine_masks"] == sorted([compute, serving]) and r["client_cpus"] == compute
        assert r["gateway_masks"] == (sorted([compute, serving]) if r["engine"] == "embedded" else [serving])
    for r in rows:
        assert r["requests"] == 8
        assert 0 < r["direct_p50_ms"] <= r["direct_p99_ms"] and 0 < r["gateway_p50_ms"] <= r["gateway_p99_ms"]
        assert abs(r["added_p50_ms"] - (r["gateway_p50_ms"] - r["direct_p50_ms"])) < 1e-9
        # CPU time of the two server processes, per request (10 ms clock ticks over 8 requests: coarse)
        assert r["gateway_cpu_us"] >= 0 and r["direct_cpu_us"] >= 0 and r["gateway_cpu_us"] + r["direct_cpu_us"] > 0
        assert abs(r["added_cpu_us"] - (r["gateway_cpu_us"] - r["direct_cpu_us"])) < 1e-6
    con = open_catalog(result["data_root"])
    try:
        n, types, distinct = con.execute(
            "select count(*), count(distinct turn_type), count(distinct request_messages) from turns").fetchone()
    finally:
        con.close()
    # per layout, topology and concurrency c: 2c warm-up requests + 8 measured, all through the gateway
    assert n == len(layouts) * 2 * ((2 * 1 + 8) + (2 * 4 + 8)) and types == 1
    assert distinct >= 16  # distinct user messages, not one repeated prompt
    assert result["append"]["rows_in_duckdb"] == 2000
