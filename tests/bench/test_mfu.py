"""The GPU MFU benchmark: its FLOP count by hand, and one CPU step of each backend (--model tiny)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from clawrl.bench.mfu import SHAPES, compute_flops_per_sequence, count_matmul_params, main
from tests.utils.waiting import run_to_end

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flop_count_by_hand():
    # tiny: per layer H(nq+2nkv)hd = 64*8*32 = 16384, nq*hd*H = 4*32*64 = 8192, 3HF = 3*64*160 = 30720
    # -> 55296; 2 layers = 110592; + output H*V = 64*1024 = 65536 -> N = 176128
    assert count_matmul_params(SHAPES["tiny"]) == 176128
    # per sequence of 32: 6*N*s = 6*176128*32 = 33816576; 12*L*(nq*hd)*s^2 = 12*2*128*1024 = 3145728
    assert compute_flops_per_sequence(SHAPES["tiny"], 32) == 33816576 + 3145728
    # Qwen3-0.6B: per layer 1024*32*128 + 16*128*1024 + 3*1024*3072 = 4194304 + 2097152 + 9437184
    # = 15728640; x28 = 440401920; + 1024*151936 = 155582464 -> 595984384 (596049920 parameters
    # minus the 65536 norm weights: 28*(2*1024 + 2*128) + 1024)
    assert count_matmul_params(SHAPES["qwen3-0.6b"]) == 595984384


@pytest.mark.bench
@pytest.mark.slow  # ~18 s: a fresh interpreter imports megatron-core and transformers
def test_tiny_step_runs_on_cpu_for_both_backends_from_the_same_weights():
    # megatron in a subprocess, to check what it imports: the GPU machine has torch,
    # transformers and megatron-core but none of clawrl's other dependencies (pydantic, prefect)
    code = (
        "import json, sys\n"
        "from clawrl.bench.mfu import main\n"
        "main(['--model', 'tiny', '--device', 'cpu', '--backend', 'megatron', '--steps', '1', '--warmup', '0',"
        " '--seq', '16', '--batch', '2'])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('clawrl'))))\n"
    )
    proc = run_to_end([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    mcore, clawrl_modules = json.loads(lines[0]), json.loads(lines[1])
    assert set(clawrl_modules) <= {"clawrl", "clawrl.bench", "clawrl.bench.mfu", "clawrl.train", "clawrl.train.convert",
                                   "clawrl.train.megatron_model", "clawrl.train.megatron_shims"}

    hf = main(["--model", "tiny", "--device", "cpu", "--backend", "hf", "--steps", "1", "--warmup", "0", "--seq",
               "16", "--batch", "2"])
    for r in (mcore, hf):
        assert (r["device"], r["dtype"]) == ("cpu", "torch.float32") and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["params"] == 176128 + 448  # + norms: 2 * (64 + 64 + 32 + 32) + 64
        assert r["model_tflops_per_step"] == compute_flops_per_sequence(SHAPES["tiny"], 16) * 2 / 1e12
        assert abs(r["loss_first"] - math.log(1024)) < 0.5  # random init: about uniform over 1024 tokens
    assert (mcore["backend"], hf["backend"]) == ("megatron", "hf")
    assert abs(mcore["loss_first"] - hf["loss_first"]) < 1e-4  # same weights, float32
