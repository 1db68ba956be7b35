"""Numbers a user types on the command line are checked where typer parses them: a count of 0, a negative
step count, a port out of range or a concurrency list with a word in it is refused with the option's name,
exit 2, before anything starts (before, `clawrl demo --users 0` raised from inside a started demo, `--steps
-1` ran a demo of no steps, and `clawrl bench gateway --concurrency 0` died in numpy)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from clawrl.cli import app


@pytest.mark.parametrize("args,option,says", [
    (["demo", "--users", "0"], "--users", "Input should be greater than or equal to 1"),
    (["demo", "--steps", "-1"], "--steps", "Input should be greater than or equal to 1"),
    (["demo", "--max-tokens", "0"], "--max-tokens", "Input should be greater than or equal to 1"),
    (["train", "--steps", "0"], "--steps", "Input should be greater than or equal to 1"),
    (["judge", "--limit", "0"], "--limit", "Input should be greater than or equal to 1"),
    (["serve", "--port", "70000"], "--port", "Input should be less than or equal to 65535"),
    (["up", "--judge-every", "0"], "--judge-every", "Input should be greater than or equal to 1"),
    (["bench", "gateway", "--concurrency", "0"], "--concurrency", "'0' is not a whole number >= 1"),
    (["bench", "gateway", "--concurrency", "1,four"], "--concurrency", "'four' is not a whole number >= 1"),
    (["bench", "gateway", "--concurrency", ""], "--concurrency", "expected at least one whole number >= 1"),
    (["bench", "engine", "--hf-batch", "1,-2"], "--hf-batch", "'-2' is not a whole number >= 1"),
    (["bench", "long-prompt", "--chunks", "512,x"], "--chunks", "'x' is not a whole number >= 1"),
    (["bench", "load", "--sessions", "0"], "--sessions", "Input should be greater than or equal to 1"),
    (["bench", "judge", "--turns", "0"], "--turns", "Input should be greater than or equal to 1"),
])
def test_a_bad_number_is_refused_by_its_option(args, option, says):
    res = CliRunner().invoke(app, args)
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{option}'" in text and says in text, text


def test_an_empty_list_is_allowed_where_it_means_skip():
    """`--hf-batch ''` skips HF generate and `--prefixes ''` the prefix-cache part: typer accepts them (the
    bench itself is not run here: --help after the values stops before it)."""
    for args in (["bench", "engine", "--hf-batch", "", "--help"], ["bench", "long-prompt", "--prefixes", "", "--help"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0 and "Usage:" in res.output, res.output


@pytest.mark.parametrize("args,says", [
    (["--persona", "nosuch"], "Invalid value for --persona: 'nosuch'; valid: concise, signoff, lowercase, bullets, "
                              "french, detailed, paragraphs, plain"),
    (["--model", "nosuch"], "Invalid value for --model: model 'nosuch': not a known name"),
    (["--scenario", "nosuch"], "Invalid value for --scenario: 'nosuch'; valid: persona, tools, users"),
])
def test_the_demo_refuses_an_unknown_name_before_it_starts(tmp_path, args, says):
    """Before, an unknown persona raised from inside the running demo (Prefect server, engine and gateway
    already up, ~20 s in) and an unknown model from the engine's loader, both as tracebacks."""
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["demo", *args, "--run-dir", str(run)])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
    assert not run.exists()  # nothing written


@pytest.mark.parametrize("command,key", [("serve", "[server] api_port"), ("engine", "--port")])
def test_a_taken_port_is_told_before_the_model_loads(tmp_path, command, key):
    """Before, `clawrl serve` loaded the model, printed "gateway on http://..." and then uvicorn failed to bind
    (exit 3); an address that is not this machine's is named the same way."""
    from clawrl.serving import bind_socket

    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    conf = tmp_path / "c.toml"
    conf.write_text(f'[model]\nname = "nosuch-model-never-loaded"\n[storage]\ndata_root = "{tmp_path / "data"}"\n')
    try:
        res = CliRunner().invoke(app, [command, "--port", str(port), "-c", str(conf)])
        other = CliRunner().invoke(app, [command, "--host", "192.0.2.1", "--port", str(port), "-c", str(conf)])
    finally:
        taken.close()
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"port {port} on 127.0.0.1 is in use by another process" in text, res.output
    assert key in text
    assert other.exit_code == 2 and "192.0.2.1 is not an address of this machine" in " ".join(other.output.split())
