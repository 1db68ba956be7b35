"""The long-lived trainer: one backend (model + optimizer in memory), exactly-once steps, checkpoints
(step N writes checkpoint ``v{N:06d}``, see :mod:`clawrl.checkpoint`).

Exactly once per batch: :meth:`Trainer.run` with a batch id the trainer already applied returns the
stored result instead of stepping again, whether the trainer kept running (the caller crashed after
the step) or restarted from that checkpoint. A trainer that dies after a step but before its
checkpoint is written restarts from the previous checkpoint, so re-running the batch applies it once;
the staging dir it left (named with its pid) is removed when the next trainer starts.

A step returns once its checkpoint is complete (the served weights and ``trainer.json``): that is
all the gate and the sync need. The trainer's own state (float32 master weights, AdamW's moments:
~6x the bytes of bf16 weights) is copied at the end of the step - on the GPU itself when it has the
room, a device-to-device copy of milliseconds - and written from that copy by a background thread
while the new version is gated and synced and the next step trains; the next step waits for it only
before taking its own copy (one copy at a time). A trainer that stopped before that state was
written resumes from the newest checkpoint that has it and trains the later batches again from
their recorded samples (``samples_of``), which gives the same weights (checked against the recorded
sha256) and writes their state.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from clawrl.checkpoint import (
    MASTER_FILE,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    StepResult,
    complete_checkpoints,
    has_trainer_state,
    kept_versions,
    read_step_result,
    remove_stale_staging,
    short_digest,
    staged_dir,
    verify_checkpoint,
    version_dir,
    write_step_result,
    write_trainer_state,
)
from clawrl.records import OPEN_NAMESPACE, SampleRecord
from clawrl.train.base import LossFn, PPOHyperParams, TrainBackend, default_loss, lr_at
from clawrl.train.batch import collate_samples

log = logging.getLogger("clawrl.trainer")
SamplesOf = Callable[[str], list[SampleRecord]]


def _to_host(state: tuple[dict | None, dict]) -> tuple[dict | None, dict]:
    """The trainer state's tensors on CPU (a copy where they are on a GPU)."""
    master, optimizer = state
    moments = {k: {n: t.cpu() for n, t in optimizer[k].items()} for k in ("exp_avg", "exp_avg_sq")}
    return (None if master is None else {n: t.cpu() for n, t in master.items()}), {**optimizer, **moments}


# checkpoints dir -> the thread writing a trainer's state there: a trainer built on the same dir in
# this process (a restart in tests, a replay) waits for it instead of finding the state missing
_STATE_WRITERS: dict[Path, threading.Thread] = {}


