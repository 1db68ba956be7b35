"""A test waits for a `clawrl serve` child on its progress, not on a fixed budget (ServerProcess.wait_ready,
through tests/utils/waiting.py): a child that dies fails the wait at once, one that stops working (no CPU
time, no log) fails it after the stall window, and one that works is waited for however slow the machine
makes it."""

from __future__ import annotations

import os
import signal
import time

import pytest

import tests.utils.gateway_process as gp


def test_a_child_that_dies_fails_the_wait_at_once_with_its_log(tmp_path, model_cache):
    env = gp.serve_env(tmp_path / "data", model_cache, engine__max_batch_size="0")  # refused at load: ge=1
    server = gp.gateway_process(tmp_path, env)
    server.start()
    with pytest.raises(AssertionError, match=r"the process exited \(2\) while waiting for serve [\s\S]*max_batch_size"):
        server.wait_ready()


def test_a_child_that_stops_working_fails_the_wait_after_the_stall_window(tmp_path, model_cache):
    server = gp.gateway_process(tmp_path, gp.serve_env(tmp_path / "data", model_cache))
    server.start()
    os.kill(server.pid, signal.SIGSTOP)  # alive, but it neither answers nor uses CPU nor writes its log
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="gave up waiting for serve .*: no progress for 3 s"):
            server.wait_ready(stall_s=3.0)
        assert time.monotonic() - t0 >= 3.0 and server.proc.poll() is None
    finally:
        server.kill()
