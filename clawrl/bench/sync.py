"""Weight-sync time against its bound, for both sync paths.

* in-process: the trainer's state dict as the sync takes it (``live_state_dict``) + ``sync_state_dict``
  (pause -> key/shape check -> copy into the served parameters -> continue) vs the bound: copying the
  same tensors into the same parameters with one ``torch._foreach_copy_`` (the fastest plain copy).
* disk: ``Trainer``-style checkpoint save + ``update_weights_from_disk`` (load, key/shape check,
  copy into the served parameters) vs the bound: ``safetensors`` save_file + load_file of the same
  state dict + copying the loaded tensors into a model's parameters (load_file alone is a lazy
  mmap that reads nothing).
Target: each path <= 1.5x its bound.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.common import bench_dtype, interleaved_times, load_average


@torch.no_grad()
def _copy_into(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    keys = [k for k in state if k in params]
    torch._foreach_copy_([params[k] for k in keys], [state[k] for k in keys])


def run_sync_bench(model_names=("tiny", "smollm2-135m"), *, cache_dir: Path, repeats: int = 3, device: str = "cpu",
                   progress=None) -> list[dict[str, Any]]:
    """One row per (model, path): best and median seconds of the sync and of its bound (module docstring),
    the engine and the copy target on ``device`` in :func:`bench_dtype`, the trainer's weights in float32.
    ``progress(label)`` is called after each timed call."""
    from safetensors.torch import load_file, save_file

    from clawrl.config import PPOSettings
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.weights import served_tensors
    from clawrl.models import load_causal_lm, resolve_model_dir
    from clawrl.sync import sync_from_disk, sync_state_dict
    from clawrl.train.base import PPOHyperParams
    from clawrl.train.torch_backend import TorchBackend

    rows, dtype = [], bench_dtype(device)
    for name in model_names:
        model_dir = resolve_model_dir(name, cache_dir)
        engine = EmbeddedEngine(model_dir, dtype=dtype, device=device, max_batch_size=4, max_context_len=512)
        trainer = TorchBackend(model_dir, PPOHyperParams.from_settings(PPOSettings(), seed=0), dtype=dtype,
                               device=device)
        state = trainer.hf_state_dict()
        target = load_causal_lm(model_dir, dtype, device)
        params, _ = served_tensors(target)  # each distinct tensor once (a tied lm_head is the embedding)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        runner = asyncio.Runner()  # one event loop for the engine across the passes
        runner.run(engine.start())
        ids = itertools.count(1)  # fresh weight versions and file names

        def in_process():
            rep = runner.run(sync_state_dict(engine, trainer.live_state_dict(), str(next(ids))))
            assert rep.success, rep.message

        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)

            def disk_bound():
                f = tmp / f"bound{next(ids)}.safetensors"
                save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight" or
                           not target.config.tie_word_embeddings}, str(f))
                _copy_into(params, load_file(str(f)))  # load_file is a lazy mmap: the copy reads the bytes
                f.unlink()  # drop its dirty pages so they do not throttle the next writer

            def disk_sync():
                version = str(next(ids))
                out = trainer.save_checkpoint(tmp / f"ckpt{version}")
                rep = runner.run(sync_from_disk(engine, str(out), version))
                assert rep.success, rep.message
                shutil.rmtree(out)

            results = interleaved_times({"copy_bound": lambda: _copy_into(params, state), "in_process": in_process,
                                         "disk_bound": disk_bound, "disk_sync": disk_sync}, repeats, device=device,
                                        progress=progress and (lambda label: progress(f"{name} {label}")))
        runner.run(engine.close())
        runner.close()
        for path, bound in (("in_process", "copy_bound"), ("disk_sync", "disk_bound")):
            best, median = results[path]
            rows.append({"model": name, "path": path, "bytes": nbytes, "seconds": best, "seconds_median": median,
                         "bound_seconds": results[bound][0], "vs_bound": best / results[bound][0],
                         "device": device, "dtype": dtype, "load_1m": load_average()})
    return rows
