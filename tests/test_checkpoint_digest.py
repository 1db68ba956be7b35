"""The weights digest a checkpoint records: the whole file's sha256 up to one 64 MiB piece; above, the
sha256 of its pieces' sha256 digests (hashed in parallel); a checkpoint recorded with the whole file's
sha256 before still verifies."""

from __future__ import annotations

import hashlib

import pytest

from clawrl import checkpoint
from clawrl.checkpoint import (TREE_PREFIX, WEIGHTS_FILE, CheckpointError, digest_as_recorded, short_digest,
                               verify_checkpoint, weights_digest)


def test_a_small_file_is_digested_as_its_sha256_and_a_large_one_piece_by_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PIECE_BYTES", 1000)  # pieces of 1,000 bytes: 2,500 bytes are 3 pieces
    data = bytes(range(256)) * 9 + b"x" * (2500 - 256 * 9)
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(data[:1000])
    large.write_bytes(data)
    assert weights_digest(small) == hashlib.sha256(data[:1000]).hexdigest()
    pieces = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in (0, 1000, 2000))
    assert weights_digest(large) == TREE_PREFIX + hashlib.sha256(pieces).hexdigest()
    assert digest_as_recorded(large, "0" * 64) == hashlib.sha256(data).hexdigest()  # the older form
    assert digest_as_recorded(large, TREE_PREFIX + "0" * 64) == weights_digest(large)


def test_verify_takes_either_form_and_names_a_changed_piece_corrupt(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PIECE_BYTES", 1000)
    d = tmp_path / "v000001"
    d.mkdir()
    data = bytes(range(256)) * 12
    (d / WEIGHTS_FILE).write_bytes(data)
    verify_checkpoint(d, weights_digest(d / WEIGHTS_FILE))
    verify_checkpoint(d, hashlib.sha256(data).hexdigest())  # recorded before the piecewise digest
    recorded = weights_digest(d / WEIGHTS_FILE)
    (d / WEIGHTS_FILE).write_bytes(data[:2500] + b"\x00" + data[2501:])  # one byte of the third piece
    with pytest.raises(CheckpointError, match=r"corrupt \(sha256 [0-9a-f]{12}\.\.\., 3072 bytes") as e:
        verify_checkpoint(d, recorded)
    assert str(e.value).endswith(f"the trainer recorded {recorded[len(TREE_PREFIX):][:12]}...)")


def test_a_digest_is_shown_by_its_first_hex_digits_whatever_its_form():
    assert short_digest(TREE_PREFIX + "0123456789abcdef" * 4) == "0123456789ab"
    assert short_digest("fedcba9876543210" * 4, 10) == "fedcba9876"
