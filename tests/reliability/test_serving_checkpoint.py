"""A restarted gateway serves the newest checkpoint whose bytes are the ones the trainer wrote: a
corrupt or half-deleted newest checkpoint is skipped for the one before it (and logged)."""

import hashlib
import json
import logging

import pytest

from clawrl.checkpoint import newest_intact_checkpoint

pytestmark = [pytest.mark.reliability]


def _checkpoint(root, version: int, payload: bytes):
    d = root / f"v{version:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    (d / "trainer.json").write_text(json.dumps({
        "batch_id": f"b{version}", "step": version, "weight_version": str(version), "parent_version": str(version - 1),
        "path": str(d), "sha256": hashlib.sha256(payload).hexdigest(), "metrics": {}}))
    return d


@pytest.mark.timeout(30)
def test_newest_intact_checkpoint_skips_corrupt_and_incomplete_ones(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 1, b"one" * 100)
    v2 = _checkpoint(root, 2, b"two" * 100)
    v3 = _checkpoint(root, 3, b"three" * 100)
    (root / "v000004").mkdir()  # a checkpoint without trainer.json is not complete: never served
    (root / "v000004" / "model.safetensors").write_bytes(b"x")
    assert newest_intact_checkpoint(root) == (3, v3)

    garbled = bytearray((v3 / "model.safetensors").read_bytes())
    garbled[10] ^= 0xFF
    (v3 / "model.safetensors").write_bytes(bytes(garbled))  # same size, one flipped byte
    (v2 / "model.safetensors").unlink()                      # pruned or lost
    with caplog.at_level(logging.ERROR, logger="clawrl.checkpoint"):
        version, d = newest_intact_checkpoint(root)
    assert (version, d.name) == (1, "v000001")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "v3" in errors[0] and "corrupt" in errors[0] and "v2" in errors[1]

    (root / "v000001" / "trainer.json").write_text("{not json")
    assert newest_intact_checkpoint(root) is None
    assert newest_intact_checkpoint(tmp_path / "missing") is None
