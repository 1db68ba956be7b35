"""Per-namespace LoRA training (``[ppo] adapters = "namespace"``): one frozen base in memory, and for each step
the adapter and AdamW state of the namespace whose batch it trains.

A step loads that namespace's newest adapter version exactly as it was saved - its weights and its
optimizer state - or, for a namespace with none, a fresh adapter (A from a seeded Kaiming init, B = 0:
it starts as the base); trains the batch with the same PPO step as the shared policy
(:meth:`clawrl.train.base.TrainBackend.train_step`: the same advantages, clipping, truncated IS and KL);
and writes the new version as a directory of its own (:mod:`clawrl.adapters`): the adapter in PEFT's
format, the optimizer state and ``trainer.json``, renamed into place complete. Every step starts from
disk, so a trainer restarted between two steps continues exactly where one that kept running would.

The KL reference is the base itself with the adapter switched off: no second copy of the model (the
samples' ``ref_logprobs``, scored at judge time by the engine holding the initial weights, are the
same thing and spare that forward). The learning rate follows the namespace's own step count, AdamW's
``step``, so ``lr_decay_steps`` schedules each user's adapter from its first step.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from clawrl.adapters import ADAPTER_FILE, adapter_dir, complete_adapters, namespace_dir, read_served
from clawrl.checkpoint import (OPTIMIZER_FILE, StepResult, kept_versions, read_step_result, remove_stale_staging,
                               staged_dir, weights_digest, write_step_result)
from clawrl.records import OPEN_NAMESPACE, SampleRecord, adapter_name
from clawrl.train.base import LossFn, PPOHyperParams, default_loss, lr_at
from clawrl.train.batch import collate_samples
from clawrl.train.torch_backend import TorchBackend


class AdapterBackend(TorchBackend):
    """The torch backend over a frozen base with one LoRA adapter whose weights and optimizer state are
    swapped per namespace (:meth:`load_adapter`, :meth:`save_adapter`)."""

    OPTIMIZER_STATE_FORMAT = "clawrl-torch-adamw-lora-v1"

    def __init__(self, model_dir: Path, hp: PPOHyperParams, *, rank: int, alpha: float = 32.0, **kw: Any) -> None:
        super().__init__(model_dir, hp, lora_rank=rank, lora_alpha=alpha, **kw)
        self._fresh = self._seeded_init(hp.seed)

    @torch.no_grad()
    def _seeded_init(self, seed: int) -> dict[str, Tensor]:
        """A fresh adapter, the same in every process: PEFT's init (Kaiming-uniform A, zero B) drawn from a
        generator of its own, in parameter-name order, not from whatever the global RNG holds."""
        g = torch.Generator().manual_seed(seed)
        fresh = {}
        for name, p in sorted(zip(self.param_names, self.params)):
            value = torch.zeros(p.shape, dtype=p.dtype)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=g)
            fresh[name] = value
        return fresh

    def _import_moments(self, state: Mapping[str, Any]) -> dict[str, dict[str, Tensor]] | None:
        """A namespace's own moments, for the adapter they were saved with (unlike a shared LoRA resume,
        where the adapters restart on merged weights)."""
        names, saved = set(self.param_names), set(state["exp_avg"])
        if saved != names:
            raise ValueError(f"optimizer state does not match the adapter: missing {sorted(names - saved)[:3]}, "
                             f"unexpected {sorted(saved - names)[:3]}")
        return {key: state[key] for key in ("exp_avg", "exp_avg_sq")}

    @torch.no_grad()
    def load_adapter(self, directory: Path | None) -> int:
        """The adapter and optimizer state saved in ``directory`` (None: a fresh adapter and optimizer);
        returns the optimizer steps they have had."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        self._init_optimizer()  # no moments of another namespace survive
        if directory is None:
            for name, p in zip(self.param_names, self.params):
                p.copy_(self._fresh[name])
            return 0
        loaded = set_peft_model_state_dict(self.model, load_file(str(Path(directory) / ADAPTER_FILE)))
        missing = [k for k in loaded.missing_keys if "lora_" in k]
        if missing or loaded.unexpected_keys:
            raise ValueError(f"{directory}: adapter does not fit the model: missing {missing[:3]}, "
                             f"unexpected {list(loaded.unexpected_keys)[:3]}")
        state = torch.load(Path(directory) / OPTIMIZER_FILE, weights_only=True)
        self.load_optimizer_state_dict(state)
        return int(state["step"])

    def save_adapter(self, directory: Path) -> str:
        """adapter_config.json, adapter_model.safetensors (float32: what training goes on from) and
        optimizer.pt into the existing ``directory``; the adapter file's digest. PEFT's own writers, without
        the model card ``save_pretrained`` adds."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(Path(directory) / ADAPTER_FILE),
                  metadata={"format": "pt"})
        self.model.peft_config["default"].save_pretrained(str(directory))
        torch.save(self.optimizer_state_dict(), Path(directory) / OPTIMIZER_FILE)
        return weights_digest(Path(directory) / ADAPTER_FILE)


class NamespaceTrainer:
    """Trains each namespace's adapter on that namespace's batches; exactly once per batch id (a batch
    already trained returns its stored result)."""

    def __init__(self, *, base_model_dir: Path, checkpoints: Path, hp: PPOHyperParams, pad_id: int, rank: int,
                 alpha: float = 32.0, dtype: str = "float32", device: str = "cpu", deterministic: bool = True,
                 keep_weights: int = 3, base_version: str = "0", loss_fn: LossFn = default_loss):
        self.checkpoints = Path(checkpoints)
        self.hp, self.pad_id, self.keep_weights, self.base_version = hp, pad_id, keep_weights, base_version
        self.backend = AdapterBackend(Path(base_model_dir), hp, rank=rank, alpha=alpha, dtype=dtype, device=device,
                                      deterministic=deterministic, loss_fn=loss_fn)
        self.last: StepResult | None = None
        self._lock = threading.Lock()  # one model: the steps of this process take turns

    world_size = 1  # one process: adapters train with the torch backend

    @property
    def weight_version(self) -> str:
        """The base weight version under every adapter (what the trainer service reports)."""
        return self.base_version

    def applied(self, namespace: str, batch_id: str) -> StepResult | None:
        """The stored result when ``namespace``'s adapter was already trained on ``batch_id``."""
        for _, d in complete_adapters(self.checkpoints, namespace):
            result = read_step_result(d)
            if result.batch_id == batch_id:
                return result
        return None

    def run(self, batch_id: str, samples: list[SampleRecord], metrics: dict[str, float] | None = None, *,
            version: int) -> StepResult:
        """Train version ``version`` of the adapter of the namespace ``samples`` belong to (all of them to one)
        from its newest version on disk, and write it."""
        namespaces = sorted({s.namespace or OPEN_NAMESPACE for s in samples})
        if len(namespaces) != 1:
            raise ValueError(f"batch {batch_id} holds samples of {len(namespaces)} namespaces; an adapter's batch "
                             f"holds one namespace's: {namespaces[:3]}")
        namespace = namespaces[0]
        with self._lock:
            if (done := self.applied(namespace, batch_id)) is not None:
                return done
            found = complete_adapters(self.checkpoints, namespace)
            parent, parent_dir = found[0] if found else (0, None)
            if version <= parent:
                raise ValueError(f"batch {batch_id} would make version {version} of {namespace}'s adapter, but "
                                 f"version {parent} exists already")
            t0 = time.perf_counter()
            steps = self.backend.load_adapter(parent_dir)
            self.backend.set_lr(lr_at(self.hp, steps))
            metrics = {**(metrics or {}), **self.backend.train_step(collate_samples(samples, self.pad_id)),
                       "adapter_steps": float(steps + 1), "torch_threads": float(torch.get_num_threads())}
            metrics["step_time_s"] = time.perf_counter() - t0
            sessions = sorted({(namespace, s.session_id) for s in samples})
            self.last = self._save(namespace, version, parent, batch_id, metrics, [list(p) for p in sessions])
            return self.last

    def _save(self, namespace: str, version: int, parent: int, batch_id: str, metrics: dict[str, float],
              sessions: list[list[str]]) -> StepResult:
        out = adapter_dir(self.checkpoints, namespace, version)
        remove_stale_staging(out.parent)  # a trainer killed mid-save left its staging dir
        with staged_dir(out) as staging:
            sha = self.backend.save_adapter(staging)
            result = StepResult(batch_id=batch_id, step=version, weight_version=adapter_name(namespace, version),
                                parent_version=adapter_name(namespace, parent), path=str(out), sha256=sha,
                                metrics={k: float(v) for k, v in metrics.items()}, sessions=sessions)
            write_step_result(staging, result)  # the marker, last
        self._prune(namespace)
        return result

    def _prune(self, namespace: str) -> None:
        """Keep the optimizer state of the newest version only, and the weights of the newest
        ``keep_weights`` versions, of the one served and of those the gate keeps for rollbacks (the
        champion and the ones before it on the line: ``keep.json``, ``clawrl.promotion.keep_rollback_reach``);
        trainer.json markers stay (lineage, replay)."""
        served = read_served(self.checkpoints, namespace)
        kept = kept_versions(namespace_dir(self.checkpoints, namespace)) | ({str(served.version)} if served else set())
        for i, (v, d) in enumerate(complete_adapters(self.checkpoints, namespace)):
            if i > 0:
                (d / OPTIMIZER_FILE).unlink(missing_ok=True)
            if i >= self.keep_weights and str(v) not in kept:
                (d / ADAPTER_FILE).unlink(missing_ok=True)


def namespace_trainer_from_settings(settings, base_model_dir: Path, pad_id: int, loss_fn: LossFn) -> NamespaceTrainer:
    """The entry point's NamespaceTrainer for ``[model]`` / ``[ppo]`` under ``<data_root>/checkpoints``."""
    from clawrl.models import resolve_device, resolve_dtype

    ppo, device = settings.ppo, resolve_device(settings.model.device)[0]
    return NamespaceTrainer(base_model_dir=base_model_dir, checkpoints=settings.storage.data_root / "checkpoints",
                            hp=PPOHyperParams.from_settings(ppo, settings.model.seed, settings.opd), pad_id=pad_id,
                            rank=ppo.adapter_rank, dtype=resolve_dtype(settings.model.dtype, device), device=device,
                            loss_fn=loss_fn)

