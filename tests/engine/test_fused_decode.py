"""The fused decode step's maths (clawrl.engine.fused_decode) on the CPU: its layer halves, run
uncompiled (``backend="eager"``), give the runner's op-for-op HF layers' logits exactly; a compiler
that fails leaves the runner decoding unfused. Inductor's compiled kernels run on CUDA: tests/test_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from clawrl.engine.fused_decode import FusedDecode, supports_fused_decode
from clawrl.engine.modeling import CausalLMRunner
from clawrl.models import load_causal_lm, resolve_model_dir

PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 9], [4] * 11]


def _decode_steps(runner: CausalLMRunner, steps: int = 5) -> torch.Tensor:
    """Three rows at different positions, greedy for ``steps`` steps over a span wider than needed."""
    cache = runner.new_cache(4)
    runner.prefill(PROMPTS, [0, 1, 2], cache, [len(p) - 1 for p in PROMPTS])
    tokens, positions = torch.tensor([3, 4, 5]), torch.tensor([len(p) for p in PROMPTS])
    out = []
    for _ in range(steps):
        logits = runner.decode_rows(tokens, positions, cache, int(positions.max()) + 9)
        out.append(logits)
        tokens, positions = logits.argmax(-1), positions + 1
    return torch.stack(out)


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])  # Llama layout; Qwen3 with its q/k norms
def test_the_fused_layer_halves_compute_what_the_runner_computes(model_cache, model):
    runner = CausalLMRunner(load_causal_lm(resolve_model_dir(model, model_cache)), 256)
    plain = _decode_steps(runner)
    runner.fused = FusedDecode(runner.hf, runner.spec.head_dim, backend="eager")
    fused = _decode_steps(runner)
    assert fused.shape == (5, 3, runner.hf.config.vocab_size)
    assert torch.equal(fused, plain)
    assert runner.fused is not None  # it ran fused, no fallback


def test_a_failing_compiler_leaves_the_runner_decoding_unfused(tiny_dir, caplog):
    runner = CausalLMRunner(load_causal_lm(tiny_dir), 256)
    plain = _decode_steps(runner)

    def broken(*args, **kwargs):
        raise RuntimeError("no C compiler found")

    runner.fused = SimpleNamespace(forward=broken)
    with caplog.at_level(logging.WARNING, logger="clawrl.engine"):
        after = _decode_steps(runner)
    assert runner.fused is None
    assert torch.equal(after, plain)
    assert "fused decode failed, decoding unfused from now on: RuntimeError: no C compiler found" in caplog.text


def test_only_silu_rmsnorm_layers_are_fused(tiny_dir):
    model = load_causal_lm(tiny_dir)
    assert supports_fused_decode(model) is None
    model.config.hidden_act = "gelu"
    assert supports_fused_decode(model) == "hidden_act 'gelu' (only 'silu' is fused)"
    runner = CausalLMRunner(model, 256)
    assert runner.fuse_decode() is False and runner.fused is None
