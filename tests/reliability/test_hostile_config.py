"""Hostile configuration: wrong types, unknown keys, missing or unreadable files, TOML that does not
parse, and secrets written into the file instead of the environment.

Through the real CLI (``clawrl config show -c FILE`` as a subprocess): exit code 2, one message on
stderr that names the problem (file, section, key, and the value unless it is a secret), nothing
on stdout, no traceback. The secret cases also go through ``load_settings``. Cases already covered
by tests/test_config.py at the library level (unknown key, wrong type, env errors) are only run
through the CLI here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.config import ConfigError, load_settings
from tests.utils.waiting import HANG_S, run_to_end

pytestmark = [pytest.mark.reliability]

SECRET = "sk-proj-Q3x9LmZp0aWv7Tn2Rb5Yc8Hd"  # made up; must never be printed back
SECRET2 = "hunter2-correct-horse-battery"  # not key-shaped: still never printed from a secret key

CASES = {  # name: (file text or None for "no file", fragments stderr must hold, text it must not hold)
    "wrong_type": ('[ppo]\nrollout_batch_size = "many"\n',
                   ["[ppo] rollout_batch_size = 'many'", "valid integer"], None),
    "unknown_key": ("[ppo]\nkl_coeff = 0.3\n", ["unknown key [ppo] kl_coeff", "valid keys:", "kl_coef"], None),
    "unknown_section": ("[nope]\nx = 1\n", ["unknown section [nope]", "valid sections:"], None),
    "section_not_a_table": ("ppo = 3\n", ["[ppo] must be a table, got 3"], None),
    "toml_syntax": ("[ppo\nlr = 1\n", ["not valid TOML", "line 1"], None),
    "toml_duplicate_key": ("[ppo]\nlr = 1e-5\nlr = 2e-5\n", ["not valid TOML", "Cannot overwrite", "line 3"], None),
    "not_utf8": (b"[ppo]\nlr = 1e-5 # \xff\xfe\n", ["not valid TOML", "not UTF-8"], None),
    "inf_and_nan": ("[ppo]\nlr = inf\nkl_coef = nan\n",
                    ["[ppo] lr = inf: Input should be a finite number", "[ppo] kl_coef = nan"], None),
    "negative_size": ("[ppo]\nrollout_batch_size = -4\n",
                      ["[ppo] rollout_batch_size = -4", "greater than or equal to 1"], None),
    "missing_file": (None, ["config file not found"], None),
    "directory": ("<dir>", ["is a directory"], None),
    "provider_api_key": (f'[provider]\nbase_url = "https://api.example/v1"\napi_key = "{SECRET}"\n',
                         ["[provider] api_key", "never read from config files", "[provider] api_key_env"], SECRET),
    "secret_named_keys": (f'[server]\nadmin_token = "{SECRET2}"\n',
                          ["[server] admin_token", "never read from config files"], SECRET2),
    "hook_secret": (f'[hooks]\nreward_secret = "{SECRET2}"\n', ["[hooks] reward_secret", "never read"], SECRET2),
    "literal_key_in_api_keys_env": (f'[server]\napi_keys_env = "{SECRET}"\n',
                                    ["[server] api_keys_env must be the NAME of an environment variable",
                                     "'CLAWRL_API_KEYS'"], SECRET),
    "key_list_in_api_keys_env": ('[server]\napi_keys_env = "alpha-key-1,beta-key-2"\n',
                                 ["[server] api_keys_env must be the NAME"], "alpha-key-1"),
    "key_in_provider_key_env": (f'[provider]\napi_key_env = "{SECRET}"\n', ["[provider] api_key_env must be the NAME"],
                                SECRET),
    "key_shaped_value_anywhere": (f'[provider]\nmodel = "{SECRET}"\n',
                                  ["[provider] model holds what looks like an API key"], SECRET),
    "secret_in_a_wrong_type": ('[ppo]\nrollout_batch_size = "Zx81kQ0aa9Lm2Pq7Zx81kQ0aa9"\n',
                               ["[ppo] rollout_batch_size = <a secret-looking value, not shown>"],
                               "Zx81kQ0aa9Lm2Pq7Zx81kQ0aa9"),
}


def _write_case(tmp_path: Path, name: str) -> Path:
    text = CASES[name][0]
    path = tmp_path / f"{name}.toml"
    if text == "<dir>":
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    return path


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL__")}
    env.update(extra)
    return env


def _config_show(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "clawrl.cli", "config", "show", "-c", str(path)], env=env)


@pytest.mark.timeout(HANG_S)
def test_cli_names_every_config_problem_without_a_traceback_or_a_secret(tmp_path):
    env = _clean_env()
    results = {}
    for name, (_, fragments, never) in CASES.items():
        path = _write_case(tmp_path, name)
        p = _config_show(path, env)
        results[name] = p.returncode
        assert p.returncode == 2, (name, p.returncode, p.stderr)
        assert p.stdout == "", (name, p.stdout)
        assert p.stderr.startswith("config error: ") and "Traceback" not in p.stderr, (name, p.stderr)
        assert len(p.stderr.splitlines()) == 1, (name, "one line, however many problems", p.stderr)
        assert str(path) in p.stderr, (name, p.stderr)  # the file is named
        for f in fragments:
            assert f in p.stderr, (name, f, p.stderr)
        if never is not None:
            assert never not in p.stderr, (name, "secret echoed", p.stderr)
    assert len(results) == len(CASES) == 19 and set(results.values()) == {2}
    # the control: a valid overlay prints the effective config and exits 0
    ok = tmp_path / "ok.toml"
    ok.write_text('[ppo]\nrollout_batch_size = 4\n[provider]\napi_key_env = "MY_PROVIDER_KEY"\n')
    p = _config_show(ok, env)
    assert p.returncode == 0 and "rollout_batch_size = 4" in p.stdout and 'api_key_env = "MY_PROVIDER_KEY"' in p.stdout


@pytest.mark.timeout(HANG_S)
def test_cli_refuses_a_secret_in_a_clawrl_env_variable(tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text("[ppo]\nrollout_batch_size = 4\n")
    p = _config_show(ok, _clean_env(CLAWRL__PROVIDER__API_KEY=SECRET))
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert "env CLAWRL__PROVIDER__API_KEY: [provider] api_key: secrets are never read" in p.stderr
    assert SECRET not in p.stderr


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_load_settings_refuses_secrets_without_repeating_them(tmp_path, name):
    path = _write_case(tmp_path, name)
    with pytest.raises(ConfigError) as e:
        load_settings(path, env={})
    msg = str(e.value)
    assert str(path) in msg and CASES[name][2] not in msg
    assert all(f in msg for f in CASES[name][1])


@pytest.mark.timeout(HANG_S)
def test_env_names_and_ordinary_values_are_not_mistaken_for_secrets(tmp_path):
    f = tmp_path / "fine.toml"
    f.write_text('[server]\napi_keys_env = "MY_GATEWAY_KEYS"\nadmin_keys_env = "my_admin_keys"\n'
                 '[provider]\napi_key_env = "OPENROUTER_API_KEY"\nmodel = "meta-llama/Llama-3.1-8B-Instruct"\n'
                 'base_url = "https://openrouter.ai/api/v1"\n[model]\nname = "hf_checkpoints/run-2026-01-01"\n')
    s = load_settings(f, env={})
    assert s.server.api_keys_env == "MY_GATEWAY_KEYS" and s.provider.api_key_env == "OPENROUTER_API_KEY"
    assert s.provider.model == "meta-llama/Llama-3.1-8B-Instruct" and s.model.name == "hf_checkpoints/run-2026-01-01"


@pytest.mark.timeout(HANG_S)
def test_a_context_above_the_models_own_is_a_config_error_naming_both(tmp_path, model_cache):
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import resolve_model_dir

    tiny = resolve_model_dir("tiny", model_cache)  # max_position_embeddings = 4096
    with pytest.raises(ConfigError, match="engine.max_context_len = 4097 is above the model's context of 4096 tokens"):
        EmbeddedEngine(tiny, max_context_len=4097)
    assert EmbeddedEngine(tiny, max_context_len=4096).max_context_len == 4096  # the model's own limit is allowed
    # `clawrl engine` says so and exits 2 before it binds a port
    env = _clean_env(CLAWRL__ENGINE__MAX_CONTEXT_LEN="16384", CLAWRL__STORAGE__MODEL_CACHE=str(model_cache),
                     CLAWRL__STORAGE__DATA_ROOT=str(tmp_path / "data"), CLAWRL__MODEL__DEVICE="cpu")
    p = run_to_end([sys.executable, "-m", "clawrl.cli", "engine", "--model", "tiny", "--port", "1"], env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("config error: engine.max_context_len = 16384 is above the model's context of 4096 "
                               "tokens") and "Traceback" not in p.stderr, p.stderr
