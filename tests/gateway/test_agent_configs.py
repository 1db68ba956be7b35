"""`clawrl serve --print-config AGENT`: the client configs carry this gateway's URL, model name and
context window, and parse as what each agent reads (the real agents run them in tests/test_openclaw.py
and tests/test_codex.py)."""

from __future__ import annotations

import json
import tomllib

from typer.testing import CliRunner

from clawrl.cli import app

ENV = {"CLAWRL__ENGINE__MAX_CONTEXT_LEN": "8192", "CLAWRL__PPO__MAX_NEW_TOKENS": "300"}


def printed(agent: str, *args: str) -> str:
    out = CliRunner().invoke(app, ["serve", "--print-config", agent, *args], env=ENV)
    assert out.exit_code == 0, out.output
    return out.output


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
