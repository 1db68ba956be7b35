"""A restarted gateway serves the newest checkpoint whose bytes are the ones the trainer wrote: a
corrupt or half-deleted newest checkpoint is skipped for the one before it (and logged)."""

import hashlib
import json
import logging

import pytest

from clawrl.checkpoint import newest_intact_checkpoint
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability]


def _checkpoint(root, version: int, payload: bytes):
    d = root / f"v{version:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    (d / "trainer.json").write_text(json.dumps({
        "batch_id": f"b{version}", "step": version, "weight_version": str(version), "parent_version": str(version - 1),
        "path": str(d), "sha256": hashlib.sha256(payload).hexdigest(), "metrics": {}}))
    return d


@pytest.mark.timeout(HANG_S)
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


def _decision(action, version, champion):
    from clawrl.records import PromotionRecord

    return PromotionRecord(promotion_id=f"{action}-{version}", action=action, weight_version=str(version),
                           champion_version=str(champion), source="gate", reason="test", eval_key=None, n=None,
                           candidate_mean=None, champion_mean=None, mean_diff=None, ci_low=None, ci_high=None,
                           p_value=None, tolerance=None, alpha=None, mlflow_run_id=None)


@pytest.mark.timeout(HANG_S)
def test_with_the_gate_on_a_restarted_gateway_serves_the_champion_not_a_refused_candidate(tmp_path, make_settings,
                                                                                        caplog):
    from clawrl.checkpoint import intact_champion
    from clawrl.gateway.routes import _checkpoint_to_serve
    from clawrl.storage.writer import DataStore

    s = make_settings()
    root = s.storage.data_root / "checkpoints"
    v1 = _checkpoint(root, 1, b"one" * 100)
    _checkpoint(root, 2, b"two" * 100)
    _checkpoint(root, 3, b"three" * 100)
    with DataStore(s.storage.data_root) as store:  # v1 promoted, v2 refused, v3 not evaluated yet (crash)
        store.append([_decision("promote", 1, 0), _decision("refuse", 2, 1)])
    assert _checkpoint_to_serve(s) == (1, v1)
    assert _checkpoint_to_serve(make_settings({"gate.enabled": False}))[0] == 3  # no gate: the newest
    # a champion whose weights are gone falls back along the line; the initial weights end it
    assert intact_champion(root, ["0", "1", "3"]) == (3, root / "v000003")
    (root / "v000003" / "model.safetensors").unlink()
    with caplog.at_level(logging.ERROR, logger="clawrl.checkpoint"):
        assert intact_champion(root, ["0", "1", "3"]) == (1, v1)
    assert "not serving champion v3" in caplog.text
    assert intact_champion(root, ["0"]) is None and intact_champion(root, ["0", "2"])[0] == 2
