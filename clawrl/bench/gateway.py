"""Gateway overhead: latency added over a direct engine call, and the session-log append rate.

Two topologies: ``clawrl serve`` with its own embedded engine (the default), and ``clawrl serve`` in
front of ``clawrl engine`` over HTTP (``engine.kind = "http"``, as in front of SGLang). This process
is the client (aiohttp, keep-alive connections). Paired design: every client of a closed loop
alternates a direct call and a gateway call against one engine (``_paired_loop``), so both meet the
same engine batches and machine load and the difference is what a request pays for going through the
gateway. A direct call is the engine's ``/generate`` with the prompt ids the gateway would render and
the same greedy sampling, so both paths generate the same tokens; with the embedded engine it goes to
the gateway process's own ``/engine`` mount. The gateway's ``Server-Timing`` gives its own share.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from clawrl.bench.common import (
    STOP_TIMEOUT_S,
    bench_dtype,
    bench_env,
    clawrl_service,
    load_average,
    machine_line,
    markdown_table,
)
from clawrl.ports import free_ports
from clawrl.supervisor import start, stop, wait_healthy

TOPOLOGIES = ("embedded", "http")


def _prompts(n: int) -> list[list[dict[str, str]]]:
    """Distinct user messages of one shape: the gateway caches the encoding of conversation pieces
    it has seen (history), so repeating one message would hide the cost of encoding a new one."""
    return [[{"role": "user", "content": f"Say something short, request {i:05d}."}] for i in range(n)]


def requests_at(n: int, concurrency: int) -> int:
    """Requests per path at a concurrency: ``n`` up to 4 in flight, then n per 4 in flight. At 16 a
    closed loop settles into batching patterns that last a while and differ in latency by a few ms, so
    it takes many more requests than concurrency 1 to pin a median down to ~1 ms."""
    return n * max(1, concurrency // 4)


async def _paired_loop(sends: tuple, n: int, concurrency: int) -> tuple[list[float], list[float]]:
    """A closed loop of ``concurrency`` clients, each alternating the two paths request by request (half of
    them starting with each), ``n`` requests a path: both see the same engine batches at the same moments."""
    lats: tuple[list[float], list[float]] = ([], [])
    left = [n, n]

    async def client(k: int):
        path = k % 2
        while left[0] or left[1]:
            if not left[path]:
                path ^= 1
            left[path] -= 1
            t0 = time.perf_counter()
            await sends[path]()
            lats[path].append(time.perf_counter() - t0)
            path ^= 1

    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return lats


async def _measure(direct_url: str, gateway_url: str, prompts: list[tuple[list[dict[str, str]], list[int]]],
                   concurrency: int, n: int, max_tokens: int) -> dict[str, Any]:
    """``n`` requests a path, paired: ``/generate`` at ``direct_url`` vs the gateway's chat route;
    ``prompts`` = (messages, the ids the gateway renders them to), used in turn by both paths."""
    direct_prompts, gateway_prompts = itertools.cycle(prompts), itertools.cycle(prompts)
    own: list[float] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), raise_for_status=True,
                                     json_serialize=lambda body: orjson.dumps(body).decode()) as http:
        async def direct():
            body = {"input_ids": next(direct_prompts)[1], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            async with http.post(direct_url + "/generate", json=body) as r:
                await r.read()

        async def via_gateway():
            body = {"model": "clawrl-policy", "messages": next(gateway_prompts)[0], "max_tokens": max_tokens,
                    "temperature": 0.0, "turn_type": "side"}
            async with http.post(gateway_url + "/v1/chat/completions", json=body) as r:
                await r.read()
                own.append(gateway_own_s(r.headers.get("server-timing", "")))

        await _paired_loop((direct, via_gateway), 2 * concurrency, concurrency)  # warm connections and code paths
        own.clear()
        d_lat, g_lat = await _paired_loop((direct, via_gateway), n, concurrency)
    row: dict[str, Any] = {"concurrency": concurrency, "requests": len(g_lat)}
    for name, lat in (("direct", d_lat), ("gateway", g_lat)):
        row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = (1000 * np.percentile(lat, [50, 99])).tolist()
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p50_pct"] = 100 * row["added_p50_ms"] / row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["own_p50_ms"] = 1000 * float(np.median(own))
    return row


def gateway_own_s(server_timing: str) -> float:
    """Seconds of the ``gateway`` metric's ``dur`` (ms) in a Server-Timing header (routes.server_timing)."""
    m = re.search(r"(?:^|,)\s*gateway\s*;[^,]*?\bdur=([0-9.]+)", server_timing)
    if m is None:
        raise ValueError(f"no gateway;dur in Server-Timing {server_timing!r}")
    return float(m.group(1)) / 1000.0


