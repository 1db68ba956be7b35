"""The README and the guides say only what exists and stay short enough to read: every relative link names
a file of the repo, every `clawrl ...` command (and each of its --options) named in the text is one the CLI
has, every `make` target one the Makefile has; the README and the results page keep their length limits.
The pages' fenced blocks are run, or parsed where they are skipped, by the doc examples (conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from clawrl.cli import app

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200
RESULTS_MAX_LINES = 400  # docs/benchmarks.md: each benchmark's latest result; superseded runs live in git history


def _commands(text: str) -> list[str]:
    """What a page's text names to run: its inline `code` spans (its fenced blocks run as doc examples)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _clawrl_invocations(text: str) -> list[list[str]]:
    """Each `clawrl WORD [WORD] [--opt ...]` a page's text names, as its words (up to a pipe, a semicolon,
    a comment or a redirection)."""
    found = []
    for command in _commands(text):
        for m in re.finditer(r"(?:^|[;&|(]\s*|^\$\s*)clawrl ((?:[a-z][a-z-]*)(?: [^|;#`>]*)?)", command.strip()):
            found.append(m.group(1).split())
    return found


def _resolve(words: list[str]):
    """The CLI command the words name (a group has ``commands``), and the words after it."""
    cmd = typer.main.get_command(app)
    rest = list(words)
    while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
        cmd = cmd.commands[rest.pop(0)]
    return cmd, rest


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_names_a_file(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_clawrl_command_and_option_shown_exists(page):
    problems = []
    for words in _clawrl_invocations(page.read_text()):
        cmd, rest = _resolve(words)
        if hasattr(cmd, "commands"):
            if rest and not rest[0].startswith(("-", "[", "<")) and rest[0] not in ("NAME",):
                problems.append(f"clawrl {' '.join(words)}: no command {rest[0]!r}")
            continue
        options = {o for p in cmd.params for o in p.opts + p.secondary_opts}
        for word in rest:
            opt = word.split("=")[0].strip("[]\\")
            if opt.startswith("--") and opt not in options and opt != "--help":
                problems.append(f"clawrl {' '.join(words)}: {cmd.name} has no option {opt}")
    assert not problems, "\n".join(problems)


def test_every_code_block_is_in_a_language_the_doc_examples_run():
    """A block in another language (``sh``, ``py``) would be shown to users and never run; ``text`` and unlabelled
    blocks are pictures and output."""
    from tests.utils.doc_examples import EVALUATORS

    for page in PAGES:
        fences = re.findall(r"^ *```(\S*)", page.read_text(), re.M)[::2]  # opening fences: every other one
        assert set(fences) <= {*EVALUATORS, "text", ""}, f"{page.name}: {fences}"


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", (REPO / "README.md").read_text()))
    assert {"demo", "test"} <= named and named <= targets, named - targets


def test_the_readme_stays_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; guides belong in docs/"


def test_the_results_page_stays_short():
    lines = (REPO / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= RESULTS_MAX_LINES, f"docs/benchmarks.md has {lines} lines, over {RESULTS_MAX_LINES}"


def test_no_page_help_text_or_message_names_a_removed_setting():
    """What a user reads - the docs, the config files, the CLI's help and every message and docstring of the
    library - names only settings that exist: a key clawrl/config_removed.py lists is an error in a config
    file, so text that tells a user to set it is wrong."""
    from clawrl.config_removed import REMOVED_KEYS

    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "conf").glob("*.toml")),
               *sorted(p for d in ("clawrl", "flows", "storage") for p in (REPO / d).rglob("*.py")
                       if p.name != "config_removed.py")]
    named = [f"{p.relative_to(REPO)}:{i}: {m.group(0)}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1)
             for m in re.finditer(r"\[(\w+)\]`*\s+`*(\w+)", line) if m.groups() in REMOVED_KEYS]
    assert named == []
