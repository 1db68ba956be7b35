"""BFCL, the Berkeley Function Calling Leaderboard (PyPI ``bfcl-eval``), seen from clawrl: where its
environment is, and its prompts and checker through ``clawrl/sim/bfcl_plugin.py`` run by BFCL's own
Python. BFCL pins its own dependencies (numpy 1.26, tree-sitter, ...), so it lives in an environment of
its own, ``.tools/bfcl`` (`make bfcl`), never in clawrl's: the two talk over pipes and HTTP only.

:class:`BfclWorker` keeps one ``bfcl_plugin.py serve`` process for the gate evaluator (importing BFCL
takes seconds: it is paid once per process): it draws BFCL prompts and scores answers with BFCL's own
checker, the verdict its leaderboard gives that answer.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import Any

from clawrl.chat import tool_calls_in
from clawrl.config import child_env

BFCL_VERSION = "2026.3.23"  # bfcl-eval on PyPI, as `make bfcl` installs it
BFCL_ENV = Path(__file__).resolve().parents[2] / ".tools" / "bfcl"
PLUGIN = Path(__file__).with_name("bfcl_plugin.py")
REGISTRY_NAME = "clawrl"  # the plugin's entry in BFCL's model registry


class BfclMissing(RuntimeError):
    """BFCL's environment is not there."""


def bfcl_python(env: Path | None = None) -> Path:
    """The Python of BFCL's environment; BfclMissing saying how to get it when it is not there."""
    env = env or BFCL_ENV
    python = env / "bin" / "python"
    if not python.exists():
        raise BfclMissing(f"BFCL is not installed ({python} not found): `make bfcl` installs bfcl-eval=={BFCL_VERSION} "
                          f"into {env} (from PyPI once, offline afterwards)")
    return python


def bfcl_env(base_url: str = "http://127.0.0.1:9/v1", **extra: str) -> dict[str, str]:
    """The environment of a BFCL process: its OpenAI client pointed at ``base_url`` (a gateway; the
    default reaches nothing, for the checker, which never asks), offline."""
    return child_env(OPENAI_BASE_URL=base_url, OPENAI_API_KEY="clawrl", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                     **extra)


class BfclWorker:
    """One ``bfcl_plugin.py serve`` process: :meth:`sample` and :meth:`check` (the plugin's docstring).
    Thread-safe; the process ends with this one (its stdin closes)."""

    def __init__(self, command: list[str]) -> None:
        self._stderr = tempfile.TemporaryFile()  # BFCL's warnings; the end of it names why the process died
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=bfcl_env(), stderr=self._stderr)
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            line = ""
            if self._proc.poll() is None:
                try:
                    self._proc.stdin.write(json.dumps(request) + "\n")
                    self._proc.stdin.flush()
                    line = self._proc.stdout.readline()
                except BrokenPipeError:
                    pass
            if not line:
                self._stderr.seek(0)
                tail = self._stderr.read().decode(errors="replace")[-1500:]
                raise RuntimeError(f"BFCL's worker exited with code {self._proc.wait()}: {tail}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"BFCL's worker failed on {request.get('op')} {request.get('id', '')}: {out['error']}")
        return out

    def sample(self, counts: dict[str, int], seed: int) -> list[dict[str, Any]]:
        """``counts[c]`` prompts of each category ``c``: id, category, messages, tools."""
        return self._ask({"op": "sample", "counts": counts, "seed": seed})["prompts"]

    def check(self, entry_id: str, result: list[dict[str, str]] | str) -> bool:
        """BFCL's verdict on ``result`` (tool calls as ``{name: JSON arguments}``, else the reply's text)."""
        return self._ask({"op": "check", "id": entry_id, "result": result})["valid"]

    def describe(self) -> dict[str, Any]:
        """The handler of clawrl's registry entry and what it pins (seed, answer budget)."""
        return self._ask({"op": "describe"})

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


@cache
def worker() -> BfclWorker:
    """This process's BFCL worker (started at the first call)."""
    return BfclWorker([str(bfcl_python()), str(PLUGIN), "serve"])


def as_result(answer: str, tools: list[dict[str, Any]]) -> list[dict[str, str]] | str:
    """What BFCL's handler records for a reply in raw text ``answer``: the calls of offered tools that the
    gateway would return as ``tool_calls`` (``clawrl.chat``), ``{name: JSON arguments}`` each, or the
    text when it has none."""
    calls = tool_calls_in(answer, {t["function"]["name"] for t in tools})
    return [{name: args} for name, args in calls] if calls else answer
