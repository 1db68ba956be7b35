"""Gateway overhead: latency added over a direct engine call, and the session-log append rate.

Processes: ``clawrl engine`` serving the tiny model; ``clawrl serve`` with its own embedded engine
(the default) or in front of that ``clawrl engine`` (``engine.kind = "http"``; once more with the
engine at nice 19, ``TOPOLOGIES``); this process as the client, over ``clawrl.engine.http1``. The direct
call is the engine's ``/generate`` with the prompt ids the gateway would render and the same greedy
sampling, so both paths generate the same tokens. Added latency = gateway percentile - direct
percentile, at each concurrency, in each design (``_measure``); the gateway's ``Server-Timing`` splits it
into the gateway's own work and the hop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from clawrl.engine import http1


def _prompts(n: int) -> list[list[dict[str, str]]]:
    """Distinct user messages of one shape: the gateway caches the encoding of conversation pieces
    it has seen (history), so repeating one message would hide the cost of encoding a new one."""
    return [[{"role": "user", "content": f"Say something short, request {i:05d}."}] for i in range(n)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout_s} s")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


BLOCKS = 20  # alternations of the two paths per measurement


def requests_at(n: int, concurrency: int) -> int:
    """Requests per path at a concurrency: ``n`` up to 4 in flight, then n per 4 in flight. At 16 a
    closed loop settles into batching patterns that last a while and differ in latency by a few ms, so
    it takes many more requests (and blocks) than concurrency 1 to pin a median down to ~1 ms."""
    return n * max(1, concurrency // 4)


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


async def _closed_loop(send, n: int, concurrency: int) -> list[float]:
    lat: list[float] = []
    queue = list(range(n))

    async def worker():
        while queue:
            queue.pop()
            t0 = time.perf_counter()
            await send()
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


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


async def _blocks_loop(sends: tuple, n: int, concurrency: int,
                      pids: list[int]) -> tuple[list[float], list[float], float, float]:
    """The two paths take turns in up to ``BLOCKS`` closed-loop blocks each (so drifting machine load hits
    both alike), ``n`` requests a path. Returns both latency lists and the CPU seconds of ``pids`` charged
    to each path."""
    lats: tuple[list[float], list[float]] = ([], [])
    cpu = [0.0, 0.0]
    blocks = max(1, min(BLOCKS, n // max(1, concurrency)))
    for b in range(blocks):
        size = n // blocks + (1 if b < n % blocks else 0)
        for path in (0, 1):
            c0 = _cpu_s(pids)
            lats[path].extend(await _closed_loop(sends[path], size, concurrency))
            cpu[path] += _cpu_s(pids) - c0
    return (*lats, *cpu)


async def _measure(direct_url: str, gateway_url: str, prompts: list[tuple[list[dict[str, str]], list[int]]],
                   concurrency: int, n: int, max_tokens: int, design: str = "paired",
                   pids: list[int] | None = None) -> dict[str, Any]:
    """``n`` requests a path: ``/generate`` at ``direct_url`` vs the gateway's chat route, ``prompts`` =
    (messages, the ids the gateway renders them to), used in turn by both paths.

    ``paired``: every client alternates the paths request by request, so both meet the same engine
    batches and machine load - the difference is what a request pays for going through the gateway.
    ``blocks``: the paths take turns in blocks (``BLOCKS``), each with the whole load to itself - the
    difference also holds what the gateway's extra CPU costs everyone else on a saturated machine; ``pids``
    (the server processes) are charged CPU per path there."""
    # The client is clawrl's own HTTP/1.1 pool (the one the gateway calls an engine with), a keep-alive
    # connection per request in flight to each server: ~0.1 ms of CPU a request against ~1.4 ms with
    # httpx, which on a small machine took CPU from the servers being measured. The gateway's
    # Server-Timing header gives its own share of each request (``own_*``).
    counters = {"direct": 0, "gateway": 0}
    own: list[float] = []

    def next_prompt(path: str) -> tuple[list[dict[str, str]], list[int]]:
        counters[path] += 1
        return prompts[counters[path] % len(prompts)]

    engine_pool = http1.Pool(direct_url, timeout_s=120)
    gateway_pool = http1.Pool(gateway_url, timeout_s=120, keep_headers=True)
    try:
        async def direct():
            body = {"input_ids": next_prompt("direct")[1], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            async with engine_pool.post("/generate", orjson.dumps(body)) as r:
                _check(r.status, await r.read(), direct_url + "/generate")

        async def via_gateway():
            body = {"messages": next_prompt("gateway")[0], "max_tokens": max_tokens, "temperature": 0.0,
                    "turn_type": "side"}
            async with gateway_pool.post("/v1/chat/completions", orjson.dumps(body)) as r:
                _check(r.status, await r.read(), gateway_url + "/v1/chat/completions")
                own.append(gateway_own_s(r.headers.get("server-timing", "")))

        for send in (direct, via_gateway):  # warm up connections and code paths
            await _closed_loop(send, 2 * concurrency, concurrency)
        own.clear()
        if design == "paired":
            d_lat, g_lat = await _paired_loop((direct, via_gateway), n, concurrency)
        else:
            d_lat, g_lat, d_cpu, g_cpu = await _blocks_loop((direct, via_gateway), n, concurrency, pids or [])
    finally:
        await engine_pool.close()
        await gateway_pool.close()
    row: dict[str, Any] = {"concurrency": concurrency, "requests": len(g_lat)}
    for name, lat in (("direct", d_lat), ("gateway", g_lat)):
        row[f"{name}_p50_ms"] = 1000 * _pct(lat, 0.50)
        row[f"{name}_p99_ms"] = 1000 * _pct(lat, 0.99)
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["added_mean_ms"] = 1000 * (statistics.mean(g_lat) - statistics.mean(d_lat))
    # added mean = the gateway's own time + the hop (parse and queue before the handler, the extra
    # process's wake-ups and socket round trip): means add up, percentiles do not
    row["own_p50_ms"] = 1000 * _pct(own, 0.50)
    row["own_mean_ms"] = 1000 * statistics.mean(own)
    row["hop_mean_ms"] = row["added_mean_ms"] - row["own_mean_ms"]
    if pids and design == "blocks":  # server CPU per request, both processes (paired, the paths overlap)
        row["direct_cpu_us"] = 1e6 * d_cpu / len(d_lat)
        row["gateway_cpu_us"] = 1e6 * g_cpu / len(g_lat)
        row["added_cpu_us"] = row["gateway_cpu_us"] - row["direct_cpu_us"]
    return row


def _check(status: int, body: bytes, url: str) -> None:
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {body[:300]!r}")


def gateway_own_s(server_timing: str) -> float:
    """Seconds of the ``gateway`` metric in a Server-Timing header (routes.server_timing)."""
    for metric in server_timing.split(","):
        name, _, params = metric.strip().partition(";")
        if name == "gateway":
            for param in params.split(";"):
                key, _, value = param.strip().partition("=")
                if key == "dur":
                    return float(value) / 1000.0
    raise ValueError(f"no gateway;dur in Server-Timing {server_timing!r}")


def _start(args: list[str], env: dict[str, str], health: str, nice: int = 0) -> subprocess.Popen:
    """A clawrl server process (at ``nice`` if > 0), up and answering ``health``."""
    cmd = [sys.executable, "-m", "clawrl.cli", *args]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(health, proc)
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


DESIGNS = ("paired", "blocks")
# (engine column, designs, nice of the `clawrl engine` process). The last is the http topology with the
# engine's process at the lowest CPU priority: the stand-in for SGLang, whose forward passes run on a GPU
# and leave the CPU to the gateway - on a small CPU machine a `clawrl engine` at nice 0 holds the cores
# the gateway's requests wait for (docs/benchmarks.md, gateway overhead).
TOPOLOGIES = (("embedded", DESIGNS, 0), ("http", DESIGNS, 0), ("http, engine nice 19", ("paired",), 19))


def _direct_url(design: str, topology: str, engine_url: str, gateway_url: str) -> str:
    """Where the direct calls go. Paired, the two paths must share one engine: with the embedded engine
    that is the gateway process's own ``/engine`` mount (the same /generate code as ``clawrl engine``);
    otherwise, and in the blocks design, ``clawrl engine``."""
    return gateway_url + "/engine" if design == "paired" and topology == "embedded" else engine_url


def run_gateway_bench(*, model_cache: Path, concurrencies=(1, 16), n: int = 2000, max_tokens: int = 8,
                      append_turns: int = 200_000, progress=None) -> dict[str, Any]:
    """Both topologies - the default (embedded engine inside the gateway process) and engine.kind =
    http (the gateway calls ``clawrl engine`` over HTTP, as it would call SGLang) - in both designs
    (``_measure``). ``progress(description)`` is called as each cell starts."""
    from clawrl.bench.report import load_average
    from clawrl.bench.storage import run_append_bench
    from clawrl.models import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir("tiny", model_cache))
    prompts = [(m, list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)))
               for m in _prompts(4 * requests_at(n, max(concurrencies)))]
    root = Path(tempfile.mkdtemp(prefix="clawrl-gwbench-"))
    base_env = {**os.environ, "CLAWRL__MODEL__NAME": "tiny", "CLAWRL__STORAGE__MODEL_CACHE": str(model_cache),
                "CLAWRL__STORAGE__DATA_ROOT": str(root / "data"), "CLAWRL__SERVER__OPEN_MODE": "true",
                "OMP_NUM_THREADS": "1"}
    rows = []
    for topology, designs, engine_nice in TOPOLOGIES:
        if engine_nice and shutil.which("nice") is None:
            continue  # no way to start the engine at a lower priority here
        eport, gport = _free_port(), _free_port()
        engine_url, gateway_url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
        gw_env = {} if topology == "embedded" else {"CLAWRL__ENGINE__KIND": "http", "CLAWRL__ENGINE__URL": engine_url}
        engine = gateway = None
        try:
            engine = _start(["engine", "--port", str(eport)], base_env, engine_url + "/health", nice=engine_nice)
            gateway = _start(["serve", "--port", str(gport)], {**base_env, **gw_env}, gateway_url + "/healthz")
            for design in designs:
                for c in concurrencies:
                    if progress:
                        progress(f"{design}, {topology} engine, concurrency {c}")
                    row = asyncio.run(_measure(_direct_url(design, topology, engine_url, gateway_url), gateway_url,
                                               prompts, c, requests_at(n, c), max_tokens, design=design,
                                               pids=[engine.pid, gateway.pid]))
                    rows.append({"design": design, "engine": topology, **row, "load_1m": load_average(),
                                 "engine_nice": os.getpriority(os.PRIO_PROCESS, engine.pid)})
        finally:
            _stop(gateway)
            _stop(engine)
    if progress:
        progress("session-log append rate")
    append = run_append_bench(append_turns)
    return {"latency": rows, "append": append, "max_tokens": max_tokens, "data_root": str(root / "data")}


def format_gateway_section(result: dict[str, Any], machine_line: str) -> str:
    from clawrl.bench.report import markdown_table

    cols = ["design", "engine", "concurrency", "requests", "direct_p50_ms", "gateway_p50_ms", "added_p50_ms",
            "direct_p99_ms", "gateway_p99_ms", "added_p99_ms", "added_mean_ms", "own_p50_ms", "own_mean_ms",
            "hop_mean_ms", "added_cpu_us", "load_1m"]
    a = result["append"]
    lines = [
        "## Gateway overhead and session-log append rate",
        "",
        machine_line,
        f"Tiny model, greedy, {result['max_tokens']} new tokens, a distinct user message per request (so the",
        "gateway's cache of conversation pieces does not hide the encoding cost). A direct call is the engine's",
        "`/generate` with the prompt ids the gateway renders; a gateway call is `/v1/chat/completions` with the",
        "messages, recorded in the session log. `clawrl serve` runs with its own in-process embedded engine",
        "(`engine` = embedded, the default) or in front of `clawrl engine` over HTTP (`engine` = http, as in front",
        "of SGLang). `http, engine nice 19`: the same with the `clawrl engine` process at the lowest CPU",
        "priority, standing in for SGLang, whose forward passes run on a GPU and leave the CPU to the gateway",
        "(at nice 0 a CPU engine holds the cores the gateway's requests wait for). Engine, gateway and client",
        "are separate processes. `added_*` = gateway percentile - direct percentile. Targets: p50 +<=1 ms,",
        "p99 +<=5 ms at 16.",
        "",
        "Two designs. `paired` (the added latency): every client of the closed loop alternates the two paths",
        "request by request against one engine - with the embedded engine its direct calls go to the gateway",
        "process's `/engine/generate` (the same /generate code as `clawrl engine`), with http to `clawrl engine` -",
        "so both paths meet the same decode batches and the same machine load, and the difference is what a",
        "request pays for going through the gateway. `blocks`: the paths take turns in blocks, each with the",
        "whole load to itself, direct calls always to `clawrl engine`; where the engine's decode steps run on",
        "the same CPU cores as the gateway, the difference also holds the throughput the gateway's extra CPU",
        "(`added_cpu_us`, server processes, per request) takes from generation - about 16-fold at",
        "concurrency 16, where a decode step serves 16 requests at once.",
        "",
        "`own_*`: the gateway's own time per request, from its `Server-Timing` header (`gateway;dur`: the",
        "handler's time minus the engine call - parse, template, session bookkeeping, turn record and its",
        "write-ahead-log write, response body). `hop_mean_ms` = `added_mean_ms` - `own_mean_ms`: what the extra",
        "process costs around that work - the HTTP parse and the event loop's queue before the handler, the",
        "wake-ups and the socket round trip. The client is clawrl's own HTTP/1.1 pool (`clawrl.engine.http1`).",
        "",
        markdown_table(result["latency"], cols),
        "",
        f"Session log: {a['n_turns']:,} TurnRecords ({a['prompt_len']}-token prompts, {a['output_len']}-token outputs",
        f"with log-probs) appended one call each through DataStore, incl. Parquet conversion and the final flush:",
        f"**{a['turns_per_s']:,} turns/s** (target >= 20,000; {a['cpu_us_per_turn']} CPU-us per turn); append latency",
        f"p50 {a['append_us_p50']:.1f} us, p99 {a['append_us_p99']:.1f} us, p99.9 {a['append_us_p999']:.1f} us; "
        f"{a['rows_in_duckdb']:,} rows counted back in DuckDB; load {a['loadavg_1m_before']:.2f} before.",
    ]
    return "\n".join(lines)
