"""`clawrl up`: start every part as its own process, print the URLs, stop them all on Ctrl-C.

Processes (bound to 127.0.0.1, or to ``--host``: an address of this machine that Prefect workers
on other machines reach; the gateway binds ``[server] host``): the Prefect server (UI + API), the
MLflow server (UI, sqlite store under the data root), the trainer service (model + optimizer in
memory between steps; under torchrun when the model is split over several ranks), the gateway
(OpenAI API, in-process embedded engine, its SGLang control API under /engine), the judge engine
when the judge scores with the policy's initial weights (``[prm] backend = "engine"`` or the
"frozen" OPD teacher: a `clawrl engine` on ``[server] api_port`` + 21 that keeps the frozen model loaded
between judge runs, which reach it over HTTP), the promotion gate's evaluation engine when the gate
is on (a `clawrl engine` on ``api_port`` + 22 the train runs load each candidate into), the
canary engine with ``[gate] canary_share`` (a `clawrl engine` on ``api_port`` + 23 that serves
that share of sessions the newest trained version), and the
flow server (the judge / train / replay deployments; with a work pool, registered on it and run by `prefect worker start --pool`
processes, one of them started here unless told otherwise). Each keeps its state under the data
root, so after a kill -9 of any of them, ``clawrl up`` again resumes: the gateway replays its
write-ahead log, the trainer and the engine load the newest checkpoint, and claimed batches are
resumed, not re-taken.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from clawrl.config import MLFLOW_UI_ENV, child_env, mlflow_ui_url
from clawrl.lineage import client as mlflow_client, store_path, store_uri, ui_page
from clawrl.engine.router import router_argv
from clawrl.ports import WILDCARD_HOSTS, client_url, free_port, free_ports

# Prefect keeps concurrency-slot leases in memory by default: a Prefect server killed while a flow run
# held the trainer or judge slot comes back with the slot counted as taken and no lease to expire it,
# so no run trains again. Leases kept on disk (under PREFECT_HOME) survive the restart, and the
# server's repossessor frees an unrenewed one within a minute.
PREFECT_SERVER_ENV = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}
# The services share the machine's cores. OpenMP threads that spin while they wait for a peer the OS
# has descheduled make every torch op of a busy process crawl (288 requests to a tiny-model engine: 16 s
# beside one other busy process on 2 cores, 8 s with passive waiting). A user's own setting wins.
SHARED_CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class Service:
    name: str
    argv: list[str]
    health_url: str
    url: str  # what to print
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    ready_only_on_200: bool = False  # else any answer below 500 (a 401 of a keyed gateway) means up
    after_others: bool = False  # started once every service before it answers (else all start side by side)
    listens: tuple[str, int] | None = None  # (host, port) it binds, checked before anything starts


# The option or config key that sets each service's port, as `clawrl up` names it when the port is taken:
# the one table to change when a key is renamed.
_MOVED_BY_API_PORT = "--api-port / [server] api_port (the engines' ports are api_port + 10, 21, 22, 23)"
PORT_KEYS = {"prefect": "--prefect-port", "mlflow": "--mlflow-port", "trainer": "--trainer-port",
             "gateway": "--api-port / [server] api_port", **{name: _MOVED_BY_API_PORT for name in (
                 "judge-engine", "eval-engine", "canary-engine", "engine", "engine-router", "judge-engine-router")}}


def port_problems(services: list[Service]) -> list[str]:
    """Why each service could not listen where it should (its port taken, or given to two of them), each
    naming the key that moves it; empty when all can. Checked before any of them starts."""
    from clawrl.ports import listen_problem

    problems, seen = [], {}
    for svc in services:
        if svc.listens is None:
            continue
        host, port = svc.listens
        key = PORT_KEYS.get(svc.name, "its port")
        if port in seen:
            problems.append(f"port {port} is set for both {seen[port]} and {svc.name}: choose another with {key}")
        elif problem := listen_problem(host, port):
            problems.append(f"{svc.name}: {problem}: choose another with {key}")
        seen.setdefault(port, svc.name)
    return problems


# A service that has neither used CPU nor written to its log for this long is stuck, not slow: on a busy
# machine (two test suites on 2 cores, a cold Prefect migrating its database) a start takes minutes, but it
# keeps doing something all along. A fixed budget for the whole start failed there.
STALL_S = 180.0


def _progress(svc: Service) -> tuple[float, int]:
    """What a starting service has done so far: CPU seconds of it and its children, bytes of its log."""
    cpu = 0.0
    with suppress(psutil.Error):
        proc = psutil.Process(svc.proc.pid)
        for p in (proc, *proc.children(recursive=True)):
            with suppress(psutil.Error):
                times = p.cpu_times()
                cpu += times.user + times.system
    size = svc.log_path.stat().st_size if svc.log_path and svc.log_path.exists() else 0
    return cpu, size


def wait_healthy(svc: Service, stall_s: float = STALL_S) -> None:
    """Until ``svc`` answers its health URL; an error with its log's tail if it exits first, or if it makes no
    progress (CPU time, log output) for ``stall_s`` seconds."""
    last, moved = None, time.monotonic()
    while True:
        if svc.proc is not None and svc.proc.poll() is not None:
            tail = svc.log_path.read_text()[-2000:] if svc.log_path and svc.log_path.exists() else ""
            key = f" (its port: {PORT_KEYS[svc.name]})" if svc.name in PORT_KEYS else ""
            raise RuntimeError(f"{svc.name}{key} exited with code {svc.proc.returncode}:\n{tail}")
        with suppress(httpx.HTTPError):
            status = httpx.get(svc.health_url, timeout=2.0).status_code
            if status == 200 or (status < 500 and not svc.ready_only_on_200):
                return
        now = (_progress(svc) if svc.proc is not None else None)
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise RuntimeError(f"{svc.name} not healthy at {svc.health_url}: no progress (CPU, log) for {stall_s:.0f} s")
        time.sleep(0.5)


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `clawrl up` dies (even by kill -9), so no orphan keeps a port.
    Elsewhere (no libc.so.6) the children outlive a killed `clawrl up`."""
    with suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(svc: Service, log_dir: Path, base_env: dict[str, str]) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    svc.log_path = log_dir / f"{svc.name}.log"
    with open(svc.log_path, "ab") as log:  # the child has its own copy of the descriptor
        svc.proc = subprocess.Popen(svc.argv, env={**base_env, **svc.env}, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,  # our own Ctrl-C handling stops them in order
                                    preexec_fn=_die_with_parent)


