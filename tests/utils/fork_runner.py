"""Run Python snippets in real child processes forked from one pre-imported parent (a "zygote").

A crash test needs a fresh process per kill, and importing torch + transformers + Prefect + MLflow
costs ~10 s of CPU per process on 2 cores. The zygote imports them once (no thread, no event loop
and no torch op runs in it, so forking is safe); each job is a ``fork()`` of it: a real process
with its own pid, which the job's code SIGKILLs at the point under test (or which runs to the
end). The parent answers with the child's exit code, ``-9`` for a SIGKILL.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_ZYGOTE = textwrap.dedent("""
    import json, os, sys, traceback
    from clawrl.config import apply_offline_env
    apply_offline_env()
    for name in json.loads(sys.argv[1]):
        __import__(name)
    print("ready", flush=True)
    spawned = set()
    for line in sys.stdin:
        for p in list(spawned):  # reap servers that were killed meanwhile
            if os.waitpid(p, os.WNOHANG)[0]:
                spawned.discard(p)
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                exec(compile(job["code"], "<job>", "exec"), {"__name__": "__job__"})
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if not job["wait"]:
            spawned.add(pid)
            print(json.dumps({"pid": pid}), flush=True)
            continue
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}), flush=True)
""")

PRELOAD = ["clawrl.flows.train", "clawrl.flows.judge", "clawrl.train.torch_backend", "clawrl.lineage", "mlflow.tracking",
           "mlflow.data", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
           "pandas", "safetensors.torch", "transformers", "transformers.models.llama.modeling_llama"]


class ForkRunner:
    def __init__(self, env: dict[str, str], log_dir: Path, preload: list[str] = PRELOAD):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stderr = open(self.log_dir / "zygote.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, json.dumps(preload)], cwd=REPO,
                                     env={**env, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        self._ready = False
        self.jobs = 0

    def wait_ready(self) -> None:
        if not self._ready:
            line = self.proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"zygote failed: {line!r}\n{(self.log_dir / 'zygote.log').read_text()[-3000:]}")
            self._ready = True

    def _submit(self, code: str, name: str, wait: bool) -> tuple[dict, Path]:
        self.wait_ready()
        log = self.log_dir / f"{self.jobs:02d}-{name}.log"
        self.jobs += 1
        self.proc.stdin.write(json.dumps({"code": textwrap.dedent(code), "log": str(log), "wait": wait}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote died:\n{(self.log_dir / 'zygote.log').read_text()[-3000:]}")
        return json.loads(line), log

    def run(self, code: str, name: str) -> tuple[int, str]:
        """Fork a child that runs ``code`` and wait for it; return (its exit code, its output)."""
        reply, log = self._submit(code, name, wait=True)
        return reply["exit"], (log.read_text() if log.exists() else "")

    def spawn(self, code: str, name: str) -> tuple[int, Path]:
        """Fork a long-running child (a server) and return (its pid, its log file) at once; the
        caller stops it with SIGKILL, as a crash would."""
        reply, log = self._submit(code, name, wait=False)
        return reply["pid"], log

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, 9)
                self.proc.wait(30)
        self._stderr.close()


_shared: ForkRunner | None = None


def shared_fork_runner(env: dict[str, str], log_dir: Path) -> ForkRunner:
    """One zygote for the whole test session (its imports are paid once), closed at exit."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = ForkRunner(env, log_dir)
        atexit.register(_shared.close)
    return _shared
