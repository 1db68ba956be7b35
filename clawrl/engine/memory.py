"""The memory an engine holds, and giving it back to the system when the engine goes idle.

Freed tensors stay with their allocator: CUDA's caching allocator keeps the blocks reserved, and
glibc's malloc keeps freed heap pages (tensors under its mmap threshold, which grows to the largest
block ever freed, up to 32 MiB): after three 7k-token prompts, SmolLM2 on a CPU stayed at 2.31 GiB
resident with nothing running (1.02 GiB warm). ``torch.cuda.empty_cache`` and glibc's ``malloc_trim``
hand them back (docs/benchmarks.md, long prompts).
"""

from __future__ import annotations

import ctypes
import os

import torch

try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim  # glibc; absent elsewhere (musl, macOS)
except (AttributeError, OSError):
    _MALLOC_TRIM = None


def memory_held(device: torch.device) -> int:
    """Bytes this process holds for ``device``: what CUDA's allocator reserved, or on the CPU the
    resident set (Linux's /proc/self/statm; 0 where there is none)."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def give_back(device: torch.device) -> None:
    """Return the memory freed on ``device`` to the system, where the allocator allows."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
