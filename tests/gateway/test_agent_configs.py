"""`clawrl serve --print-config AGENT`: the client configs carry this gateway's URL, model name and
the context window it serves, and parse as what each agent reads (the real agents run them in
tests/test_openclaw.py and tests/test_codex.py)."""

from __future__ import annotations

import json
import tomllib

from typer.testing import CliRunner

import pytest

from clawrl.cli import app
from tests.utils.gateway_process import engine_process, serve_env

ENV = {"CLAWRL__MODEL__NAME": "tiny-long", "CLAWRL__ENGINE__MAX_CONTEXT_LEN": "8192",
       "CLAWRL__PPO__MAX_NEW_TOKENS": "300"}


@pytest.fixture(autouse=True)
def _test_models(model_cache, monkeypatch):
    monkeypatch.setenv("CLAWRL__STORAGE__MODEL_CACHE", str(model_cache))


def printed(agent: str, *args: str, env: dict | None = None) -> str:
    out = CliRunner().invoke(app, ["serve", "--print-config", agent, *args], env=env or ENV)
    assert out.exit_code == 0, out.output
    return out.stdout  # what a user redirects into the agent's config (a first model build reports on stderr)


def test_codex_config_is_toml_naming_this_gateway():
    config = tomllib.loads(printed("codex", "--port", "31234", "--host", "0.0.0.0"))
    assert (config["model"], config["model_provider"], config["model_context_window"]) == ("clawrl-policy", "clawrl", 8192)
    assert config["model_providers"]["clawrl"] == {"name": "clawrl", "base_url": "http://127.0.0.1:31234/v1",
                                                   "env_key": "CLAWRL_API_KEY", "wire_api": "responses"}


def test_openclaw_config_is_json_naming_this_gateway():
    config = json.loads(printed("openclaw", "--port", "31235"))
    provider = config["models"]["providers"]["clawrl"]
    assert provider["baseUrl"] == "http://127.0.0.1:31235/v1" and provider["apiKey"] == "${CLAWRL_API_KEY}"
    [model] = provider["models"]
    assert (model["id"], model["contextWindow"], model["maxTokens"]) == ("clawrl-policy", 8192, 300)
    assert model["compat"]["supportsPromptCacheKey"] is True
    assert config["agents"]["defaults"]["model"]["primary"] == "clawrl/clawrl-policy"


def test_openai_snippet_is_python_naming_this_gateway():
    code = printed("openai")
    compile(code, "snippet", "exec")
    assert 'base_url="http://127.0.0.1:30000/v1"' in code and 'model="clawrl-policy"' in code


def test_an_unknown_agent_is_refused_with_the_choices():
    out = CliRunner().invoke(app, ["serve", "--print-config", "cursor"], env=ENV)
    assert out.exit_code == 2 and "'openclaw', 'codex', 'openai'" in out.output


def test_the_context_printed_is_the_one_served_not_the_setting():
    """[engine] max_context_len = 0 serves the model's own limit (tiny-long: 32768 positions), and
    that is what a client is told: an agent told 0 refuses the config (OpenClaw) or compacts at once
    (Codex). A setting above the limit is the gateway's config error, in one line."""
    own = {**ENV, "CLAWRL__ENGINE__MAX_CONTEXT_LEN": "0"}
    assert json.loads(printed("openclaw", env=own))["models"]["providers"]["clawrl"]["models"][0][
        "contextWindow"] == 32768
    assert tomllib.loads(printed("codex", env=own))["model_context_window"] == 32768
    assert "context: 32768 tokens" in printed("openai", env=own)
    out = CliRunner().invoke(app, ["serve", "--print-config", "codex"],
                             env={**ENV, "CLAWRL__ENGINE__MAX_CONTEXT_LEN": "40000"})
    assert out.exit_code == 2 and out.output.count("\n") == 1
    assert "config error: engine.max_context_len = 40000 is above the model's context of 32768" in out.output


def test_an_http_engine_is_asked_its_context(tmp_path, model_cache):
    """With [engine] url, the gateway serves the engine's context: the printed config asks the engine
    (its /server_info); one that does not answer is one line, not a config with a guess."""
    env = serve_env(tmp_path / "data", model_cache, engine__max_context_len=512)
    engine = engine_process(tmp_path, env)
    engine.start()
    try:
        engine.wait_ready()
        config = printed("codex", env={**ENV, "CLAWRL__ENGINE__URL": engine.url})
    finally:
        engine.stop()
    assert tomllib.loads(config)["model_context_window"] == 512
    out = CliRunner().invoke(app, ["serve", "--print-config", "openclaw"],
                             env={**ENV, "CLAWRL__ENGINE__URL": engine.url})
    assert out.exit_code == 2 and out.output == (f"no context to print: engine at {engine.url} unreachable: "
                                                 "connection refused; start the engine, then print the config again\n")
