"""Weight-sync time against its bound, for both sync paths.

* in-process: ``sync_state_dict`` (pause -> copy the trainer's state dict into the served
  parameters -> continue) vs the bound: copying the same tensors into the same parameters.
* disk: ``Trainer``-style checkpoint save + ``update_weights_from_disk`` (load, key/shape check,
  copy into the served parameters) vs the bound: ``safetensors`` save_file + load_file of the same
  state dict + copying the loaded tensors into a model's parameters (load_file alone is a lazy
  mmap that reads nothing).
Target: each path <= 1.5x its bound.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.report import load_average


def _interleaved(fns: dict[str, Any], repeats: int) -> dict[str, tuple[float, float]]:
    """(best, median) seconds per function, the functions alternating in each round so that the
    page cache's dirty-page throttling (hundreds of MB written per call) hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def run_sync_bench(model_names=("tiny", "smollm2-135m"), *, cache_dir: Path, repeats: int = 3) -> list[dict[str, Any]]:
    from safetensors.torch import load_file, save_file

    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import load_causal_lm, resolve_model_dir
    from clawrl.sync import sync_from_disk, sync_state_dict
    from clawrl.train.base import PPOHyperParams
    from clawrl.train.torch_backend import TorchBackend

    rows = []
    for name in model_names:
        model_dir = resolve_model_dir(name, cache_dir)
        engine = EmbeddedEngine(model_dir, max_batch_size=4, max_context_len=512)
        hp = PPOHyperParams.from_settings(__import__("clawrl.config", fromlist=["load_settings"]).load_settings(env={}).ppo, 0)
        trainer = TorchBackend(model_dir, hp)
        state = trainer.hf_state_dict()
        target = load_causal_lm(model_dir)
        params = dict(target.state_dict())
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        loop = asyncio.new_event_loop()
        loop.run_until_complete(engine.start())
        version = [0]

        def copy_bound():
            with torch.no_grad():
                for k, v in state.items():
                    params[k].copy_(v)

        def in_process():
            version[0] += 1
            rep = loop.run_until_complete(sync_state_dict(engine, state, str(version[0])))
            assert rep.success, rep.message

        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            counter = [0]

            def disk_bound():
                counter[0] += 1
                f = tmp / f"bound{counter[0]}.safetensors"
                save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight" or
                           not target.config.tie_word_embeddings}, str(f))
                loaded = load_file(str(f))  # lazy (mmap): the copy below is what reads the bytes
                with torch.no_grad():
                    for k, v in loaded.items():
                        params[k].copy_(v)
                f.unlink()  # drop its dirty pages so they do not throttle the next writer

            def disk_sync():
                counter[0] += 1
                out = trainer.save_checkpoint(tmp / f"ckpt{counter[0]}")
                version[0] += 1
                rep = loop.run_until_complete(sync_from_disk(engine, str(out), str(version[0])))
                assert rep.success, rep.message
                shutil.rmtree(out)

            for fn in (copy_bound, in_process, disk_bound, disk_sync):
                fn()  # warm up
            results = _interleaved({"copy_bound": copy_bound, "in_process": in_process, "disk_bound": disk_bound,
                                    "disk_sync": disk_sync}, repeats)
        loop.run_until_complete(engine.close())
        loop.close()
        for path, bound in (("in_process", "copy_bound"), ("disk_sync", "disk_bound")):
            best, median = results[path]
            rows.append({"model": name, "path": path, "bytes": nbytes, "seconds": best, "seconds_median": median,
                         "bound_seconds": results[bound][0], "vs_bound": best / results[bound][0],
                         "load_1m": load_average()})
    return rows