class Trainer:
    """Owns a backend across steps; resumes from the newest checkpoint in ``checkpoints``."""

    def __init__(self, *, base_model_dir: Path, checkpoints: Path, hp: PPOHyperParams, pad_id: int,
                 backend: str = "torch", dtype: str = "float32", device: str = "cpu", tp_size: int = 1,
                 lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True, keep_weights: int = 3,
                 loss_fn: LossFn = default_loss, samples_of: SamplesOf | None = None):
        self.base_model_dir = Path(base_model_dir)
        self.checkpoints = Path(checkpoints)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, the rank that writes checkpoints
            remove_stale_staging(self.checkpoints)  # a trainer killed mid-save left its staging dir
        self.hp = hp
        self.pad_id = pad_id
        self.keep_weights = keep_weights
        self.samples_of = samples_of
        self._state_thread: threading.Thread | None = None
        self._state_error: BaseException | None = None
        if (pending := _STATE_WRITERS.pop(self.checkpoints.resolve(), None)) is not None:
            pending.join()
        found = complete_checkpoints(self.checkpoints)
        stateful = [(v, d) for v, d in found if has_trainer_state(d)]
        self.version, start_dir = stateful[0] if stateful else (0, self.base_model_dir)
        self.last = read_step_result(start_dir) if self.version else None
        if self.last is not None:
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
        for v, d in sorted(found):
            if v > self.version:
                self._recompute_state(v, d)

    def _recompute_state(self, version: int, ckpt_dir: Path) -> None:
        """Checkpoint ``version`` is complete but its trainer state was never written: train its batch
        again from the state before it, check the weights against the recorded sha256, write the state."""
        recorded = read_step_result(ckpt_dir)
        if self.samples_of is None:
            raise RuntimeError(f"checkpoint {ckpt_dir} has no trainer state (the trainer stopped before writing "
                               f"it) and this trainer was given no way to read batch {recorded.batch_id}'s samples "
                               "to recompute it; build it with trainer_from_settings")
        samples = self.samples_of(recorded.batch_id)
        self.backend.set_lr(lr_at(self.hp, self.version))
        self.backend.train_step(collate_samples(samples, self.pad_id))
        self.version, self.last = version, recorded
        sha = recorded.sha256
        if self.backend.rank == 0:  # the weights as the checkpoint would hold them, for their hash only
            with tempfile.TemporaryDirectory(prefix=f".{ckpt_dir.name}.{os.getpid()}.", dir=self.checkpoints) as tmp:
                sha = self.backend.write_weights(Path(tmp))
        else:
            self.backend.write_weights(None)
        if sha != recorded.sha256:
            log.error("checkpoint v%d trained again from v%d gives other weights (sha256 %s..., recorded %s...); "
                      "training continues from the recomputed state", version, version - 1, short_digest(sha),
                      short_digest(recorded.sha256))
        state = self._gather_state()
        if self.backend.rank == 0:
            self._write_state(ckpt_dir, state)
        self.backend._barrier()
        log.warning("checkpoint v%d had no trainer state: trained batch %s again from v%d and wrote it%s",
                    version, recorded.batch_id, version - 1, "" if sha == recorded.sha256 else " (weights differ)")

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

    def run(self, batch_id: str, samples: list[SampleRecord], metrics: dict[str, float] | None = None) -> StepResult:
        """Train one PPO step on ``samples`` (exactly once per ``batch_id``) and checkpoint it;
        ``metrics`` (the caller's own, e.g. how long reading the batch took) are recorded with it."""
        if self._state_thread is not None and not self._state_thread.is_alive():
            self.wait_state()  # a write that already failed fails this step before it trains
        done = self.applied(batch_id)
        if done is not None:
            return done
        if not samples:
            raise ValueError(f"batch {batch_id} has no samples")
        t0 = time.perf_counter()
        batch = collate_samples(samples, self.pad_id)
        self.backend.set_lr(lr_at(self.hp, self.version))  # step v makes version v+1: resume/replay agree
        metrics = {**(metrics or {}), **self.backend.train_step(batch)}
        metrics["step_time_s"] = time.perf_counter() - t0
        t_wait, previous_error = time.perf_counter(), None
        try:  # the previous step's state is written (it ran beside this step) before this one is copied
            self.wait_state()
        except RuntimeError as e:  # raised once this version is saved and its own write started
            previous_error = e
        metrics["state_wait_s"] = time.perf_counter() - t_wait
        metrics["torch_threads"] = torch.get_num_threads()  # replay restores it: CPU reductions depend on it
        metrics["trainer_ranks"] = self.world_size
        t_copy = time.perf_counter()
        state, side = self._copy_state()
        metrics["state_copy_s"] = time.perf_counter() - t_copy
        parent, self.version = self.version, self.version + 1
        sessions = sorted({(s.namespace or OPEN_NAMESPACE, s.session_id) for s in samples})
        self.last = self._save(batch_id, parent, metrics, [list(p) for p in sessions])
        if self.backend.rank == 0:
            self._start_writer(Path(self.last.path), state, side)
        if previous_error is not None:
            raise previous_error
        return self.last

    def _gather_state(self, keep_device: bool = False) -> tuple[dict | None, dict]:
        """Copies of (float32 master weights or None, optimizer state): on CPU, or with
        ``keep_device`` on the training device; collective under torchrun."""
        return self.backend.master_weights(keep_device), self.backend.optimizer_state_dict(keep_device)

    def _fits_on_device(self, copies: float) -> bool:
        """Whether ``copies`` float32 copies of the weights fit in the GPU's free memory (the
        allocator's cached blocks included) with a quarter to spare; False off a GPU and under torchrun."""
        device = self.backend.device
        if self.world_size > 1 or device.type != "cuda":
            return False
        need = 4 * sum(p.numel() for p in self.backend.params) * copies * 1.25
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) > need

    def _copy_state(self) -> tuple[tuple[dict | None, dict], torch.cuda.Stream | None]:
        """A copy of the trainer state the next step does not change (collective under torchrun): on
        the GPU when it fits (a device-to-device copy of milliseconds; moments, master weights and a
        transient copy), else on the host. With a GPU copy comes the side stream that takes it to the
        host, beside the next step's kernels."""
        master = 0 if self.backend.compute_dtype == torch.float32 else 2
        on_device = self._fits_on_device(2 + master)
        state = self._gather_state(keep_device=on_device)
        if not on_device:
            return state, None
        side = torch.cuda.Stream(self.backend.device)
        side.wait_stream(torch.cuda.current_stream(self.backend.device))
        return state, side

    def _write_state(self, ckpt_dir: Path, state: tuple[dict | None, dict]) -> None:
        t0 = time.perf_counter()
        write_trainer_state(ckpt_dir, *state)
        self._prune()
        log.info("trainer state of %s written in %.2f s", ckpt_dir.name, time.perf_counter() - t0)

    def _start_writer(self, ckpt_dir: Path, state: tuple[dict | None, dict], side) -> None:
        """Write ``state`` (from :meth:`_copy_state`) into the complete checkpoint ``ckpt_dir`` from a
        background thread (rank 0)."""
        def write() -> None:
            try:
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    host = _to_host(state)
                self._write_state(ckpt_dir, host)
            except BaseException as e:  # raised by the next step (wait_state), never lost
                self._state_error = e

        # not a daemon: an exiting process finishes the write first
        self._state_thread = threading.Thread(target=write, name=f"clawrl-state-{ckpt_dir.name}")
        _STATE_WRITERS[self.checkpoints.resolve()] = self._state_thread
        self._state_thread.start()

    def wait_state(self) -> None:
        """Return once the last step's trainer state is on disk; raise what writing it raised."""
        if self._state_thread is not None:
            self._state_thread.join()
            if _STATE_WRITERS.get(self.checkpoints.resolve()) is self._state_thread:
                del _STATE_WRITERS[self.checkpoints.resolve()]
            self._state_thread = None
        if (error := self._state_error) is not None:
            self._state_error = None
            raise RuntimeError(f"writing the trainer state of version {self.version} failed: {error!r}") from error

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
            sha256 = self.backend.write_weights(staging, keep_device=self._fits_on_device(1.5))  # + its bf16 cast
            metrics = {**metrics, "checkpoint_write_s": time.perf_counter() - t0}  # the served weights, hashed
            result = StepResult(batch_id=batch_id, step=self.version, weight_version=str(self.version),
                                parent_version=str(parent), path=str(out), sha256=sha256 or "",
                                metrics={k: float(v) for k, v in metrics.items()}, sessions=sessions)
            if writer:
                write_step_result(staging, result)  # the marker, last
        self.backend._barrier()
        return result

    def _prune(self) -> None:
        """Keep weights of the newest ``keep_weights`` versions and the trainer state (optimizer,
        float32 master weights) of the newest version that has it only; trainer.json markers stay
        forever (lineage and replay read them; replay needs no weights). Weights the promotion gate
        serves or may roll back to (``kept_versions``) stay too."""
        keep, newer_state = kept_versions(self.checkpoints), False
        for i, (v, d) in enumerate(complete_checkpoints(self.checkpoints)):
            if newer_state:
                (d / OPTIMIZER_FILE).unlink(missing_ok=True)
                (d / MASTER_FILE).unlink(missing_ok=True)
            newer_state = newer_state or has_trainer_state(d)
            if i >= self.keep_weights and str(v) not in keep:
                (d / WEIGHTS_FILE).unlink(missing_ok=True)


