"""A new model from a checkpoint and the weights it started from: ``alpha * checkpoint + (1 - alpha)
* base``, tensor by tensor (``clawrl mix``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from clawrl.checkpoint import (MASTER_FILE, OPTIMIZER_FILE, TRAINER_FILE, WEIGHTS_FILE, staged_dir, trainer_weights,
                               weights_digest)

MIX_SKIPPED = {TRAINER_FILE, OPTIMIZER_FILE, MASTER_FILE, "MLmodel"}  # a run's bookkeeping, not the model's
MIX_FILE = "mix.json"  # what a mixed model was made of


def mix_weights(checkpoint: Path, base: Path, alpha: float, out_dir: Path) -> Path:
    """Write ``out_dir``: an HF model directory whose weights are ``alpha * checkpoint + (1 - alpha)
    * base`` tensor by tensor (in float32, from the trainer's float32 weights where the checkpoint has
    them; stored in the checkpoint's dtypes), with the checkpoint's config and tokenizer files and
    ``mix.json`` naming both sources, their weights' digests and ``alpha``.
    Interpolating fine-tuned weights with the ones they started from gives up part of what
    fine-tuning gained for part of what it cost elsewhere (Wortsman et al. 2022, WiSE-FT; Lin et al.
    2024 for RLHF). Written complete-or-absent (:func:`staged_dir`). ValueError for an alpha outside
    [0, 1] or weights that do not pair up; FileExistsError for an existing ``out_dir``."""
    from safetensors.torch import load_file, save_file

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], got {alpha}")
    checkpoint, base, out_dir = Path(checkpoint), Path(base), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; name a new directory")
    tuned, start = (load_file(str(d / WEIGHTS_FILE)) for d in (checkpoint, base))
    master = trainer_weights(checkpoint) or {}  # float32 weights of a checkpoint served in bfloat16
    if tuned.keys() != start.keys():
        only = sorted(tuned.keys() ^ start.keys())
        raise ValueError(f"{checkpoint} and {base} hold different tensors (e.g. {only[:3]}): not the same model")
    for name, t in tuned.items():
        if t.shape != start[name].shape:
            raise ValueError(f"tensor {name!r}: shape {tuple(t.shape)} in {checkpoint}, "
                             f"{tuple(start[name].shape)} in {base}")
    mixed = {name: (alpha * master.get(name, t).float() + (1.0 - alpha) * start[name].float()).to(t.dtype).contiguous()
             for name, t in tuned.items()}
    with staged_dir(out_dir) as staging:
        for f in checkpoint.iterdir():
            if f.is_file() and f.name not in MIX_SKIPPED and f.name != WEIGHTS_FILE:
                shutil.copy2(f, staging / f.name)
        save_file(mixed, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        made_of: dict = {"alpha": alpha}
        for key, d in (("checkpoint", checkpoint), ("base", base)):
            made_of |= {key: str(d.resolve()), f"{key}_sha256": weights_digest(d / WEIGHTS_FILE)}
        (staging / MIX_FILE).write_text(json.dumps(made_of, indent=1))
    return out_dir
