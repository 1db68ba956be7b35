from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawrl.cli import app
from clawrl.config import (
    ConfigError,
    Method,
    config_hash,
    dump_toml,
    load_settings,
    parse_override,
    read_api_keys,
)
from clawrl.config_defaults import dump_defaults
from clawrl.models import resolve_dtype

REPO = Path(__file__).resolve().parent.parent


def test_defaults_load_with_source_design_values():
    s = load_settings(env={})
    assert s.ppo.rollout_batch_size == 32 and s.ppo.max_new_tokens == 512
    assert s.ppo.advantage_estimator is Method.COMBINE
    assert s.prm.judge_samples == 3
    assert s.server.api_port == 30000 and s.server.default_turn_type == "main"
    assert s.storage.data_root.is_absolute()


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert load_settings(env={}).model.dtype == "auto"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(ConfigError, match="model.dtype"):
        load_settings(env={}, overrides={"model.dtype": "bf16"})


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
    f.write_text("[ppo]\nkl_coeff = 0.3\n")
    with pytest.raises(ConfigError) as e:
        load_settings(f, env={})
    msg = str(e.value)
    assert "kl_coeff" in msg and str(f) in msg and "kl_coef" in msg


def test_wrong_type_names_key_value_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[ppo]\nrollout_batch_size = "many"\n')
    with pytest.raises(ConfigError) as e:
        load_settings(f, env={})
    msg = str(e.value)
    assert "rollout_batch_size" in msg and "'many'" in msg and str(f) in msg


def test_env_error_names_the_variable():
    with pytest.raises(ConfigError, match="env CLAWRL__PPO__KL_COEF"):
        load_settings(env={"CLAWRL__PPO__KL_COEF": "wide"})
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


def test_the_engine_is_http_exactly_when_a_url_names_it():
    assert load_settings(env={}).engine.kind == "embedded"
    assert load_settings(env={"CLAWRL__ENGINE__URL": "http://a:1/"}).engine.kind == "http"


def test_at_most_63_settings_and_the_engine_ports_follow_the_gateways():
    """What a user sets fits in their head; the engines `clawrl up` starts take ports from [server] api_port."""
    from clawrl.config import Settings

    assert sum(len(f.annotation.model_fields) for f in Settings.model_fields.values()) <= 63
    s = load_settings(env={"CLAWRL__SERVER__API_PORT": "41000"})
    assert [s.port(p) for p in ("engine", "judge-engine", "eval-engine", "canary-engine")] == [41010, 41021, 41022,
                                                                                               41023]


@pytest.mark.parametrize("section, key, replacement", [
    ("engine", "urls", "router in front of the engines and name it in \\[engine\\] url"),
    ("engine", "sync_waves", "one at a time"), ("prm", "engine_urls", "name it in \\[prm\\] engine_url"),
    ("ppo", "lr_schedule", "lr_decay_steps > 0 decays lr"), ("gate", "replay_scorer", "\\[gate\\] evaluator"),
    ("server", "session_idle_timeout_s", "15 minutes"), ("engine", "kind", "an \\[engine\\] url makes it")])
def test_a_removed_key_says_what_took_its_place(tmp_path, section, key, replacement):
    f = tmp_path / "old.toml"
    f.write_text(f"[{section}]\n{key} = 2\n")
    with pytest.raises(ConfigError, match=f"{f}: \\[{section}\\] {key} is no longer a setting: .*{replacement}"):
        load_settings(f, env={})
    with pytest.raises(ConfigError, match=f"env CLAWRL__{section.upper()}__{key.upper()}: .*no longer a setting"):
        load_settings(env={f"CLAWRL__{section.upper()}__{key.upper()}": "2"})


def test_api_keys_from_named_env(monkeypatch):
    monkeypatch.setenv("MY_KEYS", " k1, k2 ,")
    assert read_api_keys("MY_KEYS") == ["k1", "k2"]
    monkeypatch.setenv("MY_KEYS", "changeme")
    with pytest.raises(ConfigError, match="placeholder"):
        read_api_keys("MY_KEYS")


def test_conf_default_toml_is_config_show_defaults_full():
    result = CliRunner().invoke(app, ["config", "show", "--defaults", "--full"])
    assert result.exit_code == 0, result.output
    assert result.stdout == dump_defaults(full=True) == (REPO / "conf" / "default.toml").read_text()
    assert "# Trainable samples that trigger one PPO step.\nrollout_batch_size = 32\n" in result.stdout
    assert 'data_root = "~/.clawrl"' in result.stdout  # as written, not this machine's home directory


