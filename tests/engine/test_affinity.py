"""``engine.worker_cpus``: the embedded engine's worker thread on reserved CPUs, every other thread
of the process on the rest, the original masks back after close; bad CPU lists refused by name.
Needs Linux and at least two CPUs available to the test process (the CI machine has two)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from clawrl.config import ConfigError, load_settings
from clawrl.engine.affinity import CpuPinning
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.engine.types import GenerateRequest, SamplingParams

linux_multi_cpu = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs os.sched_setaffinity and two CPUs")


def mask(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


@linux_multi_cpu
def test_worker_pinned_and_other_threads_moved_off_its_cpu(tiny_dir):
    allowed = mask(0)
    reserved = min(allowed)
    bystander_started, stop = threading.Event(), threading.Event()
    bystander_tid: list[int] = []

    def bystander():  # a thread that existed before the engine started (e.g. a log writer)
        bystander_tid.append(threading.get_native_id())
        bystander_started.set()
        stop.wait()

    t = threading.Thread(target=bystander, daemon=True)
    t.start()
    bystander_started.wait()
    engine = EmbeddedEngine(tiny_dir, max_batch_size=2, max_context_len=256, worker_cpus=[reserved])
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)

    async def go():
        await engine.start()
        try:
            worker_tid = engine._thread.native_id
            res = await engine.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=SamplingParams(
                max_new_tokens=3, temperature=0.0, ignore_eos=True)))
            worker_threads = await engine._call(lambda done: done.set_result(torch.get_num_threads()))
            return (worker_tid, res, mask(worker_tid), mask(threading.get_native_id()), mask(bystander_tid[0]),
                    worker_threads)
        finally:
            await engine.close()

    try:
        worker_tid, res, worker_mask, main_mask, bystander_mask, torch_threads = asyncio.run(go())
        assert len(res.output_ids) == 3  # the pinned worker generates
        assert torch_threads == 1  # the worker: one intra-op thread for its one reserved CPU
        assert torch.get_num_threads() == 2  # per thread: the caller's count is untouched
        assert worker_mask == {reserved}
        assert main_mask == allowed - {reserved}  # the calling (event loop) thread
        assert bystander_mask == allowed - {reserved}  # and a thread started before the engine
        assert mask(threading.get_native_id()) == allowed  # close() gave the original mask back
        assert mask(bystander_tid[0]) == allowed
    finally:
        stop.set()
        t.join()
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads_before)


@linux_multi_cpu
def test_bad_cpu_lists_are_refused_before_the_model_loads(tmp_path):
    allowed = sorted(mask(0))
    with pytest.raises(ConfigError, match=r"takes every CPU"):
        CpuPinning(allowed)
    missing = max(allowed) + 1000
    with pytest.raises(ConfigError, match=rf"CPU \[{missing}\] is not available"):
        EmbeddedEngine(tmp_path / "no-model-here", worker_cpus=[missing])  # fails on the CPU, not the path


def test_config_validates_worker_cpus():
    assert load_settings(env={"CLAWRL__ENGINE__WORKER_CPUS": "[0, 2]"}).engine.worker_cpus == [0, 2]
    assert load_settings(env={}).engine.worker_cpus == []
    for bad in ("[1, 1]", "[-1]"):
        with pytest.raises(ConfigError, match="worker_cpus"):
            load_settings(env={"CLAWRL__ENGINE__WORKER_CPUS": bad})
