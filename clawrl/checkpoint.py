"""Checkpoints on disk: written complete-or-absent, found, and verified against the recorded hash.

Weight versions are step counts: version 0 is the initial model, version N the weights after N
steps, in ``<checkpoints>/v{N:06d}/``: HF safetensors weights in the served dtype (what an engine
loads) and ``trainer.json`` (the :class:`StepResult` naming the batch it consumed, its sessions and
the weights' digest, :func:`weights_digest`). A version directory is built in a staging dir beside it
(``.vNNNNNN.<pid>.<random>``) with the marker written last, then renamed into place, so it either
holds a complete checkpoint or does not exist; the staging dir of a writer that died is removed by
:func:`remove_stale_staging`. A complete checkpoint is what the gate evaluates and the engines load.

The trainer's own state, which only a resumed trainer needs, is added to the complete directory
afterwards (:func:`write_trainer_state`, off the path to serving): when the served dtype is not
float32 (bfloat16 on a GPU) the float32 master weights in ``MASTER_FILE``, then the optimizer state in
``OPTIMIZER_FILE``, each written to a temporary name and renamed; the optimizer file, renamed last,
says the state is complete (:func:`has_trainer_state`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import mmap
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger("clawrl.checkpoint")

WEIGHTS_FILE = "model.safetensors"
TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
# safetensors bytes under a name no model loader picks up (SGLang, HF and the embedded engine read *.safetensors)
MASTER_FILE = "master-weights.st"


@dataclass(frozen=True)
class StepResult:
    batch_id: str
    step: int
    weight_version: str
    parent_version: str
    path: str
    sha256: str  # the weights file's digest (weights_digest)
    metrics: dict[str, float]
    sessions: list[list[str]] = field(default_factory=list)  # the [namespace, session_id] pairs trained on


class CheckpointError(RuntimeError):
    """The checkpoint on disk is not the one the trainer recorded."""


def version_dir(checkpoints: Path, version: int) -> Path:
    return Path(checkpoints) / f"v{version:06d}"


PIECE_BYTES = 64 << 20  # a weights file above this is hashed piece by piece, on all cores
TREE_PREFIX = "sha256-tree:"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def weights_digest(path: Path) -> str:
    """The digest a checkpoint records of its weights file: the file's sha256 when it is at most
    ``PIECE_BYTES``; above, ``sha256-tree:`` + the sha256 of the concatenated sha256 digests of its
    64 MiB pieces in order, the pieces hashed in parallel. One sha256 stream runs at ~1.2 GB/s on
    the GPU host: 1 s for Qwen3-0.6B's 1.2 GB of bf16 weights, 6.5 s for Qwen3-4B's 7.8 GB, paid
    when the trainer writes a checkpoint, when the gate loads it and when it is synced."""
    size = Path(path).stat().st_size
    if size <= PIECE_BYTES:
        return file_sha256(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16)) as pool:  # hashlib releases the GIL
                pieces = list(pool.map(lambda at: hashlib.sha256(view[at:at + PIECE_BYTES]).digest(),
                                       range(0, size, PIECE_BYTES)))
        finally:
            view.release()
    return TREE_PREFIX + hashlib.sha256(b"".join(pieces)).hexdigest()


def short_digest(digest: str, n: int = 12) -> str:
    """A recorded digest cut for people to read: its first ``n`` hex digits (after the ``sha256-tree:``
    prefix of a piecewise one, which would otherwise fill the space)."""
    return digest.removeprefix(TREE_PREFIX)[:n]


def digest_as_recorded(path: Path, recorded: str) -> str:
    """``path``'s digest in the form ``recorded`` has: checkpoints recorded before the piecewise
    digest hold the whole file's sha256."""
    return weights_digest(path) if recorded.startswith(TREE_PREFIX) else file_sha256(path)


def read_step_result(ckpt_dir: Path) -> StepResult:
    return StepResult(**json.loads((Path(ckpt_dir) / TRAINER_FILE).read_text()))


def write_step_result(ckpt_dir: Path, result: StepResult) -> None:
    """The marker that makes a staged checkpoint complete: written after everything else in it."""
    (Path(ckpt_dir) / TRAINER_FILE).write_text(json.dumps(asdict(result), indent=1))


@contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh staging dir beside ``out_dir``, renamed to ``out_dir`` when the block succeeds and
    deleted when it raises. Its name carries this process's pid, so a later
    :func:`remove_stale_staging` can tell a dead writer's leftovers from a live writer's."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", dir=out_dir.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is read by other processes
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def complete_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """(version, dir) of every complete checkpoint (``trainer.json`` written last), newest first."""
    found = [(int(d.name[1:]), d) for d in Path(checkpoints).glob("v[0-9]*")
             if d.name[1:].isdigit() and (d / TRAINER_FILE).is_file()]
    return sorted(found, reverse=True)


