"""A namespace's LoRA adapter versions on disk (``[ppo] adapters = "namespace"``), and which one it is served.

Under the checkpoints directory (``<data_root>/checkpoints``)::

    adapters/<namespace>/v000003/      adapter_config.json, adapter_model.safetensors  PEFT's format: what PEFT,
                                       SGLang (--enable-lora) and vLLM load
                                       optimizer.pt   the namespace's AdamW state, for the next step
                                       trainer.json   the StepResult naming the batch and the digest, written last
    adapters/<namespace>/serving.json  the version the namespace's requests are served with

A version directory is built in a staging dir beside it and renamed into place
(:func:`clawrl.checkpoint.staged_dir`): it is complete, the optimizer state included, or absent.
``serving.json`` is replaced atomically once every serving engine has loaded that version; the gateway
reads it on each request of the namespace (a ``stat``; the file only when it changed), so a restarted
gateway serves the same adapter. Forgetting a namespace removes the whole directory.

An adapter is loaded into an engine under its name ``<namespace>@v<N>``, which a turn also records. A
name is never reused for other weights: an engine may still hold an old one, and a replay must find the
adapter a turn names. Version 0 is no adapter: the base alone.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from clawrl.checkpoint import complete_checkpoints, verify_checkpoint, version_dir
from clawrl.records import adapter_name, check_namespace

ADAPTERS_DIR = "adapters"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SERVING_FILE = "serving.json"


def namespace_dir(checkpoints: Path, namespace: str) -> Path:
    return Path(checkpoints) / ADAPTERS_DIR / check_namespace(namespace)


def adapter_dir(checkpoints: Path, namespace: str, version: int) -> Path:
    return version_dir(namespace_dir(checkpoints, namespace), version)


def complete_adapters(checkpoints: Path, namespace: str) -> list[tuple[int, Path]]:
    """(version, dir) of every complete version of ``namespace``'s adapter, newest first."""
    return complete_checkpoints(namespace_dir(checkpoints, namespace))


def verify_adapter(directory: str | Path, expected_sha256: str) -> None:
    """CheckpointError unless the adapter's weights file has the digest the trainer recorded."""
    verify_checkpoint(directory, expected_sha256, ADAPTER_FILE)


@dataclass(frozen=True)
class ServedAdapter:
    """What a namespace's requests are served with: its adapter's name, version, directory and digest."""

    namespace: str
    name: str
    version: int
    path: str
    sha256: str


def serving_file(checkpoints: Path, namespace: str) -> Path:
    return namespace_dir(checkpoints, namespace) / SERVING_FILE


def read_served(checkpoints: Path, namespace: str) -> ServedAdapter | None:
    """The adapter ``namespace`` is served with; None: the base alone (none trained, or forgotten)."""
    try:
        return ServedAdapter(**json.loads(serving_file(checkpoints, namespace).read_text()))
    except FileNotFoundError:
        return None


def write_served(checkpoints: Path, served: ServedAdapter) -> None:
    """Serve ``served`` to its namespace from now on (written to a temporary name, then renamed)."""
    path = serving_file(checkpoints, served.namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SERVING_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(served), indent=1))
    os.replace(tmp, path)


def remove_adapters(checkpoints: Path, namespace: str) -> list[str]:
    """Delete every version of ``namespace``'s adapter and what it is served (``serving.json`` first, so
    the gateway serves the base from then on); the names of the versions removed, oldest first."""
    d = namespace_dir(checkpoints, namespace)
    names = [adapter_name(namespace, v) for v, _ in reversed(complete_adapters(checkpoints, namespace))]
    serving_file(checkpoints, namespace).unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)
    if d.exists():
        raise OSError(f"could not remove {d}")
    return names