def trainer_from_settings(settings, samples_of: SamplesOf | None = None):
    """The entry-point factory: a Trainer for ``[model]`` / ``[ppo]`` under ``<data_root>/checkpoints``;
    ``samples_of(batch_id)`` reads a batch's samples (a resume whose newest checkpoint has no trainer
    state trains it again). With ``[ppo] adapters = "namespace"`` a NamespaceTrainer (clawrl.train.adapters)."""
    from clawrl.models import resolve_device, resolve_dtype
    from clawrl.hooks import load_hook
    from clawrl.models import load_tokenizer, resolve_model_dir

    base = resolve_model_dir(settings.model.name, settings.storage.models_dir, settings.model.seed)
    tok = load_tokenizer(base)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    loss_fn = load_hook("loss", settings.hooks.loss) or default_loss
    ppo, device = settings.ppo, resolve_device(settings.model.device)[0]
    if ppo.adapters == "namespace":
        from clawrl.train.adapters import namespace_trainer_from_settings

        return namespace_trainer_from_settings(settings, base, pad_id, loss_fn)
    return Trainer(base_model_dir=base, checkpoints=settings.storage.data_root / "checkpoints",
                   hp=PPOHyperParams.from_settings(ppo, settings.model.seed, settings.opd), pad_id=pad_id,
                   backend=ppo.backend, dtype=resolve_dtype(settings.model.dtype, device), device=device,
                   tp_size=settings.model.tensor_parallel, lora_rank=ppo.lora_rank, loss_fn=loss_fn,
                   samples_of=samples_of)
