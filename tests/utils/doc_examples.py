"""The docs run as tests. Sybil collects every fenced python, bash, console, toml and json5 block of README.md
and docs/*.md as a pytest item named by its page and line; the blocks of a page run in order, in one namespace,
against one temporary HOME and data root (the tiny model), as a user who pastes them one after another:

- python: executed in the page's namespace; what it printed is ``printed`` there, so the page's next block -
  visible, or an ``<!-- invisible-code-block: python -->`` that checks what the one above shows - can assert on it.
- bash: run by bash (``-euo pipefail``) with the environment's ``clawrl`` first on PATH: any failing command fails
  the block, with its output.
- console: ``$ command`` lines, each followed by what it prints, which must be what it printed (``...`` matches
  any text; an error shown is checked like any other output).
- toml / json5: parsed; a clawrl config loads through clawrl.config, an agent's config (Codex's TOML,
  OpenClaw's JSON5) is what ``clawrl serve --print-config AGENT`` prints.
- a block right after ``<!-- skip: REASON -->`` (a GPU, a real agent, minutes) is collected and skipped with
  REASON, which names the make target that runs it; its ``clawrl`` commands are still parsed by the CLI
  (``--help`` appended), and every ``make`` target the reason names must exist.

The gateway a block talks to is the page's own `clawrl serve`, started when a block first names the documented
address: what runs has that address and the placeholder key replaced by the page gateway's; the page's text
stays what a user pastes.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest import mock

import json5
import pytest
from sybil import Example, Sybil
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from clawrl.ports import free_port
from tests.utils.gateway_process import ServerProcess
from tests.utils.waiting import run_to_end

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/*.md"]
DOC_ADDRESSES = ("127.0.0.1:30000", "localhost:30000")  # where the docs say the gateway answers (the default api_port)
PLACEHOLDER_KEY = "YOUR_KEY"  # the README's stand-in for "a key from $CLAWRL_API_KEYS"
PAGE_KEY = "doc-page-key"
PROMPT = "$ "  # a console block's command lines; the lines under one are what it prints
HOME_SHOWN = "/home/you"  # how the docs write a user's home directory in what a command prints
# The agents whose config files the docs show, by the block's language, and where that config names its context
# window: the blocks say it is clawrl's [engine] max_context_len, so they are printed with that setting.
AGENT_BLOCKS = {
    "toml": ("codex", lambda c: c["model_context_window"]),
    "json5": ("openclaw", lambda c: c["models"]["providers"]["clawrl"]["models"][0]["contextWindow"]),
}


class DocPage:
    """One page's world: a temporary HOME (the default data root ``~/.clawrl`` is under it), the shared model
    cache, the tiny model, an API key, and the page's gateway once a block needs it."""

    def __init__(self, root: Path, model_cache: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        self.model_cache = model_cache
        self.env = self.user_env(CLAWRL__MODEL__NAME="tiny", CLAWRL__ENGINE__MAX_CONTEXT_LEN="512",
                                 CLAWRL__PPO__MAX_NEW_TOKENS="16", CLAWRL_API_KEYS=PAGE_KEY, CLAWRL_API_KEY=PAGE_KEY)
        self._gateway: ServerProcess | None = None

    def user_env(self, **extra: str) -> dict[str, str]:
        """A user's shell here: this environment's ``clawrl`` first on PATH, HOME the page's, no clawrl settings
        but the model cache (models are converted once per machine) and ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL")}
        env.update(HOME=str(self.home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                   CLAWRL__STORAGE__MODEL_CACHE=str(self.model_cache), PYTHONUNBUFFERED="1", **extra)
        return env

    def gateway(self) -> ServerProcess:
        if self._gateway is None:
            port = free_port()
            self._gateway = ServerProcess(["serve", "--port", str(port)], port, self.env, self.root / "serve.log")
            self._gateway.start()
            self._gateway.wait_ready()
        return self._gateway

    def run(self, source: str) -> subprocess.CompletedProcess:
        """``source`` run by bash as a user's shell would, in the clone, stopping at the first failing command;
        what it printed (stdout and stderr as a terminal shows them) in ``stdout``. The page's blocks are one
        terminal: what a block exports (``export CLAWRL__PPO__ADAPTERS=namespace``) the blocks after it see."""
        exports = self.root / "exports.sh"
        # stderr into stdout as a terminal shows them; waited for while it progresses (tests/utils/waiting.py)
        script = f"exec 2>&1\n[ -f {exports} ] && source {exports}\n{self.localize(source)}\nexport -p > {exports}"
        return run_to_end(["bash", "-euo", "pipefail", "-c", script], "a doc block", cwd=REPO, env=self.env)

    def localize(self, source: str) -> str:
        """``source`` as it runs here: the documented gateway address is this page's gateway (started on its
        first mention), the placeholder key this page's key."""
        if any(address in source for address in DOC_ADDRESSES):
            where = self.gateway().url.removeprefix("http://")
            for address in DOC_ADDRESSES:
                source = source.replace(address, where)
        return source.replace(PLACEHOLDER_KEY, PAGE_KEY)

    def close(self) -> None:
        if self._gateway is not None:
            self._gateway.stop()


