"""The long-lived trainer: one backend (model + optimizer in memory), exactly-once steps, checkpoints
(step N writes checkpoint ``v{N:06d}``, see :mod:`clawrl.checkpoint`).

Exactly once per batch: :meth:`Trainer.run` with a batch id the trainer already applied returns the
stored result instead of stepping again, whether the trainer kept running (the caller crashed after
the step) or restarted from that checkpoint. A trainer that dies after a step but before its
checkpoint is written restarts from the previous checkpoint, so re-running the batch applies it once;
the staging dir it left (named with its pid) is removed when the next trainer starts.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from clawrl.checkpoint import (
    MASTER_FILE,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    StepResult,
    complete_checkpoints,
    file_sha256,
    kept_versions,
    read_step_result,
    remove_stale_staging,
    staged_dir,
    verify_checkpoint,
    version_dir,
    write_step_result,
)
from clawrl.records import OPEN_NAMESPACE, SampleRecord
from clawrl.train.base import LossFn, PPOHyperParams, TrainBackend, default_loss, lr_at
from clawrl.train.batch import collate_samples


class Trainer:
    """Owns a backend across steps; resumes from the newest checkpoint in ``checkpoints``."""

    def __init__(self, *, base_model_dir: Path, checkpoints: Path, hp: PPOHyperParams, pad_id: int,
                 backend: str = "torch", dtype: str = "float32", device: str = "cpu", tp_size: int = 1,
                 lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True, keep_weights: int = 3,
                 loss_fn: LossFn = default_loss):
        self.base_model_dir = Path(base_model_dir)
        self.checkpoints = Path(checkpoints)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, the rank that writes checkpoints
            remove_stale_staging(self.checkpoints)  # a trainer killed mid-save left its staging dir
        self.hp = hp
        self.pad_id = pad_id
        self.keep_weights = keep_weights
        self.version, start_dir, self.last = 0, self.base_model_dir, None
        found = complete_checkpoints(self.checkpoints)
        if found:
            self.version, start_dir = found[0]
            self.last = read_step_result(start_dir)
            verify_checkpoint(start_dir, self.last.sha256)  # never resume from bytes this trainer did not write
        common = dict(dtype=dtype, device=device, deterministic=deterministic, reference_dir=self.base_model_dir,
                      loss_fn=loss_fn)
        if backend == "torch":
            from clawrl.train.torch_backend import TorchBackend

            self.backend: TrainBackend = TorchBackend(start_dir, hp, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                                      **common)
        elif backend == "megatron":
            from clawrl.train.megatron_backend import MegatronBackend

            self.backend = MegatronBackend(start_dir, hp, tp_size=tp_size, **common)
        else:
            raise ValueError(f"unknown training backend {backend!r}; valid: torch, megatron")
        if (start_dir / OPTIMIZER_FILE).is_file():
            self.backend.load_optimizer_state_dict(torch.load(start_dir / OPTIMIZER_FILE, weights_only=True))

    @property
    def weight_version(self) -> str:
        return str(self.version)

    def applied(self, batch_id: str) -> StepResult | None:
        """The stored result when ``batch_id`` was already trained on (in memory or on disk)."""
        if self.last is not None and self.last.batch_id == batch_id:
            return self.last
        for _, d in complete_checkpoints(self.checkpoints):
            result = read_step_result(d)
            if result.batch_id == batch_id:
                return result
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
        metrics["trainer_ranks"] = self.world_size
        parent, self.version = self.version, self.version + 1
        sessions = sorted({(s.namespace or OPEN_NAMESPACE, s.session_id) for s in samples})
        self.last = self._save(batch_id, parent, metrics, [list(p) for p in sessions])
        if self.backend.rank == 0:
            self._prune()
        return self.last

    @property
    def world_size(self) -> int:
        """Processes training together (torchrun's world; 1 outside it)."""
        runtime = getattr(self.backend, "runtime", None)
        return runtime.world_size if runtime is not None else 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights under HF names for the in-process sync path: the live tensors where the
        backend can give them, so they are valid until the next train step (the sync copies them first)."""
        return self.backend.live_state_dict()

    def _save(self, batch_id: str, parent: int, metrics: dict[str, float], sessions: list[list[str]]) -> StepResult:
        """Write checkpoint ``v{version}``: every rank takes part in gathering weights and optimizer
        state (collective under torchrun), global rank 0 writes and renames it into place, and every
        rank returns once it is there."""
        out, writer = version_dir(self.checkpoints, self.version), self.backend.rank == 0
        with staged_dir(out) if writer else nullcontext() as staging:
            t0 = time.perf_counter()
            self.backend.write_weights(staging)
            self.backend.write_master_weights(staging)
            optimizer = self.backend.optimizer_state_dict()
            if writer:
                torch.save(optimizer, staging / OPTIMIZER_FILE)
            metrics = {**metrics, "checkpoint_write_s": time.perf_counter() - t0}  # weights, master, optimizer
            result = StepResult(batch_id=batch_id, step=self.version, weight_version=str(self.version),
                                parent_version=str(parent), path=str(out),
                                sha256=file_sha256(staging / WEIGHTS_FILE) if writer else "",
                                metrics={k: float(v) for k, v in metrics.items()}, sessions=sessions)
            if writer:
                write_step_result(staging, result)  # the marker, last
        self.backend._barrier()
        return result

    def _prune(self) -> None:
        """Keep weights of the newest ``keep_weights`` versions and the optimizer state (and float32
        master weights) of the newest only; trainer.json markers stay forever (lineage and replay
        read them; replay needs no weights). Weights the promotion gate serves or may roll back to
        (``kept_versions``) stay too."""
        keep = kept_versions(self.checkpoints)
        for i, (v, d) in enumerate(complete_checkpoints(self.checkpoints)):
            if i >= 1:
                (d / OPTIMIZER_FILE).unlink(missing_ok=True)
                (d / MASTER_FILE).unlink(missing_ok=True)
            if i >= self.keep_weights and str(v) not in keep:
                (d / WEIGHTS_FILE).unlink(missing_ok=True)


def trainer_from_settings(settings) -> Trainer:
    """The entry-point factory: a Trainer for ``[model]`` / ``[ppo]`` under ``<data_root>/checkpoints``."""
    from clawrl.models import resolve_device, resolve_dtype
    from clawrl.hooks import load_hook
    from clawrl.models import load_tokenizer, resolve_model_dir

    base = resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)
    tok = load_tokenizer(base)
    ppo, device = settings.ppo, resolve_device(settings.model.device)[0]
    return Trainer(base_model_dir=base, checkpoints=settings.storage.data_root / "checkpoints",
                   hp=PPOHyperParams.from_settings(ppo, settings.model.seed, settings.opd),
                   pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                   backend=ppo.backend, dtype=resolve_dtype(settings.model.dtype, device), device=device,
                   tp_size=settings.model.tensor_parallel, lora_rank=ppo.lora_rank, lora_alpha=ppo.lora_alpha,
                   deterministic=ppo.deterministic, loss_fn=load_hook("loss", settings.hooks.loss) or default_loss)
