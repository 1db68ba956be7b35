"""`clawrl mix`: a checkpoint's weights interpolated with the base model's, tensor by tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.checkpoint import MASTER_FILE, OPTIMIZER_FILE, TRAINER_FILE, WEIGHTS_FILE, file_sha256
from clawrl.mix import MIX_FILE, mix_weights


def _shifted_copy(src, dst, shift: float, dtype=None):
    """``src``'s model directory at ``dst`` with every tensor + ``shift`` (stored in ``dtype``), and the
    files a run's checkpoint also holds."""
    shutil.copytree(src, dst)
    weights = {k: (v + shift).to(dtype or v.dtype) for k, v in load_file(str(src / WEIGHTS_FILE)).items()}
    save_file(weights, str(dst / WEIGHTS_FILE))
    (dst / TRAINER_FILE).write_text("{}")
    (dst / OPTIMIZER_FILE).write_bytes(b"state")
    return dst


def test_mix_is_alpha_of_the_checkpoint_plus_the_rest_of_the_base(tiny_dir, tmp_path):
    tuned = _shifted_copy(tiny_dir, tmp_path / "v000003", 1.0)
    out = mix_weights(tuned, tiny_dir, 0.25, tmp_path / "mixed")
    base, mixed = load_file(str(tiny_dir / WEIGHTS_FILE)), load_file(str(out / WEIGHTS_FILE))
    assert mixed.keys() == base.keys() and len(base) > 5
    for name, t in base.items():  # 0.25 * (t + 1) + 0.75 * t = t + 0.25
        assert mixed[name].dtype == torch.float32
        torch.testing.assert_close(mixed[name], t + 0.25, rtol=0, atol=1e-6)
    names = {f.name for f in out.iterdir()}
    assert {"config.json", WEIGHTS_FILE, "tokenizer.json"} <= names  # a model an engine loads
    assert not names & {TRAINER_FILE, OPTIMIZER_FILE}  # a run's bookkeeping stays behind
    made_of = json.loads((out / MIX_FILE).read_text())
    assert made_of == {"alpha": 0.25, "checkpoint": str(tuned.resolve()), "base": str(tiny_dir.resolve()),
                       "checkpoint_sha256": file_sha256(tuned / WEIGHTS_FILE),
                       "base_sha256": file_sha256(tiny_dir / WEIGHTS_FILE)}
    ends = mix_weights(tuned, tiny_dir, 1.0, tmp_path / "all"), mix_weights(tuned, tiny_dir, 0.0, tmp_path / "none")
    for end, want in zip(ends, (load_file(str(tuned / WEIGHTS_FILE)), base)):
        got = load_file(str(end / WEIGHTS_FILE))
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_mix_takes_the_trainers_float32_weights_and_keeps_the_served_dtype(tiny_dir, tmp_path):
    tuned = _shifted_copy(tiny_dir, tmp_path / "v000001", 0.0, torch.bfloat16)  # served: bf16 of the base
    base = load_file(str(tiny_dir / WEIGHTS_FILE))
    save_file({k: v + 2.0 for k, v in base.items()}, str(tuned / MASTER_FILE))  # trained: base + 2 in float32
    mixed = load_file(str(mix_weights(tuned, tiny_dir, 0.5, tmp_path / "mixed") / WEIGHTS_FILE))
    for name, t in base.items():
        assert mixed[name].dtype == torch.bfloat16
        # 0.5 * (t + 2) + 0.5 * t = t + 1, to bfloat16's precision (the served bf16 copy would give t)
        torch.testing.assert_close(mixed[name].float(), t + 1.0, rtol=0, atol=8e-3)
    assert MASTER_FILE not in {f.name for f in (tmp_path / "mixed").iterdir()}


def test_mix_refuses_what_does_not_pair_up_and_writes_nothing(tiny_dir, tmp_path):
    tuned = _shifted_copy(tiny_dir, tmp_path / "tuned", 1.0)
    with pytest.raises(ValueError, match=r"alpha must be within \[0, 1\], got 1.5"):
        mix_weights(tuned, tiny_dir, 1.5, tmp_path / "a")
    weights = load_file(str(tuned / WEIGHTS_FILE))
    name = next(iter(weights))
    save_file({**weights, name: torch.zeros(3, 3)}, str(tuned / WEIGHTS_FILE))
    with pytest.raises(ValueError, match=rf"tensor '{name}': shape \(3, 3\)"):
        mix_weights(tuned, tiny_dir, 0.5, tmp_path / "b")
    save_file({k: v for k, v in weights.items() if k != name}, str(tuned / WEIGHTS_FILE))
    with pytest.raises(ValueError, match="hold different tensors"):
        mix_weights(tuned, tiny_dir, 0.5, tmp_path / "c")
    with pytest.raises(FileExistsError, match="exists"):
        mix_weights(tiny_dir, tiny_dir, 0.5, tuned)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned"]  # no directory, no staging leftovers


def test_mix_command_resolves_a_version_and_names_bad_input(tiny_dir, tmp_path, make_settings):
    from typer.testing import CliRunner

    from clawrl.cli import app
    from clawrl.records import CheckpointRecord
    from clawrl.storage.writer import DataStore

    s = make_settings()
    tuned = _shifted_copy(tiny_dir, tmp_path / "v000002", 1.0)
    with DataStore(s.storage.data_root) as store:
        store.append(CheckpointRecord(weight_version="2", step=2, batch_id="b", parent_version="1", path=str(tuned),
                                      sha256="x", mlflow_run_id=""))
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(s.storage.data_root),
           "CLAWRL__STORAGE__MODEL_CACHE": str(s.storage.models_dir), "CLAWRL__MODEL__NAME": "tiny"}
    out = CliRunner().invoke(app, ["mix", "2", "--alpha", "0.5", "--out", str(tmp_path / "m")], env=env)
    assert out.exit_code == 0, out.output
    mixed, base = load_file(str(tmp_path / "m" / WEIGHTS_FILE)), load_file(str(tiny_dir / WEIGHTS_FILE))
    assert all(torch.allclose(mixed[k], v + 0.5, rtol=0, atol=1e-6) for k, v in base.items())
    bad = CliRunner().invoke(app, ["mix", "7", "--alpha", "0.5", "--out", str(tmp_path / "n")], env=env)
    assert bad.exit_code == 2 and "'7' is neither a model directory nor a checkpoint version" in bad.output
    again = CliRunner().invoke(app, ["mix", str(tuned), "--alpha", "0.5", "--out", str(tmp_path / "m")], env=env)
    assert again.exit_code == 2 and "exists; name a new directory" in again.output
    wide = CliRunner().invoke(app, ["mix", str(tuned), "--alpha", "2", "--out", str(tmp_path / "w")], env=env)
    assert wide.exit_code == 2 and not (tmp_path / "w").exists()
