"""`clawrl serve` (and `clawrl engine`) as real subprocesses on fixed ports, for tests that SIGKILL,
restart or resource-limit them. Their output is drained by a thread into a log file, whose tail is
shown when a process fails to come up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from clawrl.ports import free_port
from tests.utils.waiting import STALL_S, drain, run_to_end, wait_until

REPO = Path(__file__).resolve().parents[2]


def serve_env(data_root: Path, model_cache: Path, **settings: str) -> dict[str, str]:
    """The environment of a `clawrl serve` child: tiny model, open mode, short replies; keyword
    arguments are extra settings as section__key=value (CLAWRL__SECTION__KEY)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL__")}
    env.update({"CLAWRL__STORAGE__DATA_ROOT": str(data_root), "CLAWRL__STORAGE__MODEL_CACHE": str(model_cache),
                "CLAWRL__MODEL__NAME": "tiny", "CLAWRL__SERVER__OPEN_MODE": "true",
                "CLAWRL__PPO__MAX_NEW_TOKENS": "4", "CLAWRL__ENGINE__MAX_CONTEXT_LEN": "512",
                "PYTHONUNBUFFERED": "1"})
    env.update({f"CLAWRL__{k.upper()}": str(v) for k, v in settings.items()})
    return env


@dataclass
class ServerProcess:
    """One CLI server child; ``start`` may be called again after ``kill`` (same port, same data)."""

    args: list[str]
    port: int
    env: dict[str, str]
    log_path: Path
    ready_path: str = "/metrics"  # answers 200 as soon as the app serves, whatever the engine does
    preexec_fn: Callable[[], None] | None = None
    proc: subprocess.Popen | None = None
    starts: int = 0
    startup_s: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(self.args)}\n".encode())
        self.proc = subprocess.Popen([sys.executable, "-m", "clawrl.cli", *self.args], cwd=REPO, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=self.preexec_fn)
        # The parent writes the log: a child under RLIMIT_FSIZE must not fail on its own log file.
        drain(self.proc.stdout, self.log_path)
        self.starts += 1

    def wait_ready(self, stall_s: float = STALL_S) -> float:
        """Seconds until ``ready_path`` answers 200. Waits while the child makes progress (CPU, log lines);
        raises with the log tail if it dies, or stalls for ``stall_s`` (:func:`tests.utils.waiting.wait_until`)."""
        t0 = time.monotonic()
        wait_until(lambda: httpx.get(self.url + self.ready_path, timeout=10.0).status_code == 200,
                   f"{self.args[0]} on port {self.port} to answer {self.ready_path}", proc=self.proc, log=self.log_path,
                   stall_s=stall_s)
        self.startup_s.append(time.monotonic() - t0)
        return self.startup_s[-1]

    def kill(self) -> None:
        """SIGKILL, as a crash would, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM (graceful: uvicorn drains and the lifespan closes the store); SIGKILL if it stalls."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # a busy machine makes the drain slow, not wrong: wait while it makes progress
                wait_until(lambda: self.proc.poll() is not None, f"{self.args[0]} to stop", proc=self.proc,
                           log=self.log_path)
            except AssertionError:
                self.kill()
        return self.proc.returncode

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except FileNotFoundError:
            return "(no log)"


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port`` now."""
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def gateway_process(tmp_path: Path, env: dict[str, str], *, port: int | None = None, name: str = "gateway",
                    **kw) -> ServerProcess:
    port = port or free_port()
    return ServerProcess(["serve", "--port", str(port)], port, env, tmp_path / f"{name}.log", **kw)


def engine_process(tmp_path: Path, env: dict[str, str], *, port: int | None = None, name: str = "engine",
                   **kw) -> ServerProcess:
    """`clawrl engine` (the embedded engine behind SGLang's HTTP API); ready when /health answers."""
    port = port or free_port()
    return ServerProcess(["engine", "--port", str(port)], port, env, tmp_path / f"{name}.log",
                         ready_path="/health", **kw)


@contextmanager
def agent_serve(tmp_path: Path, model_cache: Path, hook: str, context: int,
                max_new_tokens: int = 64) -> Iterator[ServerProcess]:
    """`clawrl serve` for a real agent's test: the tiny model with a ``context``-token window and
    answers of at most ``max_new_tokens``, scripted by the generate hook ``hook`` where the agent
    drives a conversation a random model cannot, a stall timeout long enough for the agent's slowest
    request."""
    port = free_port()
    env = serve_env(tmp_path / "data", model_cache, model__name="tiny-long", engine__max_context_len=context,
                    hooks__generate=hook, ppo__max_new_tokens=max_new_tokens, engine__stall_timeout_s=120)
    server = ServerProcess(["serve", "--port", str(port)], port, env, tmp_path / "serve.log")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


def printed_config(server: ServerProcess, agent: str) -> str:
    """What `clawrl serve --print-config AGENT` prints for ``server`` (its settings, its port): the
    block a user pastes into the agent's config."""
    out = run_to_end([sys.executable, "-m", "clawrl.cli", "serve", "--port", str(server.port), "--print-config",
                      agent], cwd=REPO, env=server.env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
