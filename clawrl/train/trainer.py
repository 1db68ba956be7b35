"""The long-lived trainer: one backend (model + optimizer in memory), exactly-once steps, checkpoints.

Weight versions are step counts: version 0 is the initial model, version N the weights after N
steps. Each step writes ``<checkpoints>/v{N:06d}/`` (HF safetensors weights, the optimizer state,
and ``trainer.json`` naming the batch it consumed), built in a temp dir and renamed into place, so a
version directory either holds a complete checkpoint or does not exist.

Exactly once per batch: :meth:`Trainer.run` with a batch id the trainer already applied returns the
stored result instead of stepping again, whether the trainer kept running (the caller crashed after
the step) or restarted from that checkpoint. A trainer that dies after a step but before its
checkpoint is written restarts from the previous checkpoint, so re-running the batch applies it once;
the staging dir it left (named with its pid) is removed when the next trainer starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from clawrl.records import SampleRecord
from clawrl.train.base import LossFn, PPOHyperParams, default_loss, lr_at
from clawrl.train.batch import collate_samples

log = logging.getLogger("clawrl.train")

TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"


@dataclass(frozen=True)
class StepResult:
    batch_id: str
    step: int
    weight_version: str
    parent_version: str
    path: str
    sha256: str
    metrics: dict[str, float]


def version_dir(checkpoints: Path, version: int) -> Path:
    return Path(checkpoints) / f"v{version:06d}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def complete_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """(version, dir) of every complete checkpoint (``trainer.json`` written last), newest first."""
    found = [(int(d.name[1:]), d) for d in Path(checkpoints).glob("v[0-9]*")
             if d.name[1:].isdigit() and (d / TRAINER_FILE).is_file()]
    return sorted(found, reverse=True)


def latest_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """(version, dir) of the newest complete checkpoint, or None."""
    found = complete_checkpoints(checkpoints)
    return found[0] if found else None


def newest_intact_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """(version, dir) of the newest complete checkpoint whose weights still have the sha256 the
    trainer recorded (what a restarted gateway serves); a corrupt or half-deleted one is skipped,
    logged, for the one before it."""
    from clawrl.sync import CheckpointError, verify_checkpoint

    for version, d in complete_checkpoints(checkpoints):
        try:
            verify_checkpoint(d, read_step_result(d).sha256)
            return version, d
        except (CheckpointError, ValueError, TypeError, OSError) as e:
            log.error("not serving checkpoint v%d: %s", version, e)
    return None


def remove_stale_staging(checkpoints: Path) -> list[Path]:
    """Delete half-written checkpoints (``.vNNNNNN.<pid>.*`` staging dirs) whose writer process is
    gone, e.g. a trainer killed while saving; return them. A live writer's staging dir is kept."""
    removed = []
    for d in Path(checkpoints).glob(".v[0-9]*.*"):
        parts = d.name.split(".")  # ["", "v000003", "<pid>", "<random>"]
        pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_step_result(ckpt_dir: Path) -> StepResult:
    return StepResult(**json.loads((Path(ckpt_dir) / TRAINER_FILE).read_text()))


def build_backend(kind: str, model_dir: Path, hp: PPOHyperParams, *, reference_dir: Path, dtype: str, device: str,
                  tp_size: int = 1, lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True,
                  loss_fn: LossFn = default_loss):
    if kind == "torch":
        from clawrl.train.torch_backend import TorchBackend

        return TorchBackend(model_dir, hp, dtype=dtype, device=device, lora_rank=lora_rank, lora_alpha=lora_alpha,
                            deterministic=deterministic, reference_dir=reference_dir, loss_fn=loss_fn)
    if kind == "megatron":
        from clawrl.train.megatron_backend import MegatronBackend

        return MegatronBackend(model_dir, hp, dtype=dtype, device=device, tp_size=tp_size,
                               reference_dir=reference_dir, deterministic=deterministic, loss_fn=loss_fn)
    raise ValueError(f"unknown training backend {kind!r}; valid: torch, megatron")