def write_pids(path: Path, services: list[Service], prefect_api_url: str) -> None:
    """``<data_root>/up.pids.json``: which process is which (for operators, and the restart test),
    and the Prefect API that commands run on this data root use meanwhile (``clawrl.cli.common``)."""
    pids = {s.name: s.proc.pid for s in services if s.proc is not None}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"supervisor": os.getpid(), **pids, "prefect_api_url": prefect_api_url}))
    os.replace(tmp, path)


def stop(svc: Service, timeout_s: float = 15.0) -> None:
    p = svc.proc
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout_s)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)


def prefect_service(host: str, port: int) -> Service:
    """The Prefect server (API and UI) on ``host:port``."""
    return Service("prefect", [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port",
                               str(port)], f"{client_url(host, port)}/api/health", client_url(host, port),
                   env=PREFECT_SERVER_ENV, listens=(host, port))


@contextmanager
def own_prefect_server(home: Path) -> Iterator[str]:
    """A Prefect server on the state directory ``home`` for this process's flows (its URL; the
    process's PREFECT_API_URL points at its API meanwhile), in a session of its own and stopped
    after them. Prefect's temporary server shares the terminal's process group: a Ctrl-C stopped
    it together with the flows, which then retried their last reports against it for minutes."""
    svc = prefect_service("127.0.0.1", free_port())
    start(svc, Path(home), child_env(PREFECT_HOME=str(home)))
    previous = os.environ.get("PREFECT_API_URL")
    try:
        wait_healthy(svc)
        os.environ["PREFECT_API_URL"] = f"{svc.url}/api"
        yield svc.url
    finally:
        _send_prefect_reports()
        stop(svc)
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous


def _send_prefect_reports(timeout_s: float = 10.0) -> None:
    """Send the flow-run logs and events Prefect still queues in this process before its server goes
    (else they are retried against the stopped server when the process exits)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with suppress(Exception):  # a worker that never started, or one that cannot reach the server
            worker.drain_all(timeout=timeout_s)


def plan(settings, config_path: Path, *, prefect_port: int, mlflow_port: int, trainer_port: int,
         judge_every_s: float = 20.0, train_every_s: float = 120.0, work_pool: str | None = None,
         local_worker: bool = True, host: str = "127.0.0.1", engines: int = 0, judge_engines: int = 1) -> list[Service]:
    py = sys.executable
    root = settings.storage.data_root
    gw = gateway_url(settings, host)
    prefect_api = f"{client_url(host, prefect_port)}/api"
    mlflow_db = store_uri(root)
    policy = engine_group("engine", config_path, host, settings.port("engine"), engines, resume=True)
    from clawrl.judge.runner import uses_frozen_model

    judge = engine_group("judge-engine", config_path, host, settings.port("judge-engine"), judge_engines) \
        if uses_frozen_model(settings) and not settings.prm.engine_url else []
    gate_engine = _gate_engine(settings, config_path, host)
    canary = _canary_engine(settings, config_path, host)
    canary_env = {"CLAWRL__GATE__CANARY_URL": canary.url} if canary else {}  # the gateway's and the flows'
    policy_env = {"CLAWRL__ENGINE__URL": policy[-1].url} if policy else {}
    flows_env = {**({"CLAWRL__PRM__ENGINE_URL": judge[-1].url} if judge else {}),
                 **({"CLAWRL__GATE__ENGINE_URL": gate_engine.url} if gate_engine else {}), **canary_env}
    return [
        prefect_service(host, prefect_port),
        Service("mlflow", [py, "-m", "mlflow", "server", "--host", host, "--port", str(mlflow_port),
                           "--backend-store-uri", mlflow_db, "--artifacts-destination",
                           str(root / "mlflow" / "artifacts"), "--workers", "1"],
                f"{client_url(host, mlflow_port)}/health", ui_page(client_url(host, mlflow_port), "experiments"),
                env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, listens=(host, mlflow_port)),
        Service("trainer", [*_trainer_launcher(settings), "-m", "clawrl.cli", "trainer", "-c", str(config_path),
                            "--host", host, "--port", str(trainer_port)],
                f"{client_url(host, trainer_port)}/state", client_url(host, trainer_port), listens=(host, trainer_port)),
        *policy,  # its engines and their router answer before the gateway asks them what they serve
        Service("gateway", [py, "-m", "clawrl.cli", "serve", "-c", str(config_path)], f"{gw}/healthz", f"{gw}/v1",
                env={**canary_env, **policy_env}, after_others=bool(policy),
                listens=(settings.server.host, settings.server.api_port)),
        *judge,
        *([gate_engine] if gate_engine else []),
        *([canary] if canary else []),
        # up once its deployments are registered (Prefect answers 404 for the name before)
        Service("flows", [py, "-m", "clawrl.flows.serve", "--config", str(config_path), "--trainer-url",
                          client_url(host, trainer_port), "--engine-url", f"{gw}/engine",
                          "--judge-every", str(judge_every_s), "--train-every", str(train_every_s),
                          *(["--work-pool", work_pool] if work_pool else [])],
                f"{prefect_api}/deployments/name/replay/on-demand", f"deployments: judge/on-interval (every "
                f"{judge_every_s:g} s), train/on-samples-ready, replay/on-demand"
                + (f", on work pool {work_pool}" if work_pool else ""), env=flows_env, ready_only_on_200=True,
                after_others=True),  # registers with Prefect; its first runs use the trainer and the engines
        # the pool's runs go to any `prefect worker start --pool` process; one here unless told otherwise
        *([Service("worker", [py, "-m", "prefect", "worker", "start", "--pool", work_pool, "--type", "process",
                              "--name", f"clawrl-up-{os.uname().nodename}"],
                   f"{prefect_api}/work_pools/{work_pool}", f"a process worker of work pool {work_pool}",
                   env=flows_env, ready_only_on_200=True, after_others=True)] if work_pool and local_worker else []),
    ]


def gateway_url(settings, host: str) -> str:
    """The gateway's URL for the flows: ``[server] host``, or ``host`` when the gateway binds every address."""
    bound = settings.server.host
    return client_url(host if bound in WILDCARD_HOSTS else bound, settings.server.api_port)


def host_problem(settings, host: str) -> str | None:
    """Why ``clawrl up --host host`` cannot work with these settings (None: it can)."""
    if host in WILDCARD_HOSTS:
        return (f"--host {host!r} binds every address but names none: give the address other machines reach this "
                "one at (e.g. its LAN address 10.0.0.5); the URLs handed to the flows use it")
    loopback = host.startswith("127.") or host in ("localhost", "::1")
    if not loopback and settings.server.host.startswith("127."):
        return (f"--host {host} lets workers on other machines reach the trainer and Prefect, but the gateway binds "
                f"[server] host = {settings.server.host}, so their train runs could not sync it: set [server] host "
                f"to {host} or 0.0.0.0")
    return None


def _trainer_launcher(settings) -> list[str]:
    """How the trainer starts: this Python, or torchrun with one process per rank when ``[model]
    tensor_parallel x data_parallel`` > 1 (rank 0 serves the trainer API)."""
    n = settings.model.tensor_parallel * settings.model.data_parallel
    if n == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


