"""New weights for the embedded engine: read an HF safetensors checkpoint and check it against the
served model (every key, no unknown key, the served shapes, tied tensors that agree) before
anything is swapped, so a bad checkpoint never leaves a half-updated model serving."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


class WeightLoadError(ValueError):
    """A checkpoint that cannot replace the served weights (missing, unreadable or mismatched)."""


def served_tensors(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors a checkpoint must provide, and the aliases it may also carry.

    Returns ``(canonical, aliases)``: canonical maps each distinct parameter (and persistent
    buffer) to its first state-dict name; aliases maps the other names of a shared tensor (a tied
    ``lm_head.weight``) to the canonical one."""
    canonical: dict[str, Tensor] = {}
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            canonical[name] = tensor
    return canonical, aliases


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")


def check_weights(new: Mapping[str, Tensor], canonical: Mapping[str, Tensor], aliases: Mapping[str, str]) -> None:
    """Raise WeightLoadError unless ``new`` has every canonical key, no unknown key, and the
    served shapes (alias keys are allowed: they must have their tensor's shape and value)."""
    missing = sorted(set(canonical) - set(new))
    unknown = sorted(set(new) - set(canonical) - set(aliases))
    if missing or unknown:
        parts = [f"missing {len(missing)} key(s): {_some(missing)}"] if missing else []
        parts += [f"unexpected {len(unknown)} key(s): {_some(unknown)}"] if unknown else []
        raise WeightLoadError("; ".join(parts))
    for name, tensor in new.items():
        if not isinstance(tensor, Tensor):
            raise WeightLoadError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        want = canonical[aliases.get(name, name)].shape
        if tuple(tensor.shape) != tuple(want):
            raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} does not match the served {tuple(want)}")
    for alias, target in aliases.items():  # a tied pair must agree, or one of them would be dropped
        if alias in new and new[alias] is not new[target] and not torch.equal(new[alias], new[target]):
            raise WeightLoadError(f"{alias} is tied to {target} in the served model but their new values differ")


def load_checkpoint_tensors(model_dir: str | Path, model: torch.nn.Module) -> dict[str, Tensor]:
    """Read an HF safetensors checkpoint (one file or an indexed shard set) into new tensors with
    the served dtype and device, keyed by canonical name. Raises WeightLoadError; never touches
    ``model``."""
    d = Path(model_dir)
    if not d.is_dir():
        raise WeightLoadError(f"model_path {str(d)!r} is not a directory")
    index = d / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(d.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise WeightLoadError(f"unreadable {index.name}: {e}") from None
    if not files:
        raise WeightLoadError(f"no *.safetensors file in {str(d)!r}")
    loaded: dict[str, Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise WeightLoadError(f"cannot read {f.name}: {e}") from None
        if dup := set(part) & set(loaded):
            raise WeightLoadError(f"key(s) {sorted(dup)[:3]} appear in more than one file")
        loaded.update(part)
    canonical, aliases = served_tensors(model)
    check_weights(loaded, canonical, aliases)
    return {name: t.to(dtype=canonical[name].dtype, device=canonical[name].device)
            for name, t in loaded.items() if name in canonical}