class Trainer:
    """Owns a backend across steps; resumes from the newest checkpoint in ``checkpoints``."""

    def __init__(self, *, base_model_dir: Path, checkpoints: Path, hp: PPOHyperParams, pad_id: int,
                 backend: str = "torch", dtype: str = "float32", device: str = "cpu", tp_size: int = 1,
                 lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True, keep_weights: int = 3,
                 loss_fn: LossFn = default_loss):
        self.base_model_dir = Path(base_model_dir)
        self.checkpoints = Path(checkpoints)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.checkpoints)  # a trainer killed mid-save left its staging dir
        self.hp = hp
        self.pad_id = pad_id
        self.keep_weights = keep_weights
        latest = latest_checkpoint(self.checkpoints)
        if latest is not None:  # never resume from weights that are not the bytes this trainer wrote
            from clawrl.sync import verify_checkpoint

            verify_checkpoint(latest[1], read_step_result(latest[1]).sha256)
        start_dir = self.base_model_dir if latest is None else latest[1]
        self.version = 0 if latest is None else latest[0]
        self.last: StepResult | None = None if latest is None else read_step_result(latest[1])
        self.backend = build_backend(backend, start_dir, hp, reference_dir=self.base_model_dir, dtype=dtype,
                                     device=device, tp_size=tp_size, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                     deterministic=deterministic, loss_fn=loss_fn)
        if latest is not None and (latest[1] / OPTIMIZER_FILE).is_file():
            self.backend.load_optimizer_state_dict(torch.load(latest[1] / OPTIMIZER_FILE, weights_only=True))

    @property
    def weight_version(self) -> str:
        return str(self.version)

    def applied(self, batch_id: str) -> StepResult | None:
        """The stored result when ``batch_id`` was already trained on (in memory or on disk)."""
        if self.last is not None and self.last.batch_id == batch_id:
            return self.last
        for d in self.checkpoints.glob("v[0-9]*"):
            f = d / TRAINER_FILE
            if f.is_file():
                r = read_step_result(d)
                if r.batch_id == batch_id:
                    return r
        return None

    def run(self, batch_id: str, samples: list[SampleRecord]) -> StepResult:
        """Train one PPO step on ``samples`` (exactly once per ``batch_id``) and checkpoint it."""
        done = self.applied(batch_id)
        if done is not None:
            return done
        if not samples:
            raise ValueError(f"batch {batch_id} has no samples")
        t0 = time.perf_counter()
        batch = collate_samples(samples, self.pad_id)
        self.backend.set_lr(lr_at(self.hp, self.version))  # step v makes version v+1: resume/replay agree
        metrics = self.backend.train_step(batch)
        metrics["step_time_s"] = time.perf_counter() - t0
        metrics["torch_threads"] = torch.get_num_threads()  # replay restores it: CPU reductions depend on it
        parent, self.version = self.version, self.version + 1
        out = version_dir(self.checkpoints, self.version)
        result = self._save(out, batch_id, parent, metrics)
        self.last = result
        self._prune()
        return result

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights under HF names (for the in-process sync path)."""
        return self.backend.hf_state_dict()

    def _save(self, out: Path, batch_id: str, parent: int, metrics: dict[str, float]) -> StepResult:
        # the pid in the name tells a restarted trainer whether the writer is gone (remove_stale_staging)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=self.checkpoints))
        try:
            weights = self.backend.save_checkpoint(staging / "w")
            for f in weights.iterdir():
                os.replace(f, staging / f.name)
            weights.rmdir()
            torch.save(self.backend.optimizer_state_dict(), staging / OPTIMIZER_FILE)
            result = StepResult(batch_id=batch_id, step=self.version, weight_version=str(self.version),
                                parent_version=str(parent), path=str(out),
                                sha256=file_sha256(staging / "model.safetensors"),
                                metrics={k: float(v) for k, v in metrics.items()})
            (staging / TRAINER_FILE).write_text(json.dumps(asdict(result), indent=1))  # marker, written last
            staging.chmod(0o755)
            os.replace(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return result

    def _prune(self) -> None:
        """Keep weights of the newest ``keep_weights`` versions and the optimizer of the newest only;
        trainer.json markers stay forever (lineage and replay read them; replay needs no weights)."""
        dirs = sorted((d for d in self.checkpoints.glob("v[0-9]*") if (d / TRAINER_FILE).is_file()),
                      key=lambda d: int(d.name[1:]))
        for i, d in enumerate(reversed(dirs)):
            if i >= 1:
                (d / OPTIMIZER_FILE).unlink(missing_ok=True)
            if i >= self.keep_weights:
                (d / "model.safetensors").unlink(missing_ok=True)


def samples_from_rows(rows: list[dict[str, Any]]) -> list[SampleRecord]:
    keys = SampleRecord.__dataclass_fields__.keys()
    return [SampleRecord(**{k: r[k] for k in keys}) for r in rows]


def trainer_from_settings(settings) -> Trainer:
    """The entry-point factory: a Trainer for ``[model]`` / ``[ppo]`` under ``<data_root>/checkpoints``."""
    from clawrl.config import resolve_device
    from clawrl.models import load_tokenizer, resolve_model_dir

    base = resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)
    tok = load_tokenizer(base)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    device, _ = resolve_device(settings.model.device)
    from clawrl.hooks import load_hook

    ppo = settings.ppo
    loss_fn = load_hook("loss", settings.hooks.loss) or default_loss
    return Trainer(base_model_dir=base, checkpoints=settings.storage.data_root / "checkpoints",
                   hp=PPOHyperParams.from_settings(ppo, settings.model.seed), pad_id=pad_id, backend=ppo.backend,
                   dtype=settings.model.dtype, device=device, tp_size=settings.model.tensor_parallel,
                   lora_rank=ppo.lora_rank, lora_alpha=ppo.lora_alpha, deterministic=ppo.deterministic,
                   loss_fn=loss_fn)
