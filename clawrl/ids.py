"""Unique ids for hot paths: 128 random bits as 32 hex characters, the shape of ``uuid4().hex``.

``uuid4`` asks the kernel for 16 bytes on every call (a getrandom system call: tens of
microseconds on the virtual machines we measured, twice per served turn). These come from a
Mersenne Twister seeded with 32 kernel-random bytes when the process starts and again in every
forked child, so ids stay unique across processes and restarts (a collision needs ~2^64 ids).
They are identifiers, not secrets: nothing may use them as tokens or keys.
"""

from __future__ import annotations

import hashlib
import os
import random

_rng = random.Random(os.urandom(32))


def _reseed() -> None:
    _rng.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """32 lowercase hex characters, uniformly random."""
    return f"{_rng.getrandbits(128):032x}"


def namespace_for_key(key: str) -> str:
    """The namespace of an API key: ``key-`` and 16 hex digits of its SHA-256 digest (the key itself is never
    stored). Here, below the gateway that assigns it, so the simulated users know their own."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