def run_python(example: Example) -> None:
    page: DocPage = example.namespace["doc_page"]
    source = pad(page.localize(example.parsed), example.line + example.parsed.line_offset)
    printed = io.StringIO()
    with mock.patch.dict(os.environ, {"CLAWRL_API_KEY": PAGE_KEY}), contextlib.redirect_stdout(printed):
        exec(compile(source, example.path, "exec", dont_inherit=True), example.namespace)
    example.namespace.pop("__builtins__", None)
    example.namespace["printed"] = printed.getvalue()


def run_bash(example: Example) -> str | None:
    done = example.namespace["doc_page"].run(example.parsed)
    example.namespace["printed"] = done.stdout
    if done.returncode != 0:
        return f"bash exited with {done.returncode}:\n{done.stdout[-4000:]}"
    return None


def run_console(example: Example) -> str | None:
    """A shell session as the page shows it: each ``$ command`` runs, and what it prints (stdout and stderr, the
    page's HOME written as /home/you, trailing spaces dropped) must be the lines shown under it; ``...`` stands
    for any text. A command may fail: an error shown is an error the page promises."""
    page: DocPage = example.namespace["doc_page"]
    problems = []
    for command, shown in _commands_and_output(example.parsed):
        done = page.run(command)
        printed = _trimmed(done.stdout.replace(str(page.home), HOME_SHOWN))
        if not doctest.OutputChecker().check_output(_trimmed(shown), printed, doctest.ELLIPSIS):
            problems.append(f"$ {command}\nshown:\n{shown}printed (exit {done.returncode}):\n{printed}")
    return "\n".join(problems) or None


def _commands_and_output(session: str) -> list[list[str]]:
    """``[command, shown output]`` for each ``$ `` line of a console block (a command ending in a backslash goes on
    on the next line)."""
    pairs: list[list[str]] = []
    for line in session.splitlines(keepends=True):
        if pairs and not pairs[-1][1] and pairs[-1][0].rstrip().endswith("\\"):
            pairs[-1][0] += line
        elif line.startswith(PROMPT):
            pairs.append([line.removeprefix(PROMPT), ""])
        elif pairs:
            pairs[-1][1] += line
    return pairs


def _trimmed(text: str) -> str:
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def check_config(example: Example) -> str | None:
    language = example.region.lexemes["arguments"]
    config = tomllib.loads(example.parsed) if language == "toml" else json5.loads(example.parsed)
    page: DocPage = example.namespace["doc_page"]
    from clawrl.config import Settings, load_settings

    if language == "toml" and set(config) <= set(Settings.model_fields):  # a clawrl config file
        path = page.root / f"line{example.line}.toml"
        path.write_text(example.parsed)
        load_settings(path, env={})
        return None
    agent, context_of = AGENT_BLOCKS[language]
    env = page.user_env(CLAWRL__ENGINE__MAX_CONTEXT_LEN=str(context_of(config)))
    done = run_to_end(["clawrl", "serve", "--print-config", agent], env=env)
    if done.returncode != 0:
        return f"clawrl serve --print-config {agent} exited with {done.returncode}:\n{done.stderr}"
    printed = tomllib.loads(done.stdout) if language == "toml" else json.loads(done.stdout)
    if printed != config:
        return f"the block is not what `clawrl serve --print-config {agent}` prints:\n{done.stdout}"
    return None


def skip_block(reason: str, example: Example) -> None:
    """The block is not run here: its ``clawrl`` commands are parsed (an unknown command or option fails), the
    make targets its reason names must exist, then it is skipped with that reason."""
    from typer.testing import CliRunner

    from clawrl.cli import app

    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    missing = [t for t in re.findall(r"`make ([a-z][a-z-]*)`", reason) if t not in targets]
    assert not missing, f"the skip reason names make targets the Makefile lacks: {missing}"
    for line in example.parsed.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["clawrl"]:
            parsed = CliRunner().invoke(app, [*words[1:], "--help"])
            assert parsed.exit_code == 0, f"{line.strip()}:\n{parsed.output}"
    # reported at the block's page and line, as a skip marker's would be
    raise pytest.skip.Exception(reason, _use_item_location=True)


class DocBlockParser:
    """Sybil's Markdown code blocks of one language, each evaluated by ``evaluator`` unless it follows a
    ``<!-- skip: REASON -->`` comment."""

    def __init__(self, language: str, evaluator) -> None:
        self.blocks = CodeBlockParser(language, evaluator)
        self.skips = DirectiveInHTMLCommentLexer("skip")

    def __call__(self, document):
        skips = {region.end: region.lexemes["arguments"] for region in self.skips(document)}
        for region in self.blocks(document):
            # the comment's region ends before its closing '-->'; only blank space may follow that, up to the block
            # (a comment after the block, whose slice up to it is empty, skips nothing)
            reason = next((why for end, why in skips.items()
                           if end <= region.start and not document.text[end:region.start].replace("-->", "", 1).strip()),
                          None)
            if reason is not None:
                region.evaluator = lambda example, why=reason: skip_block(why, example)
            yield region


EVALUATORS = {"python": run_python, "bash": run_bash, "console": run_console, "toml": check_config,
              "json5": check_config}


def doc_examples(repo: Path, fixture: str) -> Sybil:
    """The Sybil that collects the pages' blocks; ``fixture`` names the page fixture (a DocPage)."""
    parsers = [DocBlockParser(language, evaluator) for language, evaluator in EVALUATORS.items()]
    return Sybil(parsers=parsers, path=str(repo), patterns=PAGES, fixtures=[fixture])
