"""Bring megatron-core 0.16.1 up in a process: the process group, the model-parallel groups, the
RNG tracker, and (on a machine without CUDA) three small patches that let the local layer spec run
on CPU over gloo.

Why the patches (each message below is what megatron-core raises on CPU without them):
  A. ``DotProductAttention`` always enters ``get_cuda_rng_tracker().fork()`` around attention
     dropout, even at p=0, and ``model_parallel_cuda_manual_seed`` calls ``torch.cuda.manual_seed``
     ("Torch not compiled with CUDA enabled"). A tracker that forks the *CPU* generator replaces it.
  B. ``RotaryEmbedding.get_emb`` and the global memory buffer place tensors on
     ``torch.cuda.current_device()``; on CPU that call raises. It is made to return the CPU device.
  C. With ``attention_mask=None`` the unfused softmax builds its causal mask with ``device="cuda"``.
     Both module-level references to ``get_default_causal_mask`` get a CPU version.
The patches are process-wide and are never applied when CUDA is available: on a GPU the real
``model_parallel_cuda_manual_seed`` runs instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Megatron's own offsets (megatron/core/tensor_parallel/random.py, model_parallel_cuda_manual_seed),
# so a CPU run seeds its dropout streams the way a GPU run would.
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024

_shims_applied = False  # B and C are patched once per process; A is re-seeded on every call


@dataclass
class MegatronRuntime:
    """What :func:`init_megatron` set up, so :func:`shutdown_megatron` undoes exactly that."""

    tp_size: int
    tp_rank: int
    world_size: int
    rank: int
    device: torch.device
    owns_process_group: bool  # False when the group came from torchrun or the caller


def _cpu_rng_tracker_class():
    import megatron.core.tensor_parallel.random as mpu_random

    class CPURNGStatesTracker(mpu_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states (shim A)."""

        def add(self, name: str, seed: int) -> None:
            if name in self.states_:
                raise ValueError(f"rng state {name!r} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name!r} was never added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CPURNGStatesTracker


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)  # True = masked


def apply_cpu_shims(seed: int, tp_rank: int = 0) -> bool:
    """Install shims A-C when CUDA is unavailable; returns whether they are active.

    Idempotent: B and C are patched once per process; A installs a fresh tracker seeded like
    ``model_parallel_cuda_manual_seed(seed)`` would (data stream ``seed``, tensor-parallel stream
    ``seed + 2718 + tp_rank``), so calling it twice with one seed leaves the same RNG state.
    """
    global _shims_applied
    if torch.cuda.is_available():
        return False
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mpu_random
    import megatron.core.transformer.utils as transformer_utils

    tracker = _cpu_rng_tracker_class()()
    tracker.add(mpu_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(mpu_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_SEED_OFFSET)
    mpu_random._CUDA_RNG_STATE_TRACKER = tracker
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    if not _shims_applied:
        torch.cuda.current_device = lambda: torch.device("cpu")  # B
        transformer_utils.get_default_causal_mask = _cpu_causal_mask  # C, both references
        fused_softmax.get_default_causal_mask = _cpu_causal_mask
        _shims_applied = True
    return True


def init_megatron(tp_size: int, seed: int) -> MegatronRuntime:
    """Initialise torch.distributed and Megatron's model-parallel groups (TP ``tp_size``, PP 1).

    An existing default process group (torchrun, a test harness) is reused as is; otherwise this
    process starts a world of one (nccl with CUDA, gloo without) through an in-memory store: no
    rendezvous, no port, no file to clean up. Model-parallel groups already set up with the same TP
    size are kept; a different size tears them down first. Seeds torch and Megatron's RNG tracker
    (shim A on CPU).
    """
    owns = not dist.is_initialized()
    if torch.cuda.is_available():  # bind the GPU before nccl creates its communicators
        torch.cuda.set_device((0 if owns else dist.get_rank()) % torch.cuda.device_count())
    if owns:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size % tp_size:
        raise ValueError(f"world size {world_size} is not divisible by tensor parallel size {tp_size}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp_size:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    torch.manual_seed(seed)
    if not apply_cpu_shims(seed, tp_rank):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return MegatronRuntime(tp_size=tp_size, tp_rank=tp_rank, world_size=world_size, rank=rank, device=device,
                           owns_process_group=owns)


def shutdown_megatron(runtime: MegatronRuntime | None = None) -> None:
    """Destroy the model-parallel groups, and the process group if :func:`init_megatron` made it."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if runtime is not None and runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
