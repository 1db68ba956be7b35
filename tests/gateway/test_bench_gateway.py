"""`clawrl bench gateway` end to end at toy sizes: both topologies measured, every gateway request
recorded in the session log (speed is reported in docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.bench.gateway import _direct_url, _paired_loop, _prompts, format_gateway_section, run_gateway_bench
from clawrl.storage.catalog import open_catalog

pytestmark = [pytest.mark.bench]


def test_prompts_are_distinct_and_of_one_shape():
    ps = _prompts(50)
    texts = [p[0]["content"] for p in ps]
    assert len(set(texts)) == 50 and len({len(t) for t in texts}) == 1


def test_gateway_bench_measures_both_topologies_and_logs_every_request(model_cache):
    result = run_gateway_bench(model_cache=model_cache, concurrencies=(1, 4), n=8, max_tokens=4, append_turns=2000)
    rows = result["latency"]
    assert [(r["engine"], r["concurrency"]) for r in rows] == [(eng, c) for eng in ("embedded", "http") for c in (1, 4)]
    for r in rows:
        assert r["requests"] == 8
        assert 0 < r["direct_p50_ms"] <= r["direct_p99_ms"] and 0 < r["gateway_p50_ms"] <= r["gateway_p99_ms"]
        assert abs(r["added_p50_ms"] - (r["gateway_p50_ms"] - r["direct_p50_ms"])) < 1e-9
        assert abs(r["added_p99_ms"] - (r["gateway_p99_ms"] - r["direct_p99_ms"])) < 1e-9
        assert abs(r["added_p50_pct"] - 100 * r["added_p50_ms"] / r["direct_p50_ms"]) < 1e-9
        # the gateway's own share (its Server-Timing) is part of a gateway request's latency
        assert 0 < r["own_p50_ms"] < r["gateway_p50_ms"]
    with open_catalog(result["data_root"]) as con:
        n, types, distinct = con.execute(
            "select count(*), count(distinct turn_type), count(distinct request_messages) from turns").fetchone()
    # per topology and concurrency c: 2c warm-up requests + 8 measured, all through the gateway
    assert n == 2 * ((2 * 1 + 8) + (2 * 4 + 8)) and types == 1
    assert distinct >= 16  # distinct user messages, not one repeated prompt
    assert result["append"]["rows_in_duckdb"] == 2000
    assert result["model"] == "tiny" and "Model tiny, greedy, 4 new tokens" in format_gateway_section(result)


def test_paired_loop_alternates_paths_per_client():
    """Each client alternates the two paths; half the clients start with each; n requests a path."""
    calls: list[tuple[int, str]] = []

    def send(name):
        async def f():
            calls.append((id(asyncio.current_task()), name))
            await asyncio.sleep(0)  # round robin: the clients take turns deterministically
        return f

    d, g = asyncio.run(_paired_loop((send("d"), send("g")), 10, 4))
    assert len(d) == len(g) == 10 and all(x > 0 for x in d + g)
    by_client: dict[int, list[str]] = {}
    for task, name in calls:
        by_client.setdefault(task, []).append(name)
    assert len(by_client) == 4 and sorted(seq[0] for seq in by_client.values()) == ["d", "d", "g", "g"]
    for seq in by_client.values():  # 20 requests over 4 clients, 5 each, alternating
        assert all(a != b for a, b in zip(seq, seq[1:])) and len(seq) == 5


def test_direct_calls_go_to_the_gateways_engine():
    e, gw = "http://127.0.0.1:1", "http://127.0.0.1:2"
    assert _direct_url("embedded", e, gw) == gw + "/engine"
    assert _direct_url("http", e, gw) == e


@pytest.mark.parametrize(("device", "expected"), [("cpu", "tiny"), ("cuda", "smollm2-135m")])
def test_the_cli_reads_the_gpu_target_on_the_real_model(monkeypatch, tmp_path, device, expected):
    """`clawrl bench gateway` serves the tiny model on the CPU and SmolLM2-135M on a GPU unless --model says
    otherwise (the bench itself is replaced: only the choice of model is under test)."""
    from typer.testing import CliRunner

    import clawrl.bench.gateway as gw
    from clawrl.cli import app

    seen = []
    monkeypatch.setattr(gw, "run_gateway_bench", lambda **kw: seen.append(kw) or {"data_root": str(tmp_path / "d")})
    monkeypatch.setattr(gw, "format_gateway_section", lambda result: "## Gateway overhead\n")
    out = tmp_path / "bench.md"
    for extra in ([], ["--model", "tiny-qwen3"]):
        res = CliRunner().invoke(app, ["bench", "gateway", "--device", device, "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
    assert [(kw["device"], kw["model"]) for kw in seen] == [(device, expected), (device, "tiny-qwen3")]
    assert "<!-- gateway-bench:start -->" in out.read_text()