def engine_group(name: str, config_path: Path, host: str, port: int, n: int, resume: bool = False) -> list[Service]:
    """``n`` `clawrl engine` processes: one on ``port``, or several on free ports behind SGLang's router
    on ``port`` (the last service: the URL the others use). ``resume``: each starts on the version last
    synced, as a restarted policy engine must; the judge engines hold the initial weights for good."""
    if n <= 1:
        return [_engine_service(name, config_path, host, port, resume)] if n == 1 else []
    worker_ports = free_ports(n + 1, avoid=(port,))
    workers = [_engine_service(f"{name}-{i}", config_path, host, p, resume) for i, p in enumerate(worker_ports[:n])]
    url = client_url(host, port)
    router = Service(f"{name}-router", router_argv([w.url for w in workers], host, port, worker_ports[n]),
                     f"{url}/readiness", url, ready_only_on_200=True,  # 200 once every worker answers its health
                     listens=(host, port))
    return [*workers, router]


def _gate_engine(settings, config_path: Path, host: str) -> Service | None:
    """The promotion gate's evaluation engine: `clawrl engine` on the policy's initial weights that the
    train runs load each candidate into, when the gate is on and ``[gate] engine_url`` names none of the
    user's own. Kept between runs, it spares each run (a process of its own) loading the model."""
    if not settings.gate.enabled or settings.gate.engine_url:
        return None
    return _engine_service("eval-engine", config_path, host, settings.port("eval-engine"))


def _canary_engine(settings, config_path: Path, host: str) -> Service | None:
    """The canary engine: `clawrl engine` the train runs load every new version into and the gateway sends
    ``[gate] canary_share`` of the sessions to, when ``[gate] canary_url`` names none of the user's own."""
    g = settings.gate
    if not g.canary or g.canary_url:
        return None
    return _engine_service("canary-engine", config_path, host, settings.port("canary-engine"))


def _engine_service(name: str, config_path: Path, host: str, port: int, resume: bool = False) -> Service:
    """`clawrl engine` at ``host:port``: on the policy's initial weights, or with ``resume`` on the version
    last synced."""
    url = client_url(host, port)
    argv = [sys.executable, "-m", "clawrl.cli", "engine", "-c", str(config_path), "--host", host, "--port", str(port),
            *(["--resume"] if resume else [])]
    return Service(name, argv, f"{url}/health", url, listens=(host, port))


def run_up(settings, config_path: Path, *, prefect_port: int = 4200, mlflow_port: int = 5000,
           trainer_port: int = 30020, judge_every_s: float = 20.0, train_every_s: float = 120.0,
           work_pool: str | None = None, local_worker: bool = True, host: str = "127.0.0.1", engines: int = 0,
           judge_engines: int = 1, echo=print) -> None:
    """Start everything, then block until Ctrl-C / SIGTERM, then stop everything. Every child gets
    PREFECT_API_URL (the flows submit to that server) and MLFLOW_TRACKING_URI."""
    root = Path(settings.storage.data_root)
    services = plan(settings, config_path, prefect_port=prefect_port, mlflow_port=mlflow_port,
                    trainer_port=trainer_port, judge_every_s=judge_every_s, train_every_s=train_every_s,
                    work_pool=work_pool, local_worker=local_worker, host=host, engines=engines,
                    judge_engines=judge_engines)
    if problems := port_problems(services):
        raise RuntimeError("\n".join(["nothing started: a port clawrl up needs is not free", *problems]))
    if not store_path(root).exists():  # made whole before MLflow's server and the flows open it
        echo(f"making MLflow's store in {root / 'mlflow'} ...")
        mlflow_client(root)
    prefect_api = f"{client_url(host, prefect_port)}/api"
    base_env = child_env(PREFECT_HOME=str(root / "prefect"), PREFECT_API_URL=prefect_api,
                         MLFLOW_TRACKING_URI=store_uri(root),
                         **{MLFLOW_UI_ENV: mlflow_ui_url(client_url(host, mlflow_port))})
    base_env = {**SHARED_CPU_ENV, **base_env}
    stopping = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first = [svc for svc in services if not svc.after_others]
        echo(f"starting {', '.join(svc.name for svc in first)} ...")
        for svc in first:  # side by side: none of them needs another to start
            start(svc, root / "logs", base_env)
        for svc in services:
            if svc.after_others:
                echo(f"starting {svc.name} ...")
                start(svc, root / "logs", base_env)
            wait_healthy(svc)
            write_pids(root / "up.pids.json", services, prefect_api)
            echo(f"  {svc.name:8s} {svc.url}")
        echo("all up; Ctrl-C stops everything")
        while not stopping:
            for svc in services:
                if svc.proc is not None and svc.proc.poll() is not None:
                    echo(f"{svc.name} exited with code {svc.proc.returncode}; see {svc.log_path}")
                    stopping = True
            time.sleep(0.5)
    finally:
        (root / "up.pids.json").unlink(missing_ok=True)
        for svc in reversed(services):
            stop(svc)
        for s, h in previous.items():
            signal.signal(s, h)
        echo("stopped")