def test_config_show_defaults_is_a_line_a_key_on_two_screens():
    result = CliRunner().invoke(app, ["config", "show", "--defaults"])
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and len(lines) <= 100 and max(map(len, lines)) <= 100
    assert "rollout_batch_size = 32  # Trainable samples that trigger one PPO step." in lines
    assert "max_context_len = 0  # Prompt + output tokens per sequence (0: the model's own limit)." in lines
    assert 'base_url = ""  # External OpenAI-compatible API, e.g. https://host/v1.' in lines  # "e.g." ends nothing
    assert "# min_gain is unset  # The gain over the champion a candidate needs (unset: not worse is enough)." in lines
    keys = [ln for ln in lines if ln[:1].isalpha() and " = " in ln or " is unset  # " in ln]
    assert len(keys) == 63  # every setting, each on its own line


def test_config_show_defaults_loads_to_the_code_defaults(tmp_path):
    (tmp_path / "brief.toml").write_text(dump_defaults())
    assert load_settings(tmp_path / "brief.toml", env={}) == load_settings(env={})


def test_conf_default_toml_loads_to_the_code_defaults():
    assert load_settings(REPO / "conf" / "default.toml", env={}) == load_settings(env={})


@pytest.mark.parametrize("section, key", [("model", "actor_gpus"), ("model", "rollout_gpus"), ("model", "prm_gpus"),
                                          ("server", "router_port"), ("prm", "score_range"), ("prm", "async_eval"),
                                          ("engine", "worker_cpus")])
def test_removed_keys_are_unknown(tmp_path, section, key):
    f = tmp_path / "old.toml"
    f.write_text(f"[{section}]\n{key} = 0\n")
    with pytest.raises(ConfigError, match=f"unknown key \\[{section}\\] {key}; valid keys: "):
        load_settings(f, env={})


def test_env_names_any_case_and_values_validate_like_the_file():
    s = load_settings(env={"clawrl__ppo__lr": "2e-5", "CLAWRL__Server__Open_Mode": "1", "CLAWRL__MODEL__NAME": "tiny"})
    assert s.ppo.lr == 2e-5 and s.server.open_mode is True and s.model.name == "tiny"
    with pytest.raises(ConfigError, match="env CLAWRL__PPO__A__B: expected CLAWRL__SECTION__KEY"):
        load_settings(env={"CLAWRL__PPO__A__B": "1"})
    with pytest.raises(ConfigError, match="env CLAWRL__PPO: expected CLAWRL__SECTION__KEY"):
        load_settings(env={"CLAWRL__PPO": '{"lr": 1}'})


@pytest.mark.parametrize("name", ["layout-8gpu.toml", "layout-two-nodes.toml"])
def test_the_scale_layouts_load_with_routers_for_the_policy_and_the_judge_engines(name):
    s = load_settings(Path(__file__).parents[1] / "conf" / name, env={})
    assert s.engine.kind == "http" and s.prm.backend == "engine"
    assert s.engine.url.endswith(":30005") and s.prm.engine_url.endswith(":30006")
    text = (Path(__file__).parents[1] / "conf" / name).read_text()
    assert text.count("sglang_router.launch_router") == 2 and "--port 30005" in text and "--port 30006" in text


def test_per_namespace_adapters_switch_from_the_environment_with_a_default_rank_and_no_megatron():
    s = load_settings(env={})
    assert (s.ppo.adapters, s.ppo.lora_rank) == ("shared", 0)  # today's behaviour: one shared policy
    s = load_settings(env={"CLAWRL__PPO__ADAPTERS": "namespace"})
    assert (s.ppo.adapters, s.ppo.adapter_rank) == ("namespace", 16)  # lora_rank 0: the default rank
    assert load_settings(env={"CLAWRL__PPO__ADAPTERS": "namespace", "CLAWRL__PPO__LORA_RANK": "4"}).ppo.adapter_rank == 4
    with pytest.raises(ConfigError) as e:
        load_settings(env={"CLAWRL__PPO__ADAPTERS": "namespace", "CLAWRL__PPO__BACKEND": "megatron"})
    assert str(e.value) == (
        "env CLAWRL__PPO__ADAPTERS, env CLAWRL__PPO__BACKEND: [ppo]: ppo.adapters = 'namespace' trains LoRA adapters "
        "with the torch backend only, not ppo.backend = 'megatron': set ppo.backend = 'torch', or ppo.adapters = 'shared'")
    with pytest.raises(ConfigError, match=r"env CLAWRL__PPO__ADAPTERS: \[ppo\] adapters = 'user': Input should be "
                                          r"'shared' or 'namespace'"):
        load_settings(env={"CLAWRL__PPO__ADAPTERS": "user"})
    with pytest.raises(ConfigError, match=r"env CLAWRL__PPO__ADAPTERS, env CLAWRL__GATE__CANARY_SHARE: \[gate\] "
                                          r"canary_share .* set canary_share = 0"):
        load_settings(env={"CLAWRL__PPO__ADAPTERS": "namespace", "CLAWRL__GATE__CANARY_SHARE": "0.2"})