def _direct_url(topology: str, engine_url: str, gateway_url: str) -> str:
    """Where the direct calls go: the engine the gateway calls. Embedded, that is the gateway process's
    own ``/engine`` mount (the same /generate code as ``clawrl engine``)."""
    return gateway_url + "/engine" if topology == "embedded" else engine_url


def run_gateway_bench(*, model_cache: Path, concurrencies=(1, 16), n: int = 2000, max_tokens: int = 8,
                      append_turns: int = 200_000, device: str = "cpu", model: str = "tiny",
                      progress=None) -> dict[str, Any]:
    """Both topologies at each concurrency (``_measure``), the engine on ``device``, then the
    session-log append rate. ``progress(description)`` is called as each cell starts."""
    from clawrl.bench.storage import run_append_bench
    from clawrl.models import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(model, model_cache))
    prompts = [(m, list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)))
               for m in _prompts(4 * requests_at(n, max(concurrencies)))]
    root, dtype = Path(tempfile.mkdtemp(prefix="clawrl-gwbench-")), bench_dtype(device)
    env = {"CLAWRL__MODEL__NAME": model, "CLAWRL__MODEL__DEVICE": device, "CLAWRL__MODEL__DTYPE": dtype,
           "CLAWRL__STORAGE__MODEL_CACHE": str(model_cache), "CLAWRL__STORAGE__DATA_ROOT": str(root / "data"),
           "CLAWRL__SERVER__OPEN_MODE": "true", "OMP_NUM_THREADS": "1"}
    rows = []
    for topology in TOPOLOGIES:
        eport, gport = free_ports(2)
        engine_url, gateway_url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
        gw_env = {} if topology == "embedded" else {"CLAWRL__ENGINE__URL": engine_url}
        engine = clawrl_service("engine", ["engine", "--port", str(eport)], engine_url + "/health")
        gateway = clawrl_service(f"gateway-{topology}", ["serve", "--port", str(gport)], gateway_url + "/healthz")
        try:
            if topology == "http":
                start(engine, root, bench_env(**env))
                wait_healthy(engine)
            start(gateway, root, bench_env(**env, **gw_env))
            wait_healthy(gateway)
            for c in concurrencies:
                if progress:
                    progress(f"{topology} engine, concurrency {c}")
                row = asyncio.run(_measure(_direct_url(topology, engine_url, gateway_url), gateway_url, prompts, c,
                                           requests_at(n, c), max_tokens))
                rows.append({"engine": topology, **row, "load_1m": load_average()})
        finally:
            stop(gateway, STOP_TIMEOUT_S)
            stop(engine, STOP_TIMEOUT_S)
    if progress:
        progress("session-log append rate")
    append = run_append_bench(append_turns)
    return {"latency": rows, "append": append, "max_tokens": max_tokens, "device": device, "dtype": dtype,
            "data_root": str(root / "data"), "model": model}


def format_gateway_section(result: dict[str, Any]) -> str:
    cols = ["engine", "concurrency", "requests", "direct_p50_ms", "gateway_p50_ms", "added_p50_ms", "added_p50_pct",
            "direct_p99_ms", "gateway_p99_ms", "added_p99_ms", "own_p50_ms", "load_1m"]
    a = result["append"]
    lines = [
        "## Gateway overhead and session-log append rate",
        "",
        machine_line(result["device"], result["dtype"]),
        f"Model {result['model']}, greedy, {result['max_tokens']} new tokens, a distinct user message per request. "
        "Each client of a closed loop alternates a direct call (the engine's",
        "`/generate` with the prompt ids the gateway renders) and a gateway call (`/v1/chat/completions`, logged) "
        "against one engine. `engine`: embedded = `clawrl serve`",
        "with its in-process engine; http = `clawrl serve` in front of `clawrl engine`, as of SGLang. `added_*`: "
        "gateway minus direct (`_pct`: of `direct_p50_ms`); `own_p50_ms`:",
        "the gateway's own time (`Server-Timing`). Targets at 16 in flight: added p50 <= 2% of the engine call's with "
        "a GPU engine; <= +1 ms embedded on 2 cores.",
        "",
        markdown_table(result["latency"], cols),
        "",
        f"Session log: {a['n_turns']:,} TurnRecords ({a['prompt_len']}-token prompts, {a['output_len']}-token outputs "
        "with log-probs) appended one call each through DataStore, Parquet and flush included:",
        f"**{a['turns_per_s']:,} turns/s** (target >= 20,000; {a['cpu_us_per_turn']} CPU-us a turn); append p50 "
        f"{a['append_us_p50']:.1f} us, p99 {a['append_us_p99']:.1f} us, p99.9 {a['append_us_p999']:.1f} us; "
        f"{a['rows_in_duckdb']:,} rows counted back in DuckDB; load {a['loadavg_1m_before']:.2f} before.",
    ]
    return "\n".join(lines)