def has_trainer_state(ckpt_dir: Path) -> bool:
    """Whether a trainer can resume from ``ckpt_dir`` as it is (its optimizer state, renamed last, is there)."""
    return (Path(ckpt_dir) / OPTIMIZER_FILE).is_file()


def write_trainer_state(ckpt_dir: Path, master: dict | None, optimizer: dict) -> None:
    """Add the trainer's state to the complete checkpoint ``ckpt_dir``: the float32 master weights
    (when the served weights are in another dtype), then the optimizer state, each through a
    temporary name, so a reader never sees half a file and the optimizer file means both are whole."""
    import torch
    from safetensors.torch import save_file

    ckpt_dir = Path(ckpt_dir)
    if master is not None:
        tmp = ckpt_dir / f".{MASTER_FILE}.{os.getpid()}.tmp"
        save_file(master, str(tmp))
        os.replace(tmp, ckpt_dir / MASTER_FILE)
    tmp = ckpt_dir / f".{OPTIMIZER_FILE}.{os.getpid()}.tmp"
    torch.save(optimizer, tmp)
    os.replace(tmp, ckpt_dir / OPTIMIZER_FILE)


KEEP_FILE = "keep.json"  # in the checkpoints directory: versions whose weights pruning must leave


def keep_weights_of(checkpoints: Path, versions: list[str]) -> None:
    """Mark ``versions`` (the champion and the one a rollback would serve) as weights the trainer's
    pruning must keep, however old; replaces the previous list (written atomically)."""
    path = Path(checkpoints) / KEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(sorted(set(map(str, versions)))))
    os.replace(tmp, path)


def kept_versions(checkpoints: Path) -> set[str]:
    path = Path(checkpoints) / KEEP_FILE
    return set(json.loads(path.read_text())) if path.is_file() else set()


def verify_checkpoint(checkpoint_dir: str | Path, expected_sha256: str, weights_file: str = WEIGHTS_FILE) -> None:
    """Raise CheckpointError unless ``<checkpoint_dir>/<weights_file>`` (the model's weights, or an
    adapter's) has the digest ``expected_sha256`` (:func:`weights_digest`; the sync before offering it to
    an engine, the trainer before resuming from it)."""
    path = Path(checkpoint_dir) / weights_file
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {weights_file} is missing")
    actual = digest_as_recorded(path, expected_sha256)
    if actual != expected_sha256:
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {weights_file} is corrupt (sha256 {short_digest(actual)}"
                              f"..., {path.stat().st_size} bytes; the trainer recorded "
                              f"{short_digest(expected_sha256)}...)")


def newest_intact_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """(version, dir) of the newest complete checkpoint whose weights still have the sha256 the
    trainer recorded (what a restarted gateway serves); a corrupt or half-deleted one is skipped,
    logged, for the one before it."""
    for version, d in complete_checkpoints(checkpoints):
        try:
            verify_checkpoint(d, read_step_result(d).sha256)
            return version, d
        except (CheckpointError, ValueError, TypeError, OSError) as e:
            log.error("not serving checkpoint v%d: %s", version, e)
    return None


def intact_champion(checkpoints: Path, champions: list[str]) -> tuple[int, Path] | None:
    """(version, dir) of the newest version on the promotion gate's line of ``champions`` (oldest
    first, the current champion last) whose checkpoint is complete and intact: what a restarted
    gateway serves while the gate is on (a refused or not yet evaluated candidate never serves).
    None: the initial weights (version 0, or no champion checkpoint left intact)."""
    for version in reversed(champions):
        if not str(version).isdigit() or int(version) == 0:
            return None
        d = version_dir(checkpoints, int(version))
        try:
            verify_checkpoint(d, read_step_result(d).sha256)
            return int(version), d
        except (CheckpointError, ValueError, TypeError, OSError) as e:
            log.error("not serving champion v%s: %s", version, e)
    return None


def remove_stale_staging(checkpoints: Path) -> list[Path]:
    """Delete half-written checkpoints (``.vNNNNNN.<pid>.*`` staging dirs) and half-written trainer
    state (``vNNNNNN/.<file>.<pid>.tmp``) whose writer process is gone, e.g. a trainer killed while
    saving; return them. A live writer's files are kept."""
    removed = []
    for d in [*Path(checkpoints).glob(".v[0-9]*.*"), *Path(checkpoints).glob("v[0-9]*/.*.tmp")]:
        pid = d.name.split(".")[2 if d.name.startswith(".v") else -2]
        if pid.isdigit() and psutil.pid_exists(int(pid)):
            continue
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
        removed.append(d)
    return removed


def trainer_weights(model_dir: Path) -> dict | None:
    """The float32 master weights (HF names) of a checkpoint written in another dtype, or None when
    its ``model.safetensors`` is what training continues from."""
    path = Path(model_dir) / MASTER_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))

