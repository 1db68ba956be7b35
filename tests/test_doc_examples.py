"""The doc examples' evaluators (tests/utils/doc_examples.py) on pages written here: a block that is wrong
fails, a skipped block is not run but its commands are parsed, a config block is loaded."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from sybil.example import SybilFailure

from clawrl.config import ConfigError
from tests.utils.doc_examples import DocPage, doc_examples

FENCE = "```"


@pytest.fixture
def run_page(tmp_path, model_cache):
    """Evaluates the blocks of a page with ``text`` in order, as the doc examples do."""

    def run(text: str) -> None:
        repo = Path(tempfile.mkdtemp(dir=tmp_path))
        (repo / "docs").mkdir()
        (repo / "docs" / "page.md").write_text(text)
        document = doc_examples(repo, fixture="doc_page").parse(repo / "docs" / "page.md")
        document.namespace["doc_page"] = DocPage(repo, model_cache)
        examples = list(document.examples())
        assert examples, "no block collected"
        for example in examples:
            example.evaluate()

    return run


def test_a_bash_block_stops_and_fails_at_its_first_failing_command(run_page):
    with pytest.raises(SybilFailure, match=r"bash exited with 3:\nbefore\n$"):
        run_page(f"{FENCE}bash\necho before\n(exit 3)\necho after\n{FENCE}\n")


def test_a_console_block_passes_only_when_the_command_prints_what_it_shows(run_page):
    run_page(f"{FENCE}console\n$ printf 'one\\ntwo  \\n'\none\ntwo\n$ echo $HOME/x\n/home/you/x\n{FENCE}\n")
    run_page(f"{FENCE}console\n$ echo a long line\na ... line\n{FENCE}\n")  # ... stands for any text
    with pytest.raises(SybilFailure, match="shown:\nthree\nprinted \\(exit 0\\):\nfour"):
        run_page(f"{FENCE}console\n$ echo four\nthree\n{FENCE}\n")


def test_a_python_block_runs_in_the_page_namespace_and_the_next_checks_what_it_printed(run_page):
    checked = "<!-- invisible-code-block: python\nassert printed == '7\\n' and x == 7\n-->\n"
    run_page(f"{FENCE}python\nx = 3 + 4\nprint(x)\n{FENCE}\n{checked}")
    with pytest.raises(AssertionError):
        run_page(f"{FENCE}python\nx = 3 + 4\nprint(x + 1)\n{FENCE}\n{checked}")


def test_a_skipped_block_is_not_run_but_its_clawrl_commands_are_parsed(run_page):
    skip = "<!-- skip: takes minutes: `make demo` runs it -->\n"
    with pytest.raises(pytest.skip.Exception, match="takes minutes: `make demo` runs it"):
        run_page(f"{skip}{FENCE}bash\nfalse\nclawrl replay 12 --exclude-session open:a \\\n  --reason x\n{FENCE}\n")
    with pytest.raises(AssertionError, match="No such option: --no-such-option"):
        run_page(f"{skip}{FENCE}bash\nclawrl replay 12 --no-such-option\n{FENCE}\n")
    with pytest.raises(AssertionError, match="make targets the Makefile lacks: \\['no-such-target'\\]"):
        run_page(f"<!-- skip: `make no-such-target` runs it -->\n{FENCE}bash\nfalse\n{FENCE}\n")


def test_a_clawrl_config_block_loads_through_the_settings(run_page):
    run_page(f'{FENCE}toml\n[ppo]\nlr = 1e-5\n\n[model]\nname = "tiny"\n{FENCE}\n')
    with pytest.raises(ConfigError, match=r"\[ppo\] lr = 'fast'"):
        run_page(f'{FENCE}toml\n[ppo]\nlr = "fast"\n{FENCE}\n')


def test_an_agent_config_block_must_be_what_print_config_prints(run_page):
    block = ('model = "clawrl-policy"\nmodel_provider = "clawrl"\nmodel_context_window = 2048\n\n'
             '[model_providers.clawrl]\nname = "clawrl"\nbase_url = "http://127.0.0.1:30000/v1"\n'
             'env_key = "CLAWRL_API_KEY"\nwire_api = "responses"\n')
    run_page(f"{FENCE}toml\n{block}{FENCE}\n")
    with pytest.raises(SybilFailure, match="is not what `clawrl serve --print-config codex` prints"):
        run_page(f"{FENCE}toml\n{block.replace('responses', 'chat')}{FENCE}\n")
