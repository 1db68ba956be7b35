from pathlib import Path

import pytest

from clawrl.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Method,
    config_hash,
    dump_toml,
    load_settings,
    parse_override,
    read_api_keys,
)


def test_defaults_load_with_source_design_values():
    s = load_settings(env={})
    assert s.ppo.clip_range == 0.2 and s.ppo.clip_range_high == 0.28
    assert s.ppo.rollout_batch_size == 32 and s.ppo.max_new_tokens == 512
    assert s.ppo.advantage_estimator is Method.COMBINE
    assert s.prm.judge_samples == 3 and s.prm.score_range == [-1, 0, 1]
    assert s.server.api_port == 30000 and s.server.default_turn_type == "main"
    assert s.storage.data_root.is_absolute()


def test_overlay_file_then_env_override(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[ppo]\nrollout_batch_size = 4\nkl_coef = 0.5\n[provider]\nbase_url = "http://x/v1/"\n')
    env = {"CLAWRL__PPO__KL_COEF": "0.25", "CLAWRL__SERVER__OPEN_MODE": "true", "UNRELATED": "1"}
    s = load_settings(f, env=env)
    assert s.ppo.rollout_batch_size == 4  # from the file
    assert s.ppo.kl_coef == 0.25  # env beats file
    assert s.server.open_mode is True
    assert s.provider.base_url == "http://x/v1"  # trailing slash stripped


def test_unknown_key_names_key_file_and_valid_keys(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[ppo]\nclip_rnage = 0.3\n")
    with pytest.raises(ConfigError) as e:
        load_settings(f, env={})
    msg = str(e.value)
    assert "clip_rnage" in msg and str(f) in msg and "clip_range_high" in msg


def test_wrong_type_names_key_value_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[ppo]\nrollout_batch_size = "many"\n')
    with pytest.raises(ConfigError) as e:
        load_settings(f, env={})
    msg = str(e.value)
    assert "rollout_batch_size" in msg and "'many'" in msg and str(f) in msg


def test_env_error_names_the_variable():
    with pytest.raises(ConfigError, match="env CLAWRL__PPO__CLIP_RANGE"):
        load_settings(env={"CLAWRL__PPO__CLIP_RANGE": "wide"})
    with pytest.raises(ConfigError, match="unknown section \\[nope\\]"):
        load_settings(env={"CLAWRL__NOPE__X": "1"})


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "absent.toml", env={})
    f = tmp_path / "broken.toml"
    f.write_text("[ppo\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(f, env={})


def test_settings_are_frozen():
    s = load_settings(env={})
    with pytest.raises(Exception):
        s.ppo.clip_range = 0.5  # type: ignore[misc]


def test_overrides_and_parse_override():
    assert parse_override("ppo.kl_coef=0.05") == ("ppo.kl_coef", 0.05)
    assert parse_override("model.name=tiny") == ("model.name", "tiny")
    s = load_settings(env={}, overrides=dict([parse_override("ppo.kl_coef=0.05")]))
    assert s.ppo.kl_coef == 0.05
    with pytest.raises(ConfigError):
        parse_override("nokey")


def test_dump_toml_round_trips(tmp_path):
    s = load_settings(env={}, overrides={"ppo.kl_coef": 0.123, "model.name": "tiny"})
    f = tmp_path / "dumped.toml"
    f.write_text(dump_toml(s))
    again = load_settings(f, env={})
    assert again == s
    assert config_hash(again) == config_hash(s)
    assert config_hash(load_settings(env={})) != config_hash(s)


def test_http_engine_requires_url():
    with pytest.raises(ConfigError, match="engine.url"):
        load_settings(env={"CLAWRL__ENGINE__KIND": "http"})


def test_api_keys_from_named_env(monkeypatch):
    monkeypatch.setenv("MY_KEYS", " k1, k2 ,")
    assert read_api_keys("MY_KEYS") == ["k1", "k2"]
    monkeypatch.setenv("MY_KEYS", "changeme")
    with pytest.raises(ConfigError, match="placeholder"):
        read_api_keys("MY_KEYS")


def test_default_file_is_the_repo_default():
    assert DEFAULT_CONFIG_PATH == Path(__file__).resolve().parent.parent / "conf" / "default.toml"
